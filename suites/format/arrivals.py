"""Arrivals schedules (L3): requests that reach an engine over time.

Unlike the event schedules of L1/L2, an arrivals schedule says nothing about
joins, prefill batches or leaves: the engine decides those. It gives, per
request, the engine step at which it arrives, its prompt, how many tokens it
wants and its kv settings; and the engine's own settings. Every key is
documented in suites/catalog/l3/README.md::

    {
      "kind": "arrivals",
      "name": "staggered",
      "model": "llama-h64-bf16",
      "kv": {"bits": 4, "group_size": 64},
      "engine": {"completion_batch_size": 4, "prefill_batch_size": 1},
      "requests": {
        "a": {"arrival": 0, "prompt_len": 5, "max_tokens": 6},
        "b": {"arrival": 2, "prompt": [1, 2, 3], "max_tokens": 4, "kv": {"bits": 8}}
      }
    }

Conversations (served through mlx-lm's ``LRUPromptCache``, which the engine
block's ``prompt_cache_size`` turns on): a request may ``continue`` an
earlier one (its prompt is that request's prompt, its generated tokens, then
its own tokens; it arrives ``arrival`` steps after that request finished),
and a first turn may start with the file's shared ``system`` prompt::

      "engine": {"prompt_cache_size": 10, "prompt_cache_bytes": 1000000},
      "system": {"prompt_len": 24, "seed": 7},
      "requests": {
        "u1": {"arrival": 0, "system": true, "prompt_len": 6, "max_tokens": 4},
        "u1-2": {"continues": "u1", "arrival": 1, "prompt_len": 3, "max_tokens": 4}
      }

``load`` validates a file completely before anything runs; a bad file raises
``ScheduleError`` naming the file, the field or request, and the reason.
"""

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvparity.oracle.models import DEFAULT_MODEL
from kvparity.suites.format.schedule import (
    CATALOG, DEFAULT_PREFILL_STEP, DEFAULT_SHAPE, check_fields, check_int, check_kv, check_memory, read_document,
    reject,
)

KIND = "arrivals"
L3_CATALOG = CATALOG / "l3"
# Not beside the L2 real-model files: their loader reads every *.json there.
L3_REAL_CATALOG = CATALOG / "real" / "l3"
DEFAULT_KV = {"bits": 4, "group_size": 64}

KV_FIELDS = ("bits", "group_size", "quantized_kv_start")
REQUEST_FIELDS = ("arrival", "prompt_len", "prompt", "text", "seed", "max_tokens", "kv", "prefill_step_size",
                  "continues", "system", "arrival_ms", "endpoint", "stream")
# L4: which OpenAI endpoint a request is sent to, and how long a step of
# ``arrival`` lasts where a request gives no ``arrival_ms``.
ENDPOINTS = ("completions", "chat")
STEP_MS = 50
PROMPT_FIELDS = ("prompt_len", "prompt", "text")
SYSTEM = "system"  # the shared system prompt's id (its synthetic tokens are drawn from it and its seed)


@dataclass(frozen=True)
class ArrivalRequest:
    id: str
    arrival: int  # engine step before which the request is handed to the engine
    max_tokens: int
    bits: int
    group_size: int
    # None: the cache is quantized from the request's first token (what an
    # engine handing quantized caches does). An integer N: mlx-lm's
    # kv_bits/quantized_kv_start conversion, a dense cache converted after the
    # call that reaches N tokens.
    quantized_kv_start: Optional[int]
    prefill_step_size: int
    prompt_len: int = 0  # synthetic prompt of this many tokens, drawn from seed
    prompt: Optional[Tuple[int, ...]] = None
    text: Optional[str] = None  # tokenized by the model's tokenizer
    seed: int = 0
    # The request this one continues (a chat's next turn): its prompt is that
    # request's prompt, the tokens it generated, then this request's own
    # tokens; ``arrival`` counts engine steps after that request finished.
    continues: Optional[str] = None
    system: bool = False  # the prompt starts with the file's shared system prompt
    # L4: sent this long after the run began, a turn after the answer of the
    # turn it continues (None: arrival * STEP_MS)
    arrival_ms: Optional[int] = None
    endpoint: str = ENDPOINTS[0]  # L4: /v1/completions, or /v1/chat/completions with one user message
    stream: bool = False  # L4: the answer is asked for as server-sent events

    @property
    def sent_at_ms(self) -> int:
        """L4: when the request is sent, in milliseconds after the run began
        (a turn: after the answer of the turn it continues)."""
        return self.arrival * STEP_MS if self.arrival_ms is None else self.arrival_ms


@dataclass(frozen=True)
class SystemPrompt:
    """The file's shared system prompt: tokens that first turns start with."""

    id: str = SYSTEM
    prompt_len: int = 0
    prompt: Optional[Tuple[int, ...]] = None
    text: Optional[str] = None
    seed: int = 0


@dataclass(frozen=True)
class EngineSettings:
    """The file's engine block, as the engine gets it; None keeps the engine's own default."""

    completion_batch_size: Optional[int] = None
    prefill_batch_size: Optional[int] = None
    prefill_step_size: Optional[int] = None
    prompt_cache_size: Optional[int] = None  # LRUPromptCache(max_size); None: no prompt cache
    prompt_cache_bytes: Optional[int] = None  # LRUPromptCache(max_bytes); None: mlx-lm's default


ENGINE_FIELDS = tuple(f.name for f in fields(EngineSettings))


@dataclass
class ArrivalSchedule:
    name: str
    description: str
    model: str
    requests: Dict[str, ArrivalRequest]
    engine: EngineSettings = field(default_factory=EngineSettings)
    system: Optional[SystemPrompt] = None
    path: Optional[str] = None
    doc: dict = field(default_factory=dict, repr=False)  # as loaded, for writing back

    @property
    def conversation(self) -> bool:
        """Served through a prompt cache (mlx-lm's LRUPromptCache)."""
        return self.engine.prompt_cache_size is not None

    @property
    def kv_settings(self) -> List[tuple]:
        """Distinct (bits, group_size, quantized_kv_start) of the requests."""
        return sorted({(r.bits, r.group_size, r.quantized_kv_start) for r in self.requests.values()},
                      key=str)

    def with_engine(self, **settings) -> "ArrivalSchedule":
        """The same requests under other engine settings (None: engine default)."""
        return replace(self, engine=replace(self.engine, **settings))


def load(path) -> ArrivalSchedule:
    return parse(read_document(path), source=str(path))


def catalog_paths(folder: Path = L3_CATALOG) -> List[Path]:
    return sorted(Path(folder).glob("*.json"))


def _kv(source, where, spec, inherited) -> dict:
    check_fields(source, where, spec, KV_FIELDS)
    kv = {**inherited, **spec}
    kv["bits"] = check_int(source, f"{where}.bits", kv["bits"], 1)
    kv["group_size"] = check_int(source, f"{where}.group_size", kv["group_size"], 1)
    if kv.get("quantized_kv_start") is not None:
        check_int(source, f"{where}.quantized_kv_start", kv["quantized_kv_start"])
    check_kv(f"{source}: {where}", kv["bits"], kv["group_size"])
    return kv


def parse(doc, source="<arrivals>") -> ArrivalSchedule:
    if isinstance(doc, dict) and "events" in doc:
        reject(source, "schedule", "this is an event schedule (L1/L2); an L3 file has \"kind\": \"arrivals\" "
                                  "and per-request arrival steps instead of events")
    check_fields(source, "schedule", doc, ("kind", "name", "description", "model", "kv", "engine", "system",
                                           "requests"),
          ("kind", "name", "requests"))
    if doc["kind"] != KIND:
        reject(source, "kind", f"expected {KIND!r}, got {doc['kind']!r}")
    if not isinstance(doc["name"], str) or not doc["name"]:
        reject(source, "name", "expected a non-empty string")
    model = doc.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        reject(source, "model", f"expected a model name, got {model!r}")
    kv = _kv(source, "kv", doc.get("kv", {}), {**DEFAULT_KV, "quantized_kv_start": None})

    engine_doc = doc.get("engine", {})
    check_fields(source, "engine", engine_doc, ENGINE_FIELDS)
    engine = EngineSettings(**{k: check_int(source, f"engine.{k}", v, 1) for k, v in engine_doc.items()})
    default_step = engine.prefill_step_size or DEFAULT_PREFILL_STEP

    requests_doc = doc["requests"]
    if not isinstance(requests_doc, dict) or not requests_doc:
        reject(source, "requests", "expected a non-empty object of request id -> request")
    system = _system(source, doc["system"]) if "system" in doc else None
    requests = {rid: _request(source, rid, spec, kv, default_step) for rid, spec in requests_doc.items()}
    _check_conversations(source, requests, engine, system)
    # The model's layers are not known here: the default layer gives a floor.
    shared = system.prompt_len if system is not None else 0
    check_memory(source, [shared + r.prompt_len + len(r.text or "") + r.max_tokens for r in requests.values()],
                 [(n, f"request {r.id!r} {key}") for r in requests.values()
                  for n, key in ((r.prompt_len, "prompt_len"), (r.max_tokens, "max_tokens"))],
                 [DEFAULT_SHAPE], "bfloat16", "model")
    _check_arrivals(source, requests, shared)
    return ArrivalSchedule(
        name=doc["name"],
        description=str(doc.get("description", "")),
        model=model,
        requests=requests,
        engine=engine,
        system=system,
        path=source,
        doc=doc,
    )


def _prompt(source, where, spec) -> dict:
    """Exactly one of prompt_len, prompt or text, checked."""
    given = [k for k in PROMPT_FIELDS if k in spec]
    if len(given) != 1:
        reject(source, where, "give exactly one of prompt_len, prompt (token ids) or text")
    prompt = text = None
    prompt_len = 0
    if "prompt" in spec:
        if not isinstance(spec["prompt"], list) or not spec["prompt"]:
            reject(source, where, "prompt must be a non-empty list of token ids")
        prompt = tuple(check_int(source, f"{where} prompt[{i}]", t) for i, t in enumerate(spec["prompt"]))
        prompt_len = len(prompt)
    elif "text" in spec:
        if not isinstance(spec["text"], str) or not spec["text"]:
            reject(source, where, "text must be a non-empty string")
        text = spec["text"]
    else:
        prompt_len = check_int(source, f"{where} prompt_len", spec["prompt_len"], 1)
    return {"prompt_len": prompt_len, "prompt": prompt, "text": text,
            "seed": check_int(source, f"{where} seed", spec.get("seed", 0))}


def _system(source, spec) -> SystemPrompt:
    check_fields(source, "system", spec, PROMPT_FIELDS + ("seed",))
    return SystemPrompt(**_prompt(source, "system", spec))


def _check_arrivals(source, requests: Dict[str, ArrivalRequest], shared: int):
    """An arrival later than every step the file's requests can fill (a
    step prefills or decodes at least one token of one of them) adds idle
    engine steps that compare nothing, and one far later would keep the
    engine idling for ever: refused, before anything runs."""
    busy = sum(shared + r.prompt_len + len(r.prompt or ()) + len(r.text or "") + r.max_tokens
               for r in requests.values()) + len(requests)
    for r in requests.values():
        if r.arrival > busy:
            reject(source, f"request {r.id!r} arrival", f"{r.arrival} engine steps, later than the {busy} steps "
                   "the file's requests can fill: the steps past them would only idle")


def _request(source, rid, spec, kv, default_step) -> ArrivalRequest:
    where = f"request {rid!r}"
    if not rid:
        reject(source, "requests", "a request id must be a non-empty string")
    check_fields(source, where, spec, REQUEST_FIELDS, ("arrival", "max_tokens"))
    continues = spec.get("continues")
    if continues is not None and (not isinstance(continues, str) or not continues):
        reject(source, f"{where} continues", f"expected a request id, got {continues!r}")
    for flag in ("system", "stream"):
        if not isinstance(spec.get(flag, False), bool):
            reject(source, f"{where} {flag}", f"expected true or false, got {spec[flag]!r}")
    own_kv = _kv(source, f"{where} kv", spec.get("kv", {}), kv)
    endpoint = spec.get("endpoint", ENDPOINTS[0])
    if endpoint not in ENDPOINTS:
        reject(source, f"{where} endpoint", f"expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return ArrivalRequest(
        id=rid,
        arrival=check_int(source, f"{where} arrival", spec["arrival"]),
        max_tokens=check_int(source, f"{where} max_tokens", spec["max_tokens"], 1),
        bits=own_kv["bits"],
        group_size=own_kv["group_size"],
        quantized_kv_start=own_kv.get("quantized_kv_start"),
        prefill_step_size=check_int(source, f"{where} prefill_step_size",
                                    spec.get("prefill_step_size", default_step), 1),
        continues=continues,
        system=spec.get("system", False),
        arrival_ms=check_int(source, f"{where} arrival_ms", spec["arrival_ms"]) if "arrival_ms" in spec else None,
        endpoint=endpoint,
        stream=spec.get("stream", False),
        **_prompt(source, where, spec),
    )


def _check_conversations(source, requests: Dict[str, ArrivalRequest], engine: EngineSettings,
                         system: Optional[SystemPrompt]):
    """Turns name an earlier request of the same kv settings, without cycles,
    and only where a prompt cache serves them."""
    if engine.prompt_cache_bytes is not None and engine.prompt_cache_size is None:
        reject(source, "engine.prompt_cache_bytes", "needs engine.prompt_cache_size (the prompt cache's entry limit)")
    for r in requests.values():
        where = f"request {r.id!r}"
        if r.system and system is None:
            reject(source, f"{where} system", "the file has no \"system\" prompt")
        if r.continues is None:
            continue
        if r.system:
            reject(source, f"{where} system", "a turn that continues another already starts with its prompt")
        if engine.prompt_cache_size is None:
            reject(source, f"{where} continues", "a conversation needs engine.prompt_cache_size (mlx-lm's "
                                                  "LRUPromptCache serves the turns)")
        earlier = requests.get(r.continues)
        if earlier is None:
            reject(source, f"{where} continues", f"no request {r.continues!r} (known: {', '.join(requests)})")
        mine, theirs = (r.bits, r.group_size, r.quantized_kv_start), (earlier.bits, earlier.group_size,
                                                                     earlier.quantized_kv_start)
        if mine != theirs:
            reject(source, f"{where} kv", f"differs from {earlier.id!r}, which it continues: "
                                          f"(bits, group_size, quantized_kv_start) {mine} vs {theirs}")
    for r in requests.values():  # every turn leads back to a first turn
        turns, turn = [], r
        while turn.continues is not None:
            if turn.id in turns:
                reject(source, f"request {r.id!r} continues", f"turns continue each other in a cycle: "
                                                             f"{' -> '.join(turns + [turn.id])}")
            turns.append(turn.id)
            turn = requests[turn.continues]


def check_fits(schedule: ArrivalSchedule, plan, vocab_size: int, has_tokenizer: bool,
               group_sizes: bool = True) -> Optional[str]:
    """Why the schedule cannot run on a model of this per-layer plan (a
    ``CachePlan``) and vocabulary, or None; ``group_sizes`` false where the
    requests' KV settings are not the run's (L4: the server declares its own)."""
    for r in schedule.requests.values():
        unfit = plan.group_sizes_fit(r.group_size) if group_sizes else None
        if unfit:
            return f"{schedule.path}: request {r.id!r}: {unfit.removeprefix('kv.')}"
    prompts = list(schedule.requests.values()) + ([schedule.system] if schedule.system else [])
    for r in prompts:
        where = f"{schedule.path}: " + ("system" if isinstance(r, SystemPrompt) else f"request {r.id!r}")
        if r.text is not None and not has_tokenizer:
            return f"{where}: a text prompt needs a tokenizer; the model has none"
        if r.prompt is not None and max(r.prompt) >= vocab_size:
            return f"{where}: token id {max(r.prompt)} is outside the vocabulary of {vocab_size}"
    return None
