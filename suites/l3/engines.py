"""Engine adapters (L3): a continuous-batching engine serves arrivals.

An engine is named ``package.module:factory``. The factory is called as
``factory(model, batch_class, settings)`` where ``model`` is an mlx-lm model,
``batch_class`` the batch cache class under test (the class itself; while the
engine serves, the run watches its members), and ``settings`` an
``EngineSettings``; it returns an object with

* ``name`` (str), and
* ``serve(requests: Sequence[EngineRequest]) -> EngineRun``.

``serve`` hands each request to the engine at its ``arrival`` step (an engine
step is whatever the engine does between two looks for new work), greedy, and
returns per request the generated tokens and their log-probabilities: either
the full log-prob vector of each position (compared bit for bit) or the
chosen token's log-prob alone. Where it can, it also returns the timeline:
per engine step, which rows processed prompt tokens, which moved into the
generation batch, which generated, which finished. An engine that cannot
serve a set of requests (a kv mode it lacks) raises ``EngineUnsupported``:
reported "not supported", never a pass.

The default engine is mlx-lm's ``BatchGenerator``, unmodified. Each request's
per-layer caches come in through its public ``caches=`` argument as
instances of ``quantized_row_class(batch_class)``, whose ``merge`` builds the
implementation's batch; from then on mlx-lm alone decides merges, batched
prefill (``prepare``/``finalize``), ``extend``, ``filter`` and ``extract``.

Conversations (``settings.prompt_cache_size``; requests with ``continues``):
the engine runs the pieces of mlx-lm's server loop (``mlx_lm/server.py``)
around the generator, unmodified: an ``LRUPromptCache`` store;
``fetch_nearest_cache`` for each arriving prompt, whose copy goes in through
``insert_segments(..., caches=, all_tokens=)``; ``extract_cache`` of a row
whose prompt segment ended, stored as a "user" entry; and each finished row's
``prompt_cache`` (what ``extract`` returned) stored as an "assistant" entry
under its ``all_tokens``. An engine that serves conversations says so with
``serves_conversations = True`` and returns, in its ``EngineRun``, each
request's full prompt, every entry it stored (``StoredPrefix``, mlx-lm's own
``QuantizedKVCache`` holding the bytes at the time it was stored) and which
entry each request started from: the oracle starts the same request alone
from that entry.

Where ``serve`` raises, an engine may say what it stored until then
(``so_far``, an ``EngineRun`` of the serve now running or last run: its
prompts, stored entries and which entry each request started from): L3
checks those entries, so that a raise on a row ``extract`` returned wrong
is that member's.

What the engine's caches held (``EngineRun.first_step``, optional): after the
first step that generated a token, each layer's cache of that batch as
``held_layers`` reads it. L3's ``quantized`` check reads it: every layer must
hold triples of the requests' bits and group size.
"""

import copy
import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, QuantizedKVCache

from kvparity.oracle.generation import (
    PROMPT_CACHE_MODEL, NotQuantized, StoredPrefix, fetch_nearest, quantized_copy,
)
from kvparity.oracle.mlx_lm_versions import MlxLmDefectFound, installed_batch_generator_defect
from kvparity.oracle.plan import fresh_rows, plan_for
from kvparity.suites.core.raised import ImplementationError
from kvparity.suites.core.adapter import calls_made, resolve
from kvparity.suites.format.arrivals import EngineSettings

DEFAULT_ENGINE = "kvparity.suites.l3.engines:mlx_lm_batch_generator"


class EngineError(Exception):
    """The engine named on the command line cannot be used."""


class EngineUnsupported(Exception):
    """The engine cannot serve these requests as asked (reported 'not supported')."""


@dataclass(frozen=True)
class EngineRequest:
    id: str
    prompt: Tuple[int, ...]
    arrival: int
    max_tokens: int
    bits: int
    group_size: int
    quantized_kv_start: Optional[int]  # None: quantized from the first token
    prefill_step_size: int
    # A chat's next turn: the id of the request it continues. Its prompt is
    # that request's prompt, the tokens it generated, then ``prompt`` (this
    # turn's own tokens); it arrives ``arrival`` steps after that request finished.
    continues: Optional[str] = None


@dataclass
class Generated:
    """One request's output, in order."""

    tokens: List[int] = field(default_factory=list)
    # Per token: the full log-prob vector [vocab], or a scalar (the chosen token's).
    logprobs: List[mx.array] = field(default_factory=list)
    steps: List[Optional[int]] = field(default_factory=list)  # engine step each token came out at


@dataclass
class EngineStep:
    """What the engine did in one step (ids of requests)."""

    step: int
    arrived: List[str] = field(default_factory=list)
    prompt_rows: List[str] = field(default_factory=list)  # processed prompt tokens
    joined: List[str] = field(default_factory=list)  # moved into the generation batch
    generation_rows: List[str] = field(default_factory=list)  # produced a token
    finished: List[str] = field(default_factory=list)
    stored: List[str] = field(default_factory=list)  # rows whose cache went into the prompt cache
    from_store: List[str] = field(default_factory=list)  # arrivals that started from a stored entry
    calls: Optional[int] = None  # adapter.calls_made at the end of the step, where the engine notes it

    @property
    def prompt_width(self) -> int:
        return len(self.prompt_rows)

    @property
    def generation_width(self) -> int:
        return len(self.generation_rows)


@dataclass(frozen=True)
class PrefixUse:
    """A request that started from a stored entry."""

    entry: int  # StoredPrefix.number
    cached: int  # prompt tokens that came from the entry


@dataclass(frozen=True)
class HeldLayer:
    """What one layer's cache held, read when the engine held it: its class
    and the keys and values its ``state`` gave (a quantized cache's are
    (packed, scales, biases) triples)."""

    cache: str
    keys: object
    values: object


@dataclass(frozen=True)
class FirstStep:
    """The engine's first step that generated a token: which requests
    generated, and what each layer's cache of their batch held then."""

    step: int
    rows: Tuple[str, ...]
    layers: Tuple[HeldLayer, ...]


def held_layers(caches) -> Tuple[HeldLayer, ...]:
    """Each layer's cache as it holds its keys and values now."""
    held = []
    for cache in caches:
        state = cache.state
        held.append(HeldLayer(type(cache).__name__, state[0], state[1]))
    return tuple(held)


@dataclass
class EngineRun:
    outputs: Dict[str, Generated]
    timeline: Optional[List[EngineStep]] = None  # None: the engine does not say
    settings: Dict[str, object] = field(default_factory=dict)  # as the engine applied them
    # Conversations only: full prompts as served (a turn's is known only
    # then), the entries stored, and which one each request started from.
    prompts: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    stored: Dict[int, StoredPrefix] = field(default_factory=dict)
    prefixes: Dict[str, PrefixUse] = field(default_factory=dict)
    # What the caches held after the first step that generated a token;
    # None: the engine does not say (the quantized check is then not made).
    first_step: Optional[FirstStep] = None


class StoredEntry(list):
    """The layers of one stored prompt cache, as the store holds them (what
    ``extract`` returned), numbered: ``fetch_nearest_cache`` hands out a deep
    copy, and the copy keeps the number, so the engine knows which entry
    mlx-lm picked."""

    def __init__(self, layers, number: int):
        super().__init__(layers)
        self.number = number


@lru_cache(maxsize=None)
def quantized_row_class(batch_class: type, base: type = QuantizedKVCache) -> type:
    """A solo quantized cache (mlx-lm's ``QuantizedKVCache``, or ``base``)
    whose class merges into ``batch_class``: what ``BatchGenerator`` needs per
    layer to batch a request, since mlx-lm's own ``QuantizedKVCache`` has no
    ``merge``."""

    class QuantizedRow(base):
        @classmethod
        def merge(cls, rows):
            return batch_class.merge(rows)

        def size(self):
            # the base class answers 0; batching code reads a row's length here
            return self.offset

    QuantizedRow.__name__ = QuantizedRow.__qualname__ = f"{base.__name__}RowOf{batch_class.__name__}"
    return QuantizedRow


def uniform(requests: Sequence[EngineRequest], attribute: str, why: str):
    values = {getattr(r, attribute) for r in requests}
    if len(values) > 1:
        raise EngineUnsupported(f"requests differ in {attribute} ({sorted(values, key=str)}): {why}")
    return values.pop()


class BatchGeneratorEngine:
    """mlx-lm's BatchGenerator, unmodified, with the cache under test; with a
    prompt cache, inside the pieces of mlx-lm's server loop."""

    serves_conversations = True
    store_class = LRUPromptCache

    def __init__(self, model, batch_class: type, settings: EngineSettings):
        self.model = model
        self.plan = plan_for(model)  # which layers the class under test batches
        self.batch_class = batch_class
        self.row_class = quantized_row_class(batch_class)
        self.settings = settings
        self.name = f"mlx_lm.generate.BatchGenerator[{batch_class.__name__}]"
        if settings.prompt_cache_size is not None:
            self.name = f"mlx_lm.server's loop ({self.name}, LRUPromptCache)"

    def serve(self, requests: Sequence[EngineRequest]) -> EngineRun:
        defect = installed_batch_generator_defect()
        if defect is not None:
            raise MlxLmDefectFound(defect)
        if any(r.quantized_kv_start is not None for r in requests):
            raise EngineUnsupported(
                "BatchGenerator never converts a cache (no kv_bits; nothing in it calls "
                "maybe_quantize_kv_cache), so quantized_kv_start cannot be honoured; "
                "requests are quantized from their first token")
        # One batch cache per layer holds one layout, and the generator has one step size.
        uniform(requests, "bits", "one batch cache holds one bit width")
        uniform(requests, "group_size", "one batch cache holds one group size")
        step_size = uniform(requests, "prefill_step_size", "BatchGenerator has one prefill_step_size")
        knobs = {k: getattr(self.settings, k) for k in ("completion_batch_size", "prefill_batch_size")
                 if getattr(self.settings, k) is not None}
        knobs["prefill_step_size"] = step_size
        generator = BatchGenerator(self.model, **knobs)
        applied = {k: getattr(generator, k) for k in ("completion_batch_size", "prefill_batch_size",
                                                      "prefill_step_size")}
        store = None
        if self.settings.prompt_cache_size is not None:
            limits = {"max_size": self.settings.prompt_cache_size}
            if self.settings.prompt_cache_bytes is not None:
                limits["max_bytes"] = self.settings.prompt_cache_bytes
            store = self.store_class(**limits)
            applied.update({f"prompt_cache_{k}": getattr(store, k) for k in limits})
        elif any(r.continues is not None for r in requests):
            raise EngineUnsupported("a conversation's turns need a prompt cache (settings.prompt_cache_size)")
        serving = Serving(self, generator, store, requests)
        self.so_far = serving.so_far(applied)
        try:
            return serving.run(applied)
        finally:
            generator.close()

    def insert(self, generator, requests: Sequence[EngineRequest], prompts: List[List[int]]) -> List[int]:
        """Requests that start from nothing, each with its empty quantized rows."""
        return generator.insert(prompts, max_tokens=[r.max_tokens for r in requests],
                                caches=[self.rows(r) for r in requests])

    @staticmethod
    def joined(prompt_response) -> bool:
        """Whether a prompt response says its row moved into the generation batch."""
        return prompt_response.end_of_prompt

    @staticmethod
    def logprobs(response) -> mx.array:
        return response.logprobs

    @staticmethod
    def batch_caches(generator) -> Optional[list]:
        """Each layer's cache of the generation batch (mlx-lm keeps it in
        ``_generation_batch``, 0.31.3 to 0.32.x; no public member hands it
        out), or None where the generator keeps it elsewhere: not said."""
        batch = getattr(generator, "_generation_batch", None)
        return None if batch is None else batch.prompt_cache

    def rows(self, request: EngineRequest) -> list:
        """A request that starts from nothing: an empty quantized row for each
        layer mlx-lm quantizes, mlx-lm's own empty cache for every other."""
        return fresh_rows(self.model, request.bits, request.group_size, self.row_class)

    def mergeable(self, entry: list) -> list:
        """What mlx-lm's store handed back (a deep copy of what ``extract``
        returned, perhaps trimmed) made to merge into the class under test, in
        place: each layer's class becomes a ``quantized_row_class`` of its own;
        its arrays and offset stay exactly as mlx-lm left them."""
        for layer, planned in zip(entry, self.plan.layers):
            if planned.quantized:
                layer.__class__ = quantized_row_class(self.batch_class, type(layer))
        return list(entry)


class Serving:
    """One ``serve``: requests handed to the generator at their steps, its
    responses collected, and with a store, the server loop's fetches and stores.
    An engine whose generator works like mlx-lm's (``insert``, then ``next()``
    answering prompt and generation responses) reuses it through the
    engine's ``insert``, ``joined``, ``logprobs`` and ``batch_caches``."""

    def __init__(self, engine: BatchGeneratorEngine, generator, store: Optional[LRUPromptCache], requests):
        self.engine, self.generator, self.store = engine, generator, store
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.outputs = {r.id: Generated() for r in requests}
        self.by_uid: Dict[int, str] = {}
        self.prompts: Dict[str, Tuple[int, ...]] = {}
        self.stored: Dict[int, StoredPrefix] = {}
        self.prefixes: Dict[str, PrefixUse] = {}
        self.segment_types: Dict[int, List[str]] = {}  # per uid, as the server keeps them (reversed)
        # first turns arrive at their step; a next turn once the turn it continues finished
        self.due = {r.id: r.arrival for r in requests if r.continues is None}

    def run(self, applied) -> EngineRun:
        timeline: List[EngineStep] = []
        pending = list(self.requests)
        unfinished = {r.id for r in self.requests}
        # Each step prefills a chunk or generates a token for some request:
        # more steps than that means the engine stalled.
        everything = sum(len(r.prompt) + r.max_tokens for r in self.requests)
        limit = sum(r.arrival + r.max_tokens + 2 + everything // r.prefill_step_size for r in self.requests)
        step, first_step = 0, None
        while unfinished:
            if step > limit:
                raise RuntimeError(f"engine stalled: {sorted(unfinished)} unfinished after {step} steps")
            record = EngineStep(step)
            arriving = [r for r in pending if self.due.get(r.id, step + 1) <= step]
            if arriving:
                pending = [r for r in pending if r not in arriving]
                self.insert(arriving, step, record)
            prompt_responses, generation_responses = self.generator.next()
            for response in prompt_responses:
                (record.joined if self.engine.joined(response) else record.prompt_rows).append(
                    self.by_uid[response.uid])
            if self.store is not None:
                self.store_segments(prompt_responses, step, record)
            for response in generation_responses:
                rid = self.by_uid[response.uid]
                record.generation_rows.append(rid)
                out = self.outputs[rid]
                out.tokens.append(response.token)
                out.logprobs.append(self.engine.logprobs(response))
                out.steps.append(step)
                if response.finish_reason is not None:
                    record.finished.append(rid)
                    unfinished.discard(rid)
                    for r in pending:  # its next turns count their arrival from here
                        if r.continues == rid:
                            self.due[r.id] = step + 1 + r.arrival
                    if self.store is not None:
                        self.put(response.prompt_cache, response.all_tokens, "assistant", rid, step, record)
            if generation_responses and first_step is None:
                caches = self.engine.batch_caches(self.generator)
                if caches is not None:
                    first_step = FirstStep(step, tuple(record.generation_rows), held_layers(caches))
            record.calls = calls_made(self.engine.batch_class)
            timeline.append(record)
            step += 1
        return EngineRun(self.outputs, timeline, applied, self.prompts, self.stored, self.prefixes, first_step)

    def so_far(self, applied) -> EngineRun:
        """What this serve has stored and started from so far (its dicts, as they grow)."""
        return EngineRun(self.outputs, None, applied, self.prompts, self.stored, self.prefixes)

    def prompt(self, request: EngineRequest) -> Tuple[int, ...]:
        if request.continues is None:
            return tuple(request.prompt)
        earlier = request.continues
        return self.prompts[earlier] + tuple(self.outputs[earlier].tokens) + tuple(request.prompt)

    def insert(self, arriving: List[EngineRequest], step: int, record: EngineStep):
        record.arrived = [r.id for r in arriving]
        for r in arriving:
            self.prompts[r.id] = self.prompt(r)
        if self.store is None:
            uids = self.engine.insert(self.generator, arriving, [list(self.prompts[r.id]) for r in arriving])
            self.by_uid.update(zip(uids, (r.id for r in arriving)))
            return
        for r in arriving:  # as mlx_lm.server does for each request it can batch
            prompt = list(self.prompts[r.id])
            cache, rest = fetch_nearest(self.store, prompt)
            cached = len(prompt) - len(rest)
            if cache is None:
                cache = self.engine.rows(r)
            else:
                self.prefixes[r.id] = PrefixUse(cache.number, cached)
                record.from_store.append(r.id)
                cache = self.engine.mergeable(cache)
            # The server's one segment of a request without a system message:
            # the prompt after what came from the store, a "user" segment. (A
            # system message would be a segment of its own, stored on its own;
            # that splits the prefill at its end, a call boundary generate_step
            # alone does not have, and a prefix computed in another call need not
            # be bit-identical. A shared system prompt reaches the store here as
            # the start of another user's longer entry, trimmed.)
            (uid,) = self.generator.insert_segments(segments=[[rest]], max_tokens=[r.max_tokens], caches=[cache],
                                                    all_tokens=[prompt[:cached]])
            self.by_uid[uid] = r.id
            self.segment_types[uid] = ["user"]

    def store_segments(self, prompt_responses, step: int, record: EngineStep):
        """Rows whose prompt segment ended are extracted and stored (the
        server's "Save the caches at end of segments"); they keep going."""
        ended = [r.uid for r in prompt_responses
                 if r.end_of_segment and not r.end_of_prompt and self.segment_types[r.uid]]
        for uid, (cache, tokens) in self.generator.extract_cache(ended).items():
            self.put(cache, tokens[:], self.segment_types[uid].pop(), self.by_uid[uid], step, record)

    def put(self, layers, tokens, kind: str, rid: str, step: int, record: EngineStep):
        """Store a row's layers as the server does, and keep for the oracle
        mlx-lm's own copy of the bytes they hold now."""
        number = len(self.stored)
        stored = StoredPrefix(number, tuple(tokens), None, rid, step, kind)
        copies = []
        try:
            for layer, planned in zip(layers, self.engine.plan.layers):
                copies.append(quantized_copy(layer) if planned.quantized else copy.deepcopy(layer))
            stored.layers = copies
        except NotQuantized as error:
            stored.unusable = f"layer {len(copies)} is {error}"
        self.stored[number] = stored
        self.store.insert_cache(PROMPT_CACHE_MODEL, list(tokens), StoredEntry(layers, number), cache_type=kind)
        record.stored.append(rid)


def mlx_lm_batch_generator(model, batch_class: type, settings: EngineSettings) -> BatchGeneratorEngine:
    return BatchGeneratorEngine(model, batch_class, settings)


@lru_cache(maxsize=None)
def load_engine_factory(spec: Optional[str] = None):
    """The factory named ``package.module:attribute`` (default: BatchGenerator)."""
    spec = spec or DEFAULT_ENGINE
    try:
        target = resolve("--engine", spec)
    except ImplementationError as error:
        raise EngineError(str(error)) from None
    if not callable(target):
        raise EngineError(f"--engine {spec!r}: not callable")
    try:
        inspect.signature(target).bind(None, None, None)
    except TypeError:
        raise EngineError(f"--engine {spec!r}: the factory must take (model, batch_class, settings)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): try it
    return target


def make_engine(spec: Optional[str], model, batch_class: type, settings: EngineSettings):
    engine = load_engine_factory(spec)(model, batch_class, settings)
    if not callable(getattr(engine, "serve", None)):
        raise EngineError(f"--engine {spec!r}: the factory returned {type(engine).__name__}, which has no serve()")
    return engine
