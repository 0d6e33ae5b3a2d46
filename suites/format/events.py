"""Event kinds: one small frozen class per kind of a schedule's timeline.

An event is stored as an object with one key, its kind: ``{"step": 2}``.
Each kind parses its arguments through the small functions below (kinds
whose arguments have the same shape share it: a list of requests, one
request, a count, counts per request; no kind derives from another kind), says
which requests it names, and how shrinking may make it smaller
(``suites/search/shrink.py`` asks the event, never its kind's name). What an event
does to the batch is the replay core's ``Replay._<kind>`` (``suites/core/replay.py``).
A new kind is a class here, added to ``KINDS``, and its method there.
"""

import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import ClassVar, Dict, Iterator, Mapping, Optional, Tuple

from kvparity.suites.format.errors import ScheduleError

# -- the arguments' shapes ------------------------------------------------------


def count_of(where, value, minimum=1, what="a count") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def ids_of(where, args) -> Tuple[str, ...]:
    if not isinstance(args, list) or not args or not all(isinstance(r, str) for r in args):
        raise ScheduleError(f"{where}: expected a non-empty list of request ids")
    if len(set(args)) != len(args):
        raise ScheduleError(f"{where}: a request is named twice")
    return tuple(args)


def id_of(where, args) -> str:
    if not isinstance(args, str):
        raise ScheduleError(f"{where}: expected one request id, got {args!r}")
    return args


def amounts_of(where, args, minimum, what) -> Dict[str, int]:
    if not isinstance(args, dict):
        raise ScheduleError(f"{where}: expected an object of request id -> {what}")
    return {rid: count_of(where, n, minimum, f"{what} for {rid!r}") for rid, n in args.items()}


def without_id(ids: Tuple[str, ...], rid: str) -> Tuple[str, ...]:
    return tuple(r for r in ids if r != rid)


def without_key(amounts: Mapping[str, int], rid: str) -> Dict[str, int]:
    return {r: n for r, n in amounts.items() if r != rid}


# -- the kinds --------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """What every kind has: its position, its JSON form and its label."""

    index: int
    kind: ClassVar[str] = ""

    @property
    def args(self):
        raise NotImplementedError

    def to_json(self) -> dict:
        return {self.kind: self.args}

    @cached_property
    def label(self) -> str:
        """How reports name the event: ``#3 step 2``."""
        return f"#{self.index} {self.kind} {json.dumps(self.args, separators=(',', ':'))}"

    @property
    def named(self) -> Tuple[str, ...]:
        """The requests the event names."""
        return ()

    def without(self, rid: str) -> Optional["Event"]:
        """The event with ``rid`` forgotten; None when nothing is left of it."""
        return self

    def smaller(self) -> Iterator["Event"]:
        """Smaller forms of the event (lower counts), for shrinking."""
        return iter(())


# Shapes of arguments several kinds share. A kind takes its shape's parsing
# and shrinking; no kind derives from another kind.


@dataclass(frozen=True)
class NamesRequests(Event):
    """A kind whose argument is a list of request ids."""

    requests: Tuple[str, ...] = ()

    @classmethod
    def parse(cls, index, where, args):
        return cls(index, ids_of(where, args))

    @property
    def args(self):
        return list(self.requests)

    @property
    def named(self):
        return self.requests

    def without(self, rid):
        rest = without_id(self.requests, rid)
        return replace(self, requests=rest) if rest else None


@dataclass(frozen=True)
class NamesOneRequest(Event):
    """A kind whose argument is one request id."""

    request: str = ""

    @classmethod
    def parse(cls, index, where, args):
        return cls(index, id_of(where, args))

    @property
    def args(self):
        return self.request

    @property
    def named(self):
        return (self.request,)

    def without(self, rid):
        return None if self.request == rid else self


@dataclass(frozen=True)
class CountsPerRequest(Event):
    """A kind whose argument maps request ids to counts."""

    amounts: Mapping[str, int] = field(default_factory=dict)
    minimum: ClassVar[int] = 0  # the least count a request may get
    what: ClassVar[str] = "count"  # a count's name, in errors
    when_empty: ClassVar[str] = ""  # the error for an empty object

    @classmethod
    def parse(cls, index, where, args):
        amounts = amounts_of(where, args, cls.minimum, cls.what)
        if not amounts:
            raise ScheduleError(f"{where}: {cls.when_empty}")
        return cls(index, amounts)

    @property
    def args(self):
        return dict(self.amounts)

    @property
    def named(self):
        return tuple(self.amounts)

    def without(self, rid):
        rest = without_key(self.amounts, rid)
        return replace(self, amounts=rest) if rest else None


@dataclass(frozen=True)
class Counts(Event):
    """A kind whose argument is a count for every running row."""

    n: int = 1

    @classmethod
    def parse(cls, index, where, args):
        return cls(index, count_of(where, args, what=cls.kind))

    @property
    def args(self):
        return self.n

    def smaller(self):
        if self.n > 1:
            yield replace(self, n=self.n - 1)


@dataclass(frozen=True)
class Join(NamesRequests):
    """Each request prefills alone through mlx-lm, then merge + extend."""

    kind: ClassVar[str] = "join"


@dataclass(frozen=True)
class BatchedJoin(NamesRequests):
    """The prompts prefill in one right-padded call (prepare/finalize)."""

    kind: ClassVar[str] = "batched_join"


@dataclass(frozen=True)
class Leave(NamesRequests):
    """The rows finish: filter keeps the others."""

    kind: ClassVar[str] = "leave"


@dataclass(frozen=True)
class Step(Counts):
    """n decode steps: one token for every running row per step."""

    kind: ClassVar[str] = "step"


@dataclass(frozen=True)
class Trim(Counts):
    """Drop the last n tokens of every running row."""

    kind: ClassVar[str] = "trim"


@dataclass(frozen=True)
class SpecRound(Event):
    """A verify window of k+1 tokens for every row in one call; each row keeps
    its accepted drafts plus one and rolls back the rest."""

    k: int = 1
    accepted: Mapping[str, int] = field(default_factory=dict)
    kind: ClassVar[str] = "spec_round"

    @classmethod
    def parse(cls, index, where, args):
        if not isinstance(args, dict) or set(args) - {"k", "accepted"} or "k" not in args:
            raise ScheduleError(f'{where}: expected {{"k": drafts, "accepted": {{request: count}}}}')
        k = count_of(where, args["k"], what="k")
        accepted = amounts_of(where, args.get("accepted", {}), 0, "count")
        for rid, a in accepted.items():
            if a > k:
                raise ScheduleError(f"{where}: {rid!r} accepts {a} of only k={k} drafts")
        return cls(index, k, accepted)

    @property
    def args(self):
        return {"k": self.k, "accepted": dict(self.accepted)}

    @property
    def named(self):
        return tuple(self.accepted)

    def without(self, rid):  # the round still runs for the other rows
        return replace(self, accepted=without_key(self.accepted, rid))

    def smaller(self):
        if self.k > 1:
            k = self.k - 1
            yield replace(self, k=k, accepted={r: min(a, k) for r, a in self.accepted.items()})


@dataclass(frozen=True)
class Rollback(CountsPerRequest):
    """Drop the last n tokens of the named rows (others 0)."""

    kind: ClassVar[str] = "rollback"
    minimum: ClassVar[int] = 0
    what: ClassVar[str] = "count"
    when_empty: ClassVar[str] = "rollback names no request"


@dataclass(frozen=True)
class Extract(NamesOneRequest):
    """Preempt: the row leaves the batch as a solo cache."""

    kind: ClassVar[str] = "extract"


@dataclass(frozen=True)
class SoloStep(CountsPerRequest):
    """Extracted requests decode alone, each its own number of steps."""

    kind: ClassVar[str] = "solo_step"
    minimum: ClassVar[int] = 1
    what: ClassVar[str] = "steps"
    when_empty: ClassVar[str] = "expected an object of extracted request id -> steps"


@dataclass(frozen=True)
class Reinsert(NamesOneRequest):
    """The extracted request comes back (merge + extend)."""

    kind: ClassVar[str] = "reinsert"


@dataclass(frozen=True)
class NamesStoreAndRequests(NamesRequests):
    """A kind whose argument names a prompt-cache store and a list of request ids."""

    store: str = ""
    field_name: ClassVar[str] = ""  # the store's key: "into" or "from"

    @classmethod
    def parse(cls, index, where, args):
        key = cls.field_name
        if not isinstance(args, dict) or set(args) != {key, "requests"}:
            raise ScheduleError(f'{where}: expected {{"{key}": store, "requests": [request ids]}}')
        if not isinstance(args[key], str) or not args[key]:
            raise ScheduleError(f"{where}: {key}: expected a store name, got {args[key]!r}")
        return cls(index, store=args[key], requests=ids_of(f"{where}: requests", args["requests"]))

    @property
    def args(self):
        return {self.field_name: self.store, "requests": list(self.requests)}


@dataclass(frozen=True)
class Store(NamesStoreAndRequests):
    """Each row's cache leaves the batch through ``extract`` into a prompt-cache
    store (mlx-lm's LRUPromptCache), keyed by the tokens it holds, as
    mlx-lm's server stores a finished prompt or request; the rows stay."""

    kind: ClassVar[str] = "store"
    field_name: ClassVar[str] = "into"


@dataclass(frozen=True)
class JoinStored(NamesStoreAndRequests):
    """Each request starts from the store's nearest prefix of its prompt
    (``fetch_nearest_cache``), prefills the rest alone through mlx-lm, then
    merge + extend."""

    kind: ClassVar[str] = "join_stored"
    field_name: ClassVar[str] = "from"


@dataclass(frozen=True)
class BatchedJoinStored(NamesStoreAndRequests):
    """As mlx-lm's BatchGenerator admits several requests at once: each starts
    from the store's nearest prefix of its prompt, or from nothing where the
    store holds none, the rows are merged as they are (a row of no tokens
    beside rows holding a prefix), and the rests of the prompts prefill in one
    right-padded call (prepare/finalize)."""

    kind: ClassVar[str] = "batched_join_stored"
    field_name: ClassVar[str] = "from"


KINDS = {cls.kind: cls for cls in (Join, BatchedJoin, Step, Leave, SpecRound, Rollback, Trim,
                                   Extract, SoloStep, Reinsert, Store, JoinStored, BatchedJoinStored)}
EVENT_KINDS = tuple(KINDS)
FROM_A_STORE = (JoinStored.kind, BatchedJoinStored.kind)  # kinds whose requests start from a store


def make_event(cls, source, index, args) -> Event:
    """An event of kind ``cls`` from its JSON arguments, validated."""
    return cls.parse(index, f"{source}: event #{index} {cls.kind} {json.dumps(args, separators=(',', ':'))}", args)


def parse_event(source, index, doc) -> Event:
    where = f"{source}: event #{index}"
    if not isinstance(doc, dict) or len(doc) != 1:
        raise ScheduleError(f"{where}: an event is an object with exactly one key, its kind")
    (kind, args), = doc.items()
    if kind not in KINDS:
        raise ScheduleError(f"{where}: unknown event {kind!r} (known: {', '.join(EVENT_KINDS)})")
    return make_event(KINDS[kind], source, index, args)
