"""mlx-vlm's own engine at L3: its ``BatchGenerator`` with ``kv_bits``
(``mlx_vlm/generate/ar.py:2490``, mlx-vlm 0.7.10), serving an mlx-lm text
model, as ``--engine kvparity.suites.l3.engine_mlx_vlm:batch_generator``.

It lives in suites/, not impl/ecosystem/: an engine hands back the harness's
``EngineRun`` and is driven by the same serving loop as mlx-lm's
``BatchGenerator`` (``suites/l3/engines.py``); impl/ imports nothing of the
harness. It needs mlx-vlm installed (without it the engine cannot be
imported: the run cannot judge here).

The engine builds its caches itself, by name (``_make_cache``, ar.py:881):
mlx-vlm's own ``BatchQuantizedKVCache`` for each layer that
``should_quantize_kv_layer`` picks (models/cache.py:10-23: every layer of a
model with 2 layers or fewer; all but the last of a deeper one), a bf16
``BatchKVCache`` for the others. So it serves only where ``--impl`` is
mlx-vlm's class or the adapter of it
(``kvparity.impl.ecosystem.mlx_vlm_cache:BatchQuantizedKVCache``), and what
runs is the package's class itself: the run counts no protocol members.

What the engine needs that an mlx-lm model does not have, translated here
and nothing else:

* prompts go in as ``inputs_embeds`` (``_merge_prefill_prompt_kwargs``
  raises without them, ar.py:815), and the prefill forward passes them by
  that name (ar.py:2150): the model's own embeddings of the prompt, passed
  to mlx-lm's forward as its ``input_embeddings``, which is what mlx-lm
  computes from the tokens;
* a processor whose ``stopping_criteria`` is callable (ar.py:2574): mlx-vlm's
  own ``StoppingCriteria`` with no end-of-sequence tokens, as the oracle
  stops only at ``max_tokens``;
* each token's log-prob comes back as a Python float (``tolist()`` of the
  logits' dtype, ar.py:1246 and 1470): made an array of that dtype again
  (the embeddings' dtype, the activations'), which holds the same value.

It keeps its generation batch where mlx-lm's generator does
(``_generation_batch``, ar.py:2576), so the ``quantized`` check reads each
layer's cache the same way.
"""

from typing import List, Sequence

import mlx.core as mx
from mlx_vlm.generate.ar import BatchGenerator
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.utils import StoppingCriteria

from kvparity.suites.l3.engines import (
    BatchGeneratorEngine,
    EngineRequest,
    EngineRun,
    EngineSettings,
    EngineUnsupported,
    Serving,
    uniform,
)


class TextModel:
    """An mlx-lm model called as mlx-vlm's engine calls its models."""

    def __init__(self, model):
        self.model = model
        self.layers = model.layers  # _make_cache counts them (ar.py:991)
        self.language_model = self  # the decode steps call this (ar.py:1104)

    def __call__(self, inputs, cache=None, inputs_embeds=None, **kwargs):
        return self.model(inputs, cache=cache, input_embeddings=inputs_embeds)


class TextProcessor:
    """No tokenizer: only the stopping criteria the engine asks for."""

    def __init__(self):
        self.stopping_criteria = StoppingCriteria([], None)


class MlxVlmBatchGenerator(BatchGeneratorEngine):
    serves_conversations = False  # its prompt cache (APC) is its own; not driven here

    def __init__(self, model, batch_class: type, settings: EngineSettings):
        super().__init__(model, batch_class, settings)
        self.name = "mlx_vlm.generate.ar.BatchGenerator(kv_bits)"
        self.dtype = None  # the activations', known at the first insert

    def serve(self, requests: Sequence[EngineRequest]) -> EngineRun:
        if not issubclass(self.batch_class, vlm_cache.BatchQuantizedKVCache):
            raise EngineUnsupported(
                f"mlx-vlm's BatchGenerator builds mlx-vlm's own BatchQuantizedKVCache by name "
                f"(mlx_vlm/generate/ar.py:939); it cannot run {self.batch_class.__name__}")
        if self.settings.prompt_cache_size is not None:
            raise EngineUnsupported("mlx-vlm's prompt cache (APC) is not driven at L3; this engine serves "
                                    "requests without a prompt cache")
        if any(r.quantized_kv_start is not None for r in requests):
            raise EngineUnsupported(
                "mlx-vlm's BatchGenerator quantizes the uniform batch cache from the first token "
                "(quantized_kv_start defers only TurboQuant, mlx_vlm/generate/ar.py:928-931)")
        bits = uniform(requests, "bits", "BatchGenerator has one kv_bits")
        group_size = uniform(requests, "group_size", "BatchGenerator has one kv_group_size")
        step_size = uniform(requests, "prefill_step_size", "BatchGenerator has one prefill_step_size")
        knobs = {k: getattr(self.settings, k) for k in ("completion_batch_size", "prefill_batch_size")
                 if getattr(self.settings, k) is not None}
        generator = BatchGenerator(TextModel(self.model), TextProcessor(), kv_bits=bits, kv_group_size=group_size,
                                   kv_quant_scheme="uniform", prefill_step_size=step_size, **knobs)
        applied = {k: getattr(generator, k) for k in ("completion_batch_size", "prefill_batch_size",
                                                      "prefill_step_size", "kv_bits", "kv_group_size")}
        try:
            return Serving(self, generator, None, requests).run(applied)
        finally:
            generator.close()

    def insert(self, generator, requests: Sequence[EngineRequest], prompts: List[List[int]]) -> List[int]:
        embeddings = [self.model.model.embed_tokens(mx.array(prompt)[None]) for prompt in prompts]
        self.dtype = embeddings[0].dtype
        return generator.insert(prompts, max_tokens=[r.max_tokens for r in requests],
                                prompt_kwargs=[{"inputs_embeds": e} for e in embeddings])

    @staticmethod
    def joined(prompt_response) -> bool:
        return True  # it reports a prompt only once its first token is out (ar.py:3111, 3160, 3233)

    def logprobs(self, response) -> mx.array:
        return mx.array(response.token_logprob, dtype=self.dtype)


def batch_generator(model, batch_class: type, settings: EngineSettings) -> MlxVlmBatchGenerator:
    return MlxVlmBatchGenerator(model, batch_class, settings)
