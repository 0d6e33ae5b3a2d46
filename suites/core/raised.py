"""What a member call becomes when it goes wrong: raised inside a member (or
a forward around it), hung, returning what the protocol does not allow, or
leaving arrays that raise when evaluated. Each names the member to fix."""

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from kvparity.suites.core.members import OPTIONAL_MEMBERS


class ImplementationError(Exception):
    """The --impl argument is wrong: a usage error."""


class ImplementationUnavailable(ImplementationError):
    """The implementation's module cannot be imported here: this commit or
    machine cannot be judged. ``missing_module``: the module the spec names,
    where it is not there at all (rather than failing as it imports)."""

    def __init__(self, message: str, missing_module: Optional[str] = None):
        super().__init__(message)
        self.missing_module = missing_module


class LazyArrayFailed(Exception):
    """Computing an array a member left in the batch raised (MLX evaluates
    lazily, so the member itself returned): the error of the member that last
    wrote or reshaped the batch."""

    def __init__(self, error: BaseException):
        super().__init__(f"the arrays it left in the batch could not be computed: "
                         f"{type(error).__name__}: {error}")
        self.__cause__ = error


class MemberRaised(Exception):
    """A protocol member of the implementation under test raised. ``layer``
    and ``at`` say where, once the model's forward that called it is known."""

    def __init__(self, member: str, error: BaseException):
        super().__init__(member, error)
        self.member = member
        self.error = error
        self.layer: Optional[int] = None
        self.at = raised_at(error)
        self.handed = None  # (args, kwargs) the member was called with, where its wrapper saw the call

    def __str__(self):
        where = [f"layer {self.layer}"] if self.layer is not None else []
        where += [f"at {self.at}"] if self.at else []
        return (f"{self.member} raised {type(self.error).__name__}: {self.error}"
                + (f" ({', '.join(where)})" if where else ""))

    @property
    def capability(self):
        """The optional capability that is not supported, or None."""
        if isinstance(self.error, NotImplementedError):
            return OPTIONAL_MEMBERS.get(self.member)
        return None

    @property
    def refused(self) -> bool:
        """A required member declined with NotImplementedError."""
        return isinstance(self.error, NotImplementedError) and self.member not in OPTIONAL_MEMBERS


class ForwardRaised(MemberRaised):
    """The model's forward raised outside every protocol member while it ran
    on the cache under test (a mask it built, an attention wrapper its
    package installs): the implementation's path, so a failure, never a
    refusal or a missing capability."""

    FRAME = "the model's forward"
    ENGINE = "the engine"  # L3: the engine itself, outside the model and every member

    def __init__(self, error: BaseException, frame: str = FRAME):
        super().__init__(frame, error)

    capability = None
    refused = False


class HungEarlier(BaseException):
    """A call of a member that hung earlier in this run (``FLIGHT.hung``):
    it is not made, so that one hang costs one ``--member-timeout``, not one
    per schedule run. A BaseException, as KeyboardInterrupt: the cache's own
    ``except Exception`` and the engine's pass it on to the replay, which
    stops the schedule run there, not judged."""

    def __init__(self, member: str, hung: str):
        super().__init__(member, hung)
        self.member, self.hung = member, hung  # hung: where and after how long, in words

    def __str__(self):
        return f"calls {self.member}, which hung in {self.hung}: not called again"


class ReturnedWrong(MemberRaised):
    """A member returned what the protocol does not allow (a merge that
    returned None): that member's failure, said as what it returned."""

    def __str__(self):
        return str(self.error)

    capability = None
    refused = False


def returned_as_expected(member: str, value, holds: bool, expected: str, said: Callable[[object], str]):
    """What ``member`` returned, about to be used as the protocol says: where
    it is not (``holds`` false) that member's failure, naming the value
    (``said(value)``, in words) and what was expected, never kvparity's error."""
    if not holds:
        raise ReturnedWrong(member, TypeError(f"{member} returned {said(value)}, expected {expected}"))


def handed_unlike_mlx_lm(raised: MemberRaised, batch_class: type) -> str:
    """What the caller handed the member that raised, where mlx-lm's own
    engine hands it nothing of the kind (``BatchGenerator`` merges solo
    ``QuantizedKVCache`` rows of the batch's bits and group size, and extends
    a batch with one of the same class), in words; empty otherwise."""
    if raised.handed is None:
        return ""
    args, kwargs = raised.handed
    if raised.member == "merge" and args and isinstance(args[0], (list, tuple)):
        rows = list(args[0])
        dense = [(i, row) for i, row in enumerate(rows) if not hasattr(row, "bits")]
        if dense:
            i, row = dense[0]
            return f"an unquantized {type(row).__name__} as row {i} of {len(rows)}"
        kinds = {(row.bits, row.group_size) for row in rows}
        if len(kinds) > 1:
            return f"rows of different bits and group sizes {sorted(kinds)}"
    if raised.member == "extend" and args and not isinstance(args[0], batch_class):
        return f"an object of class {type(args[0]).__name__} to extend with, not a batch of {batch_class.__name__}"
    return ""


class OutputRaised(MemberRaised):
    """mlx-lm (or the model) raised while it consumed what a member returned
    (an extracted row, a merged batch, a mask): that member's failure, with
    what it returned, never kvparity's own error and never a refusal."""

    def __init__(self, member: str, error: BaseException, consumer: str, value: str):
        super().__init__(member, error)
        self.consumer, self.value = consumer, value

    def __str__(self):
        return (f"{self.consumer} raised {type(self.error).__name__}: {self.error}"
                + (f" (at {self.at})" if self.at else "") + f", on what {self.member} returned: {self.value}")

    capability = None
    refused = False


@contextmanager
def consuming(member: str, consumer: str, value: Callable[[], str]):
    """mlx-lm's ``consumer`` runs on what ``member`` returned; what it raises
    is that member's failure (``value()``: what it returned, in words)."""
    try:
        yield
    except MemberRaised:
        raise
    except Exception as error:
        raise OutputRaised(member, error, consumer, value()) from error


def raised_at(error: BaseException) -> str:
    """The innermost Python frame of ``error``: ``models/llama.py:83 in __call__``."""
    tb = error.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{'/'.join(Path(code.co_filename).parts[-2:])}:{tb.tb_lineno} in {code.co_name}"


def layer_of(error: BaseException, layers) -> Optional[int]:
    """The index in ``layers`` (a model's transformer blocks) of the innermost
    block whose call the traceback of ``error`` passes through."""
    found, tb = None, error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        for i, layer in enumerate(layers):
            if owner is layer:
                found = i
        tb = tb.tb_next
    return found


def in_forward(error: BaseException, model) -> bool:
    """Whether the traceback of ``error`` passes through a call of ``model``."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is model:
            return True
        tb = tb.tb_next
    return False


@contextmanager
def forward_of(model, frame: str = ForwardRaised.FRAME):
    """Run a forward of ``model`` on the cache under test: what raises in it
    is the implementation's path, named with the layer it was in."""
    try:
        yield
    except MemberRaised as raised:
        raised.layer = layer_of(raised, getattr(model, "layers", ()))
        raise
    except Exception as error:
        raised = ForwardRaised(error, frame)
        raised.layer = layer_of(error, getattr(model, "layers", ()))
        raise raised from error
