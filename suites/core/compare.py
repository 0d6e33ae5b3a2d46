"""The comparator: whether two arrays are equal, and where they first differ.

Equal means same dtype, same shape and same bits (``oracle/arrays.py``).
Every comparison made here is one piece of evidence; every difference is a
``Divergence`` that names where it was seen.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from kvparity.oracle.arrays import Part, Reading, raw_many
from kvparity.suites.core.members import READING_MEMBERS
from kvparity.suites.format.checks import BYTES, LAYOUT, LEFT_PADDING

TRIPLE = ("packed", "scales", "biases")


@dataclass(frozen=True)
class Divergence:
    check: str  # which property broke: "bytes", "offset", "mask", "alias", ...
    event: str  # the event after which it was seen: "#3 step 2"
    request: Optional[str] = None  # None: the batch as a whole
    tensor: str = ""  # e.g. "keys.scales", "logits"
    layer: Optional[int] = None
    step: Optional[int] = None  # the request's call (L2) or token (L3)
    index: Optional[int] = None  # flat index of the first differing element
    expected: object = None
    actual: object = None
    detail: str = ""
    # L3, where the engine makes the calls: the members that reshaped the batch
    # between the request's arrival and this divergence, in order of first call.
    reshaped: Tuple[str, ...] = ()
    # L1: the protocol call of its event after which it was seen (its place
    # among the event's calls on the batch, layers counted apart), and the
    # member the evidence is against: that call's, or the member whose own
    # output the check read (an extracted row, a mask, nbytes).
    call: Optional[int] = None
    member: str = ""

    @property
    def event_index(self) -> int:
        """The event's position in the schedule (-1 for traces without one)."""
        head = self.event.split()[0].lstrip("#") if self.event else ""
        return int(head) if head.isdigit() else -1

    @property
    def order(self):
        """Sort key: earliest by event, then by step, then by call; at one
        call, what the call left in the batch before what a check read from
        another member (an extract of a wrong batch is wrong too)."""
        return (self.event_index, -1 if self.step is None else self.step, -1 if self.call is None else self.call,
                self.member in READING_MEMBERS)

    def message(self) -> str:
        where = [f"after event {self.event}"]
        if self.call is not None and self.member and self.member not in READING_MEMBERS:
            where[0] += f" (its call {self.call + 1}, {self.member})"
        if self.request is not None:
            where.append(f"row {self.request!r}")
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.tensor:
            where.append(self.tensor)
        if self.index is not None:
            where.append(f"flat index {self.index}")
        text = f"{self.check}: " + ", ".join(where)
        if self.expected is not None or self.actual is not None:
            text += f": expected {self.expected!r}, got {self.actual!r}"
            if self.detail:
                text += f" ({self.detail})"
        elif self.detail:  # a sentence of its own: what was returned, and what was expected
            text += f": {self.detail}"
        return text


def first_difference(expected: mx.array, actual: mx.array, bits=None):
    """None when equal; else (flat index or None, expected, actual) describing it.
    The index is None when dtype or shape differ (not comparable).
    ``bits`` may carry both arrays' raw views when the caller already has them."""
    if expected.dtype != actual.dtype:
        return None, str(expected.dtype), str(actual.dtype)
    e, a = bits if bits is not None else raw_many([expected, actual])
    if e.shape != a.shape:  # the raw views have the arrays' shapes
        return None, tuple(expected.shape), tuple(actual.shape)
    if e.tobytes() == a.tobytes():  # same shape and element size: equal bytes are equal elements
        return None
    differ = np.flatnonzero(e != a)
    if differ.size == 0:
        return None
    i = int(differ[0])
    return i, _value(expected, i), _value(actual, i)


def _value(x: mx.array, flat_index: int):
    if isinstance(x, Part):
        return x.value(flat_index)
    return x.reshape(-1)[flat_index].item()


def compare_named(expected: dict, actual: dict, prefix: str = "", **where) -> List[Divergence]:
    """Compare two {name: array} maps name by name, all evaluated together.
    A missing or extra name, or a dtype or shape that differs, is ``layout``."""
    return compare_all([(expected, actual, prefix, where)])[0]


def compare_all(jobs) -> List[List[Divergence]]:
    """Many ``(expected, actual, prefix, where)`` comparisons with one
    evaluation of every array involved: MLX work is batched, not per array."""
    return compare_later(Reading(), jobs)()


def compare_later(reading: Reading, jobs, known=None):
    """``compare_all`` with its arrays taken into ``reading`` now (``known``:
    as for ``Reading.take``): the returned function gives the divergences
    once ``reading`` was evaluated."""
    pairs = [(e[name], a[name]) for e, a, _, _ in jobs for name in e if a.get(name) is not None]
    arrays = [x for pair in pairs for x in pair]
    # Parts were taken when they were sliced; everything else is taken here.
    ticket = reading.take([x for x in arrays if not isinstance(x, Part)], known)

    def answer() -> List[List[Divergence]]:
        reading.evaluate()
        taken = iter(reading[ticket])
        bits = [x.bits if isinstance(x, Part) else next(taken) for x in arrays]
        return _compare(jobs, iter(zip(bits[0::2], bits[1::2])))

    return answer


def _compare(jobs, bits) -> List[List[Divergence]]:
    results = []
    for expected, actual, prefix, where in jobs:
        found = []
        for name, e in expected.items():
            a = actual.get(name)
            if a is None:
                found.append(Divergence(LAYOUT, tensor=prefix + name, expected=tuple(e.shape), actual=None,
                                        detail="missing", **where))
                continue
            diff = first_difference(e, a, next(bits))
            if diff is not None:
                index, want, got = diff
                found.append(Divergence(BYTES if index is not None else LAYOUT, tensor=prefix + name,
                                        index=index, expected=want, actual=got, **where))
        for name in actual:
            if name not in expected:
                found.append(Divergence(LAYOUT, tensor=prefix + name, expected=None,
                                        actual=tuple(actual[name].shape), detail="not expected", **where))
        results.append(found)
    return results


def triple_job(expected, actual, name: str, check: str = LAYOUT, **where):
    """A comparison of two (packed, scales, biases) triples for ``compare_all``,
    or, for a triple that is missing or malformed, the ``check`` divergence
    saying what was there instead."""
    if expected is None or actual is None or not isinstance(actual, (tuple, list)) or len(actual) != 3:
        return Divergence(check, tensor=name, detail=f"found {in_words(actual, where_a_triple=True)}, "
                                                     f"expected {a_triple(expected)}", **where)
    return dict(zip(TRIPLE, expected)), dict(zip(TRIPLE, actual)), f"{name}.", where


def left_padding_divergence(row: int, tokens: int, size: int, pad: int, width: Optional[int] = None,
                            **where) -> Divergence:
    """Row ``row`` holds ``tokens`` (the solo offset) but the batch says
    ``size - pad``: said as the rule and the two values it came from.
    ``width``: the width update_and_fetch returned, where every row's left
    padding and length end there and size() alone says otherwise
    (``size_is_odd``): size()'s own output, then, blamed by construction."""
    said = (f"size() - left_padding[{row}] should be the row's {tokens} tokens; size() is {size}, "
            f"left_padding[{row}] is {pad}")
    if width is not None:
        said += (f"; update_and_fetch returned {width} columns, where every row's left padding and length end: "
                 "size() is the one that disagrees")
        where = {**where, "member": "size"}
    return Divergence(LEFT_PADDING, expected=tokens, actual=size - pad, detail=said, **where)


def size_is_odd(size: int, pads, lengths, width: Optional[int]) -> bool:
    """size() alone disagrees: every row's left padding plus its length is
    the width update_and_fetch returned (``width``; None: not known), and
    size() says another."""
    return width is not None and size != width and all(p + n == width for p, n in zip(pads, lengths))


def a_triple(triple) -> str:
    """What a (packed, scales, biases) triple like ``triple`` is, in words."""
    if triple is None:
        return "no triple (the solo row holds none)"
    dtypes = [_dtype(x) for x in triple]
    return (f"a (packed {dtypes[0]}, scales, biases) triple of {dtypes[1]} scales and biases, of shapes "
            + ", ".join(str(tuple(x.shape)) for x in triple))


FLOATS = (mx.bfloat16, mx.float16, mx.float32)


def in_words(value, where_a_triple: bool = False) -> str:
    """What a member returned, in words, never a bare Python type name;
    ``where_a_triple``: a float array stands where quantized data should."""
    if value is None:
        return "nothing (None)"
    if isinstance(value, (mx.array, Part)):
        dtype, shape = _dtype(value), tuple(value.shape)
        if where_a_triple and value.dtype in FLOATS:
            return f"an unquantized {dtype} array of shape {shape}"
        return f"{'an' if dtype[0] in 'aeio' else 'a'} {dtype} array of shape {shape}"
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        if not value:
            return f"an empty {kind}"
        shown = "; ".join(in_words(v) for v in value[:4]) + ("; ..." if len(value) > 4 else "")
        return f"a {kind} of {len(value)} ({shown})"
    if isinstance(value, (bool, int, float, str)):
        return f"the value {value!r}"
    return f"an object of class {type(value).__name__}"


def row_in_words(cache) -> str:
    """A solo row a member returned, in words: its class, offset, bits,
    group size and what it holds as keys and values."""
    held = "; ".join(f"{name} {in_words(getattr(cache, name, None))}" for name in ("keys", "values"))
    return (f"{type(cache).__name__}(offset {getattr(cache, 'offset', None)!r}, bits {getattr(cache, 'bits', None)!r}, "
            f"group_size {getattr(cache, 'group_size', None)!r}; {held})")


def rows_in_words(caches) -> str:
    """One row's caches, one per layer, in words."""
    caches = list(caches)
    if len(caches) == 1:
        return row_in_words(caches[0])
    return "; ".join(f"layer {i}: {row_in_words(c)}" for i, c in enumerate(caches))


def _dtype(x) -> str:
    return str(x.dtype).rsplit(".", 1)[-1]

def state_triples(state):
    """{"keys": triple, "values": triple} from a state or a fetch result, or None."""
    try:
        keys, values = state[0], state[1]
    except (TypeError, IndexError, KeyError):
        return None
    for triple in (keys, values):
        if not isinstance(triple, (tuple, list)) or len(triple) != 3 or not all(
                isinstance(x, mx.array) and x.ndim == 4 for x in triple):
            return None
    return {"keys": tuple(keys), "values": tuple(values)}
