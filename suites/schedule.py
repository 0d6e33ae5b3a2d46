"""Schedules: requests plus a timeline of events, stored as JSON files.

A schedule file looks like this (every key is documented in
suites/catalog/README.md)::

    {
      "name": "join-longer-joiner",
      "description": "a joiner longer than the batch widens every row's padding",
      "levels": ["L1", "L2"],
      "kv": {"bits": 4, "group_size": 64},
      "synthetic": {"kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"},
      "requests": {"a": {"prompt_len": 5}, "b": {"prompt_len": 40}},
      "events": [{"join": ["a"]}, {"step": 2}, {"join": ["b"]}, {"step": 3}]
    }

``load`` validates a file completely before anything runs: a bad file gets a
``ScheduleError`` naming the file, the event and the reason.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvparity.impl.batch_quantized import check_quantization

LEVELS = ("L1", "L2")
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_PREFILL_STEP = 2048

CATALOG = Path(__file__).parent / "catalog"
REAL_CATALOG = CATALOG / "real"  # schedules for the real model (SmolLM2)


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names file, event and reason."""


@dataclass(frozen=True)
class Request:
    id: str
    prompt_len: int
    prompt: Optional[Tuple[int, ...]] = None  # token ids, when given
    text: Optional[str] = None  # L2 only: tokenized by the model
    quantized_kv_start: int = 0
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    seed: int = 0

    def prefill_chunks(self, prompt_len: Optional[int] = None) -> List[int]:
        """Chunk sizes in which mlx-lm's generate_step processes the prompt:
        all but the last token in prefill_step_size pieces, then the last one."""
        n = self.prompt_len if prompt_len is None else prompt_len
        chunks, rest = [], n - 1
        while rest > 0:
            chunks.append(min(self.prefill_step_size, rest))
            rest -= chunks[-1]
        return chunks + [1]


@dataclass(frozen=True)
class Call:
    """One thing a request sees, alone or in the batch: the oracle replays these."""

    event: int  # index of the event that makes the call
    op: str  # "prefill" (n prompt tokens, in chunks), "append" (n tokens in one call), "trim"
    n: int


@dataclass(frozen=True)
class Event:
    index: int
    kind: str
    args: object

    def describe(self) -> str:
        return f"#{self.index} {self.kind} {json.dumps(self.args, separators=(',', ':'))}"


@dataclass
class Schedule:
    name: str
    description: str
    levels: Tuple[str, ...]
    bits: int
    group_size: int
    requests: Dict[str, Request]
    events: List[Event]
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    model: Optional[str] = None
    path: Optional[str] = None
    needs: Tuple[str, ...] = field(default_factory=tuple)  # optional capabilities
    calls: Dict[str, List[Call]] = field(default_factory=dict)  # per request, in order

    def calls_at(self, event: int) -> Dict[str, List[Call]]:
        return {
            rid: [c for c in calls if c.event == event]
            for rid, calls in self.calls.items()
            if any(c.event == event for c in calls)
        }

    def to_json(self) -> dict:
        requests = {}
        for r in self.requests.values():
            entry = {"prompt_len": r.prompt_len}
            if r.prompt is not None:
                entry = {"prompt": list(r.prompt)}
            if r.text is not None:
                entry = {"text": r.text}
            defaults = Request(id=r.id, prompt_len=1)
            for key in ("quantized_kv_start", "prefill_step_size", "seed"):
                if getattr(r, key) != getattr(defaults, key):
                    entry[key] = getattr(r, key)
            requests[r.id] = entry
        doc = {
            "name": self.name,
            "description": self.description,
            "levels": list(self.levels),
            "kv": {"bits": self.bits, "group_size": self.group_size},
            "synthetic": {
                "kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "dtype": self.dtype,
            },
            "requests": requests,
            "events": [{e.kind: e.args} for e in self.events],
        }
        if self.model:
            doc["model"] = self.model
        return doc


def load(path) -> Schedule:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as error:
        raise ScheduleError(f"{path}: cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ScheduleError(f"{path}: not JSON: {error}") from None
    return parse(doc, source=str(path))


def save(schedule: Schedule, path) -> Path:
    """Write atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(schedule.to_json(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def catalog_paths(level: Optional[str] = None, folder: Path = CATALOG) -> List[Path]:
    paths = sorted(Path(folder).glob("*.json"))
    if level is None:
        return paths
    return [p for p in paths if level in load(p).levels]


# -- validation ------------------------------------------------------------------


def _fail(source, where, reason):
    raise ScheduleError(f"{source}: {where}: {reason}")


def _int(source, where, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(source, where, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _keys(source, where, doc, allowed, required=()):
    if not isinstance(doc, dict):
        _fail(source, where, f"expected an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        _fail(source, where, f"unknown field {unknown[0]!r} (known: {', '.join(allowed)})")
    for key in required:
        if key not in doc:
            _fail(source, where, f"missing field {key!r}")


def parse(doc, source="<schedule>") -> Schedule:
    _keys(
        source,
        "schedule",
        doc,
        ("name", "description", "levels", "kv", "synthetic", "model", "requests", "events"),
        ("name", "requests", "events"),
    )
    levels = tuple(doc.get("levels", LEVELS))
    for level in levels:
        if level not in LEVELS:
            _fail(source, "levels", f"unknown level {level!r} (known: {', '.join(LEVELS)})")

    kv = doc.get("kv", {})
    _keys(source, "kv", kv, ("bits", "group_size"))
    bits = _int(source, "kv.bits", kv.get("bits", 4), 1)
    group_size = _int(source, "kv.group_size", kv.get("group_size", 64), 1)
    synthetic = doc.get("synthetic", {})
    _keys(source, "synthetic", synthetic, ("kv_heads", "head_dim", "dtype"))
    kv_heads = _int(source, "synthetic.kv_heads", synthetic.get("kv_heads", 2), 1)
    head_dim = _int(source, "synthetic.head_dim", synthetic.get("head_dim", 64), 1)
    dtype = synthetic.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        _fail(source, "synthetic.dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    try:
        check_quantization(bits, group_size, head_dim if "L1" in levels else None)
    except ValueError as error:
        _fail(source, "kv", str(error))

    requests = {}
    if not isinstance(doc["requests"], dict) or not doc["requests"]:
        _fail(source, "requests", "expected a non-empty object of request id -> request")
    for rid, spec in doc["requests"].items():
        requests[rid] = _request(source, rid, spec, levels)

    if not isinstance(doc["events"], list) or not doc["events"]:
        _fail(source, "events", "expected a non-empty list of events")
    events = [_event(source, i, e) for i, e in enumerate(doc["events"])]
    schedule = Schedule(
        name=str(doc["name"]),
        description=str(doc.get("description", "")),
        levels=levels,
        bits=bits,
        group_size=group_size,
        requests=requests,
        events=events,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        model=doc.get("model"),
        path=source,
    )
    simulation = Simulation(schedule)
    schedule.needs = simulation.run()
    schedule.calls = simulation.calls
    return schedule


def _request(source, rid, spec, levels) -> Request:
    where = f"request {rid!r}"
    _keys(
        source,
        where,
        spec,
        ("prompt_len", "prompt", "text", "quantized_kv_start", "prefill_step_size", "seed"),
    )
    given = [k for k in ("prompt_len", "prompt", "text") if k in spec]
    if len(given) != 1:
        _fail(source, where, "give exactly one of prompt_len, prompt (token ids) or text")
    prompt = text = None
    if "prompt" in spec:
        tokens = spec["prompt"]
        if not isinstance(tokens, list) or not tokens:
            _fail(source, where, "prompt must be a non-empty list of token ids")
        prompt = tuple(_int(source, f"{where} prompt", t) for t in tokens)
        prompt_len = len(prompt)
    elif "text" in spec:
        if "L1" in levels:
            _fail(source, where, "a text prompt needs a tokenizer: L1 schedules take prompt_len")
        text = spec["text"]
        if not isinstance(text, str) or not text:
            _fail(source, where, "text must be a non-empty string")
        prompt_len = 0  # known once tokenized
    else:
        prompt_len = _int(source, f"{where} prompt_len", spec["prompt_len"], 1)
    return Request(
        id=rid,
        prompt_len=prompt_len,
        prompt=prompt,
        text=text,
        quantized_kv_start=_int(source, f"{where} quantized_kv_start", spec.get("quantized_kv_start", 0)),
        prefill_step_size=_int(
            source, f"{where} prefill_step_size", spec.get("prefill_step_size", DEFAULT_PREFILL_STEP), 1
        ),
        seed=_int(source, f"{where} seed", spec.get("seed", 0)),
    )


EVENT_KINDS = (
    "join",
    "batched_join",
    "step",
    "leave",
    "spec_round",
    "rollback",
    "extract",
    "solo_step",
    "reinsert",
    "trim",
)


def _event(source, index, doc) -> Event:
    where = f"event #{index}"
    if not isinstance(doc, dict) or len(doc) != 1:
        _fail(source, where, "an event is an object with exactly one key, its kind")
    (kind, args), = doc.items()
    if kind not in EVENT_KINDS:
        _fail(source, where, f"unknown event {kind!r} (known: {', '.join(EVENT_KINDS)})")
    return Event(index, kind, args)


class Simulation:
    """Walks the events over batch membership, refusing what cannot happen.

    Returns the optional capabilities the schedule needs.
    """

    def __init__(self, schedule: Schedule):
        self.s = schedule
        self.batch: List[str] = []  # row order
        self.preempted: List[str] = []
        self.gone: List[str] = []
        self.length: Dict[str, int] = {}
        self.generated: Dict[str, int] = {}
        self.needs = set()
        self.calls: Dict[str, List[Call]] = {rid: [] for rid in schedule.requests}
        self.event = None

    def fail(self, event, reason):
        _fail(self.s.path, f"event {event.describe()}", reason)

    def request(self, event, rid):
        if not isinstance(rid, str) or rid not in self.s.requests:
            self.fail(event, f"unknown request {rid!r}")
        return self.s.requests[rid]

    def in_batch(self, event, rid):
        self.request(event, rid)
        if rid not in self.batch:
            state = "was extracted" if rid in self.preempted else (
                "has left" if rid in self.gone else "has not joined"
            )
            self.fail(event, f"request {rid!r} is not in the batch (it {state})")

    def id_list(self, event, args):
        if not isinstance(args, list) or not args:
            self.fail(event, "expected a non-empty list of request ids")
        if len(set(args)) != len(args):
            self.fail(event, "a request is named twice")
        return args

    def amounts(self, event, args):
        if not isinstance(args, dict):
            self.fail(event, "expected an object of request id -> count")
        for rid, n in args.items():
            self.in_batch(event, rid)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                self.fail(event, f"count for {rid!r} must be an integer >= 0, got {n!r}")
        return args

    def roll_back(self, event, rid, n):
        if n > self.generated[rid]:
            self.fail(
                event,
                f"rollback of {n} for {rid!r} is past what it generated ({self.generated[rid]})",
            )
        if n:
            self.length[rid] -= n
            self.generated[rid] -= n
            self.calls[rid].append(Call(event.index, "trim", n))

    def append(self, rids, n, times=1):
        """`times` separate calls of n tokens each, for every request in rids."""
        for _ in range(times):
            for rid in rids:
                self.length[rid] += n
                self.generated[rid] += n
                self.calls[rid].append(Call(self.event.index, "append", n))

    def run(self) -> Tuple[str, ...]:
        for event in self.s.events:
            self.event = event
            getattr(self, f"on_{event.kind}")(event, event.args)
        return tuple(sorted(self.needs))

    def on_join(self, event, args):
        for rid in self.id_list(event, args):
            request = self.request(event, rid)
            if rid in self.batch or rid in self.preempted or rid in self.gone:
                self.fail(event, f"request {rid!r} already joined")
            self.batch.append(rid)
            self.length[rid] = request.prompt_len
            self.generated[rid] = 0
            self.calls[rid].append(Call(event.index, "prefill", request.prompt_len))

    def on_batched_join(self, event, args):
        if "L2" in self.s.levels:
            self.fail(event, "batched_join (padded batched prefill) is an L1 event")
        self.on_join(event, args)
        for rid in args:
            request = self.s.requests[rid]
            if request.quantized_kv_start > request.prompt_len:
                self.fail(event, f"{rid!r} would join unquantized: batched_join prefills straight into "
                          "the quantized batch, so quantized_kv_start must be <= prompt_len")

    def on_step(self, event, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            self.fail(event, f"step takes a count >= 1, got {n!r}")
        if not self.batch:
            self.fail(event, "step on an empty batch")
        self.append(self.batch, 1, times=n)

    def on_leave(self, event, args):
        for rid in self.id_list(event, args):
            self.in_batch(event, rid)
            self.batch.remove(rid)
            self.gone.append(rid)

    def on_spec_round(self, event, args):
        if not isinstance(args, dict) or set(args) - {"k", "accepted"} or "k" not in args:
            self.fail(event, 'expected {"k": drafts, "accepted": {request: count}}')
        k = args["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            self.fail(event, f"k must be an integer >= 1, got {k!r}")
        if not self.batch:
            self.fail(event, "spec_round on an empty batch")
        accepted = self.amounts(event, args.get("accepted", {}))
        for rid, a in accepted.items():
            if a > k:
                self.fail(event, f"{rid!r} accepts {a} of only k={k} drafts")
        self.append(self.batch, k + 1)
        dropped = {rid: k - accepted.get(rid, k) for rid in self.batch}
        if len(set(dropped.values())) > 1:
            self.needs.add("per_row_rollback")
        for rid, n in dropped.items():
            self.roll_back(event, rid, n)

    def on_rollback(self, event, args):
        amounts = self.amounts(event, args)
        if not amounts:
            self.fail(event, "rollback names no request")
        dropped = [amounts.get(rid, 0) for rid in self.batch]
        if len(set(dropped)) > 1:
            self.needs.add("per_row_rollback")
        for rid, n in amounts.items():
            self.roll_back(event, rid, n)

    def on_trim(self, event, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            self.fail(event, f"trim takes a count >= 1, got {n!r}")
        if not self.batch:
            self.fail(event, "trim on an empty batch")
        for rid in self.batch:
            self.roll_back(event, rid, n)

    def on_extract(self, event, rid):
        self.in_batch(event, rid)
        self.batch.remove(rid)
        self.preempted.append(rid)

    def on_solo_step(self, event, args):
        amounts = self.amounts_preempted(event, args)
        for rid, n in amounts.items():
            self.append([rid], 1, times=n)

    def amounts_preempted(self, event, args):
        if not isinstance(args, dict) or not args:
            self.fail(event, "expected an object of extracted request id -> steps")
        for rid, n in args.items():
            self.request(event, rid)
            if rid not in self.preempted:
                self.fail(event, f"request {rid!r} is not extracted")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                self.fail(event, f"steps for {rid!r} must be an integer >= 1, got {n!r}")
        return args

    def on_reinsert(self, event, rid):
        self.request(event, rid)
        if rid not in self.preempted:
            self.fail(event, f"request {rid!r} is not extracted")
        self.preempted.remove(rid)
        self.batch.append(rid)
