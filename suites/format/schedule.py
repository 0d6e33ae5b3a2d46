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

``load`` validates a file completely before anything runs: every event is
parsed into a typed object (``suites/format/events.py``), then the replay core walks the schedule once
without any cache (its dry run), which refuses what cannot happen and
records the calls each request sees and the optional capabilities it needs.
A bad file gets a ``ScheduleError`` naming the file, the event and the reason.
"""

import json
import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from kvparity.oracle.atomic import make_folder
from kvparity.oracle.inputs import read_json
from kvparity.oracle.quantization import BITS, DTYPES, GROUP_SIZES  # noqa: F401 (the schedule's words)
from kvparity.oracle.synthetic import BLOCK, LayerShape
from kvparity.suites.format.events import Event, parse_event
from kvparity.suites.format.levels import L1, L2, SCHEDULE_LEVELS
from kvparity.suites.format.errors import ScheduleError

LEVELS = SCHEDULE_LEVELS
DEFAULT_PREFILL_STEP = 2048

CATALOG = Path(files("kvparity.suites") / "catalog")  # package data, also in a wheel
REAL_CATALOG = CATALOG / "real"  # schedules for the real model (SmolLM2)


@dataclass(frozen=True)
class ScheduledCall:
    """One thing a request sees, alone or in the batch: the oracle replays these."""

    event: int  # index of the event that makes the call
    # "prefill" (n prompt tokens, in chunks), "append" (n tokens in one call), "trim",
    # "store" (the row's n tokens go into ``store``), "resume" (the nearest stored
    # prefix of ``tokens``, the prompt, from ``store``, then its last n tokens in chunks)
    op: str
    n: int
    store: str = ""
    tokens: Tuple[tuple, ...] = ()



def reject(source, where, reason):
    """A ScheduleError naming the file, the field or request, and the reason."""
    raise ScheduleError(f"{source}: {where}: {reason}")


@dataclass(frozen=True)
class Request:
    id: str
    prompt_len: int
    prompt: Optional[Tuple[int, ...]] = None  # token ids, when given
    text: Optional[str] = None  # L2 only: tokenized by the model
    quantized_kv_start: int = 0
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    seed: int = 0
    # A chat turn: the tokens ``continues`` held when it was last stored (its
    # prompt and what it generated; only the first ``keep`` when given), then
    # ``new_tokens`` of its own. Its length is known once the replay gets there.
    continues: Optional[str] = None
    keep: Optional[int] = None
    new_tokens: int = 0

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
class StoreLimits:
    """A prompt-cache store's limits, as mlx-lm's LRUPromptCache takes them."""

    max_size: int = 10
    max_bytes: int = 1 << 63

    def to_json(self) -> dict:
        defaults = StoreLimits()
        return {k: getattr(self, k) for k in ("max_size", "max_bytes") if getattr(self, k) != getattr(defaults, k)}


# -- schedules ----------------------------------------------------------------------


DEFAULT_SHAPE = LayerShape(kv_heads=2, key_dim=64, value_dim=64)


@dataclass
class Schedule:
    name: str
    description: str
    levels: Tuple[str, ...]
    bits: int
    group_size: int
    requests: Dict[str, Request]
    events: List[Event]
    shapes: Tuple[LayerShape, ...] = (DEFAULT_SHAPE,)  # L1: one per layer
    dtype: str = "bfloat16"
    model: Optional[str] = None
    path: Optional[str] = None
    stores: Dict[str, StoreLimits] = field(default_factory=dict)
    needs: Tuple[str, ...] = ()  # optional capabilities, from the dry run
    calls: Dict[str, List[ScheduledCall]] = field(default_factory=dict)  # per request, in order
    order: List[Tuple[str, int]] = field(default_factory=list)  # (request, call index), as the calls come

    @property
    def kv_heads(self) -> int:
        return self.shapes[0].kv_heads

    @property
    def head_dim(self) -> int:
        """The first layer's key dim: what one-shape readers (L2's choice
        of model) take."""
        return self.shapes[0].key_dim

    def to_json(self) -> dict:
        requests = {}
        defaults = Request(id="", prompt_len=1)
        for r in self.requests.values():
            if r.continues is not None:
                entry = {"continues": r.continues, "new_tokens": r.new_tokens}
                if r.keep is not None:
                    entry["keep"] = r.keep
            elif r.text is not None:
                entry = {"text": r.text}
            elif r.prompt is not None:
                entry = {"prompt": list(r.prompt)}
            else:
                entry = {"prompt_len": r.prompt_len}
            for key in ("quantized_kv_start", "prefill_step_size", "seed"):
                if getattr(r, key) != getattr(defaults, key):
                    entry[key] = getattr(r, key)
            requests[r.id] = entry
        doc = {
            "name": self.name,
            "description": self.description,
            "levels": list(self.levels),
            "kv": {"bits": self.bits, "group_size": self.group_size},
            "synthetic": synthetic_json(self.shapes, self.dtype),
            "requests": requests,
            "events": [e.to_json() for e in self.events],
        }
        if self.model:
            doc["model"] = self.model
        if self.stores:
            doc["stores"] = {name: limits.to_json() for name, limits in self.stores.items()}
        return doc


def shape_json(shape: LayerShape) -> dict:
    if shape.key_dim == shape.value_dim:
        return {"kv_heads": shape.kv_heads, "head_dim": shape.key_dim}
    return {"kv_heads": shape.kv_heads, "key_dim": shape.key_dim, "value_dim": shape.value_dim}


def synthetic_json(shapes, dtype) -> dict:
    if len(shapes) == 1:
        return {**shape_json(shapes[0]), "dtype": dtype}
    return {"layers": [shape_json(shape) for shape in shapes], "dtype": dtype}


def read_document(path) -> dict:
    """A schedule file's JSON; unreadable, malformed or refused by the input
    reader (oracle/inputs.py: no regular file, too large, not UTF-8, a key
    twice, NaN, ...) is a ScheduleError naming it."""
    return read_json(path, ScheduleError)


def load_fields(path) -> Schedule:
    """A schedule file's fields, checked (``parse_fields``); ``core.loading.load`` proves it can run too."""
    return parse_fields(read_document(path), source=str(path))


def atomic_write_json(doc: dict, path) -> Path:
    """Write a schedule document atomically: a reader never sees half a file."""
    path = Path(path)
    make_folder(path.parent)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def save(schedule: Schedule, path) -> Path:
    return atomic_write_json(schedule.to_json(), path)


def catalog_paths(level: Optional[str] = None, folder: Path = CATALOG) -> List[Path]:
    paths = sorted(Path(folder).glob("*.json"))
    if level is None:
        return paths
    return [p for p in paths if level in load_fields(p).levels]


def check_int(source, where, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reject(source, where, f"expected an integer >= {minimum}, got {value!r}")
    return value


def check_fields(source, where, doc, allowed, required=()):
    if not isinstance(doc, dict):
        reject(source, where, f"expected an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        reject(source, where, f"unknown field {unknown[0]!r} (known: {', '.join(allowed)})")
    for key in required:
        if key not in doc:
            reject(source, where, f"missing field {key!r}")


def check_kv(source, bits, group_size, dims=()):
    """``dims``: (where, name, dim) of every dim the group size must divide."""
    if bits not in BITS:
        reject(source, "kv.bits", f"bits={bits} is not supported (choose from {BITS})")
    if group_size not in GROUP_SIZES:
        reject(source, "kv.group_size", f"group_size={group_size} is not supported (choose from {GROUP_SIZES})")
    for where, dim_name, dim in dims:
        if dim % group_size:
            reject(source, "kv.group_size", f"group_size={group_size} does not divide {dim_name}={dim} ({where})")


SHAPE_FIELDS = ("kv_heads", "head_dim", "key_dim", "value_dim")


def parse_shape(source, where, doc) -> LayerShape:
    """One layer's shape: kv_heads, and head_dim (keys and values alike) or
    key_dim and value_dim."""
    kv_heads = check_int(source, f"{where}.kv_heads", doc.get("kv_heads", DEFAULT_SHAPE.kv_heads), 1)
    if "head_dim" in doc:
        apart = [key for key in ("key_dim", "value_dim") if key in doc]
        if apart:
            reject(source, f"{where}.{apart[0]}", "give head_dim (keys and values alike) or key_dim and "
                                                  "value_dim, not both")
        dim = check_int(source, f"{where}.head_dim", doc["head_dim"], 1)
        return LayerShape(kv_heads, dim, dim)
    if "key_dim" in doc or "value_dim" in doc:
        for key in ("key_dim", "value_dim"):
            if key not in doc:
                reject(source, where, f"missing field {key!r}: key_dim and value_dim come together")
        return LayerShape(kv_heads, check_int(source, f"{where}.key_dim", doc["key_dim"], 1),
                          check_int(source, f"{where}.value_dim", doc["value_dim"], 1))
    return LayerShape(kv_heads, DEFAULT_SHAPE.key_dim, DEFAULT_SHAPE.value_dim)


def parse_synthetic(source, doc, levels) -> Tuple[Tuple[LayerShape, ...], str]:
    """The synthetic keys' and values' shapes (one per layer) and dtype."""
    check_fields(source, "synthetic", doc, SHAPE_FIELDS + ("layers", "dtype"))
    dtype = doc.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        reject(source, "synthetic.dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    if "layers" not in doc:
        shapes = (parse_shape(source, "synthetic", doc),)
    else:
        given = [key for key in SHAPE_FIELDS if key in doc]
        if given:
            reject(source, f"synthetic.{given[0]}", "with layers, each layer gives its own shape")
        layers = doc["layers"]
        if not isinstance(layers, list) or not layers:
            reject(source, "synthetic.layers", "expected a non-empty list of layer shapes")
        shapes = []
        for i, layer in enumerate(layers):
            where = f"synthetic.layers[{i}]"
            check_fields(source, where, layer, SHAPE_FIELDS)
            shapes.append(parse_shape(source, where, layer))
        shapes = tuple(shapes)
    if L2 in levels and (len(shapes) > 1 or shapes[0].key_dim != shapes[0].value_dim):
        reject(source, "synthetic", "layers and key_dim != value_dim are L1 shapes: at L2 the model has its own")
    return shapes, dtype


def dims_of(shapes) -> list:
    """(where, name, dim) of every dim of ``shapes``, for ``check_kv``."""
    one = len(shapes) == 1
    dims = []
    for i, shape in enumerate(shapes):
        where = "synthetic" if one else f"synthetic.layers[{i}]"
        if shape.key_dim == shape.value_dim:
            dims.append((where, "head_dim", shape.key_dim))
        else:
            dims += [(where, "key_dim", shape.key_dim), (where, "value_dim", shape.value_dim)]
    return dims


def parse_fields(doc, source="<schedule>") -> Schedule:
    check_fields(source, "schedule", doc,
          ("name", "description", "levels", "kv", "synthetic", "model", "stores", "requests", "events"),
          ("name", "requests", "events"))
    levels = doc.get("levels", list(LEVELS))
    if not isinstance(levels, list) or not levels:
        reject(source, "levels", f"expected a non-empty list of levels ({', '.join(LEVELS)})")
    for level in levels:
        if level not in LEVELS:
            reject(source, "levels", f"unknown level {level!r} (known: {', '.join(LEVELS)})")
    kv = doc.get("kv", {})
    check_fields(source, "kv", kv, ("bits", "group_size"))
    bits = check_int(source, "kv.bits", kv.get("bits", 4), 1)
    group_size = check_int(source, "kv.group_size", kv.get("group_size", 64), 1)
    shapes, dtype = parse_synthetic(source, doc.get("synthetic", {}), levels)
    check_kv(source, bits, group_size, dims_of(shapes) if L1 in levels else ())
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        reject(source, "model", f"expected a model name, got {model!r}")

    stores = parse_stores(source, doc.get("stores", {}))
    if not isinstance(doc["requests"], dict) or not doc["requests"]:
        reject(source, "requests", "expected a non-empty object of request id -> request")
    requests = {rid: parse_request(source, rid, spec, levels) for rid, spec in doc["requests"].items()}
    for rid, request in requests.items():
        if request.continues is not None and request.continues not in requests:
            reject(source, f"request {rid!r} continues", f"unknown request {request.continues!r}")
    if not isinstance(doc["events"], list) or not doc["events"]:
        reject(source, "events", "expected a non-empty list of events")
    events = [parse_event(source, i, e) for i, e in enumerate(doc["events"])]
    check_memory(source, *held_tokens(requests, events), shapes, dtype, "synthetic")
    schedule = Schedule(
        name=str(doc["name"]), description=str(doc.get("description", "")), levels=tuple(levels),
        bits=bits, group_size=group_size, requests=requests, events=events, shapes=shapes, dtype=dtype, model=model, path=source, stores=stores,
    )
    return schedule


# -- memory: a file beyond the machine is refused before anything runs ----------------

MEMORY_LIMIT_ENV = "KVPARITY_MAX_MEMORY"  # bytes; default: the machine's memory
# Per key or value element a run holds the synthetic draw (float32) and about
# three arrays of the schedule's dtype (the row's own, the solo cache, the
# batch); the dry run names every token (a tuple, about 150 bytes of Python).
DRAW_BYTES, COPIES, TOKEN_NAME_BYTES = 4, 3, 150


def memory_limit() -> Tuple[int, str]:
    """(bytes, where that limit comes from)."""
    given = os.environ.get(MEMORY_LIMIT_ENV)
    if given is not None:
        if not given.isdigit() or int(given) < 1:
            raise ScheduleError(f"{MEMORY_LIMIT_ENV}={given!r}: expected a number of bytes")
        return int(given), MEMORY_LIMIT_ENV
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this machine's memory; {MEMORY_LIMIT_ENV} sets it"


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def check_memory(source, rows: List[int], asks: List[Tuple[int, str]], shapes, dtype, shape_where: str):
    """Refuse a file whose declared sizes would need more memory than the
    limit: ``rows``, the tokens each request can hold at most; ``asks``,
    (tokens, field) of what adds them. Names the field that asks for most of
    it, the estimate and the limit. Rows are held in whole blocks of
    ``BLOCK`` tokens (the synthetic draws and mlx-lm's buffer growth). At L2
    and L3 the model's layers replace the synthetic ones: there the estimate
    is a floor."""
    held = sum(-(-n // BLOCK) * BLOCK for n in rows)

    def need(layers):
        elements = sum(s.kv_heads * (s.key_dim + s.value_dim) for s in layers)
        return held * ((DRAW_BYTES + COPIES * getattr(mx, dtype).size) * elements + TOKEN_NAME_BYTES)

    limit, whence = memory_limit()
    if need(shapes) > limit:
        # The layers ask for it where the default layer would fit; else the largest count does.
        where = shape_where if need([DEFAULT_SHAPE]) <= limit else max(asks)[1]
        layers = "; ".join(s.words() for s in shapes)
        reject(source, where, f"would need about {gib(need(shapes))} (estimated before anything runs: "
                              f"{held} tokens held over {len(rows)} requests at {layers}, {dtype}), "
                              f"over the limit of {gib(limit)} ({whence})")


def held_tokens(requests: Dict[str, Request], events) -> Tuple[List[int], List[Tuple[int, str]]]:
    """For ``check_memory``: each request's prompt plus everything the
    events append to every row, and (tokens, field) of each of those."""
    asks = [(r.prompt_len or r.new_tokens or len(r.text or ""), f"request {r.id!r}") for r in requests.values()]
    appended = {"step": lambda e: e.n, "spec_round": lambda e: e.k + 1,
                "solo_step": lambda e: max(e.amounts.values())}
    steps = [(appended[e.kind](e), f"event {e.label}") for e in events if e.kind in appended]
    grown = sum(n for n, _ in steps)
    return [n + grown for n, _ in asks], asks + steps


def parse_stores(source, doc) -> Dict[str, StoreLimits]:
    if not isinstance(doc, dict):
        reject(source, "stores", f"expected an object of store name -> limits, got {type(doc).__name__}")
    stores = {}
    for name, spec in doc.items():
        where = f"stores.{name}"
        check_fields(source, where, spec, ("max_size", "max_bytes"))
        stores[name] = StoreLimits(check_int(source, f"{where}.max_size", spec.get("max_size", 10), 1),
                                   check_int(source, f"{where}.max_bytes", spec.get("max_bytes", 1 << 63)))
    return stores


def parse_request(source, rid, spec, levels) -> Request:
    where = f"request {rid!r}"
    check_fields(source, where, spec,
          ("prompt_len", "prompt", "text", "continues", "keep", "new_tokens", "quantized_kv_start",
           "prefill_step_size", "seed"))
    given = [k for k in ("prompt_len", "prompt", "text", "continues") if k in spec]
    if len(given) != 1:
        reject(source, where, "give exactly one of prompt_len, prompt (token ids), text or continues")
    if "continues" not in spec:
        for key in ("keep", "new_tokens"):
            if key in spec:
                reject(source, f"{where} {key}", "only a request that continues another takes it")
    prompt = text = continues = keep = None
    new_tokens = 0
    if "continues" in spec:
        continues = spec["continues"]
        if not isinstance(continues, str) or continues == rid:
            reject(source, f"{where} continues", f"expected another request's id, got {continues!r}")
        if "keep" in spec:
            keep = check_int(source, f"{where} keep", spec["keep"], 1)
        new_tokens = check_int(source, f"{where} new_tokens", spec.get("new_tokens", 0))
        prompt_len = 0  # known once the replay reaches its join
    elif "prompt" in spec:
        tokens = spec["prompt"]
        if not isinstance(tokens, list) or not tokens:
            reject(source, where, "prompt must be a non-empty list of token ids")
        prompt = tuple(check_int(source, f"{where} prompt", t) for t in tokens)
        prompt_len = len(prompt)
    elif "text" in spec:
        if L1 in levels:
            reject(source, where, "a text prompt needs a tokenizer: L1 schedules take prompt_len")
        text = spec["text"]
        if not isinstance(text, str) or not text:
            reject(source, where, "text must be a non-empty string")
        prompt_len = 0  # known once tokenized
    else:
        prompt_len = check_int(source, f"{where} prompt_len", spec["prompt_len"], 1)
    return Request(
        id=rid,
        prompt_len=prompt_len,
        prompt=prompt,
        text=text,
        quantized_kv_start=check_int(source, f"{where} quantized_kv_start", spec.get("quantized_kv_start", 0)),
        prefill_step_size=check_int(source, f"{where} prefill_step_size",
                               spec.get("prefill_step_size", DEFAULT_PREFILL_STEP), 1),
        seed=check_int(source, f"{where} seed", spec.get("seed", 0)),
        continues=continues,
        keep=keep,
        new_tokens=new_tokens,
    )
