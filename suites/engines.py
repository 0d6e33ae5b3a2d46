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
"""

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.mlx_lm_versions import MlxLmDefectFound, batch_generator_next, installed_batch_generator_defect
from kvparity.suites.adapter import ImplementationError, resolve

DEFAULT_ENGINE = "kvparity.suites.engines:mlx_lm_batch_generator"


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


@dataclass(frozen=True)
class EngineSettings:
    """Engine knobs from the schedule; None keeps the engine's default."""

    completion_batch_size: Optional[int] = None
    prefill_batch_size: Optional[int] = None
    prefill_step_size: Optional[int] = None


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

    @property
    def prompt_width(self) -> int:
        return len(self.prompt_rows)

    @property
    def generation_width(self) -> int:
        return len(self.generation_rows)


@dataclass
class EngineRun:
    outputs: Dict[str, Generated]
    timeline: Optional[List[EngineStep]] = None  # None: the engine does not say
    settings: Dict[str, object] = field(default_factory=dict)  # as the engine applied them


def quantized_row_class(batch_class: type) -> type:
    """A solo quantized cache (mlx-lm's ``QuantizedKVCache``) whose class
    merges into ``batch_class``: what ``BatchGenerator`` needs per layer to
    batch a request, since mlx-lm's own ``QuantizedKVCache`` has no ``merge``."""

    class QuantizedRow(QuantizedKVCache):
        @classmethod
        def merge(cls, rows):
            return batch_class.merge(rows)

        def size(self):
            # the base class answers 0; batching code reads a row's length here
            return self.offset

    QuantizedRow.__name__ = QuantizedRow.__qualname__ = f"QuantizedRowOf{batch_class.__name__}"
    return QuantizedRow


def uniform(requests: Sequence[EngineRequest], attribute: str, why: str):
    values = {getattr(r, attribute) for r in requests}
    if len(values) > 1:
        raise EngineUnsupported(f"requests differ in {attribute} ({sorted(values, key=str)}): {why}")
    return values.pop()


class BatchGeneratorEngine:
    """mlx-lm's BatchGenerator, unmodified, with the cache under test."""

    def __init__(self, model, batch_class: type, settings: EngineSettings):
        self.model = model
        self.row_class = quantized_row_class(batch_class)
        self.settings = settings
        self.name = f"mlx_lm.generate.BatchGenerator[{batch_class.__name__}]"

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
        knobs = {k: v for k, v in vars(self.settings).items() if v is not None}
        knobs["prefill_step_size"] = step_size
        generator = BatchGenerator(self.model, **knobs)
        applied = {k: getattr(generator, k) for k in ("completion_batch_size", "prefill_batch_size",
                                                      "prefill_step_size")}
        layers = len(self.model.layers)
        try:
            return self._drive(generator, sorted(requests, key=lambda r: r.arrival), layers, applied)
        finally:
            generator.close()

    def _drive(self, generator, requests, layers, applied) -> EngineRun:
        outputs = {r.id: Generated() for r in requests}
        by_uid: Dict[int, str] = {}
        timeline: List[EngineStep] = []
        pending = list(requests)
        unfinished = {r.id for r in requests}
        # Each step prefills a chunk or generates a token for some request:
        # more steps than that means the engine stalled.
        limit = max(r.arrival for r in requests) + sum(
            len(r.prompt) // r.prefill_step_size + 2 + r.max_tokens for r in requests)
        step = 0
        while unfinished:
            if step > limit:
                raise RuntimeError(f"engine stalled: {sorted(unfinished)} unfinished after {step} steps")
            record = EngineStep(step)
            arriving = [r for r in pending if r.arrival <= step]
            pending = pending[len(arriving):]
            if arriving:
                uids = generator.insert(
                    [list(r.prompt) for r in arriving],
                    max_tokens=[r.max_tokens for r in arriving],
                    caches=[[self.row_class(group_size=r.group_size, bits=r.bits) for _ in range(layers)]
                            for r in arriving],
                )
                by_uid.update(zip(uids, (r.id for r in arriving)))
                record.arrived = [r.id for r in arriving]
            prompt_responses, generation_responses = batch_generator_next(generator)
            for response in prompt_responses:
                (record.joined if response.end_of_prompt else record.prompt_rows).append(by_uid[response.uid])
            for response in generation_responses:
                rid = by_uid[response.uid]
                record.generation_rows.append(rid)
                out = outputs[rid]
                out.tokens.append(response.token)
                out.logprobs.append(response.logprobs)
                out.steps.append(step)
                if response.finish_reason is not None:
                    record.finished.append(rid)
                    unfinished.discard(rid)
            timeline.append(record)
            step += 1
        return EngineRun(outputs, timeline, applied)


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
