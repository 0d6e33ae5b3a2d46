"""Tiny engines that test the L3 engine adapter itself.

``serial`` serves requests one at a time through the L3 oracle itself
(``oracle/generation.py``, mlx-lm's ``generate_step``): it must pass
(trivially, which is the point: the adapter's plumbing is all it exercises). The broken ones must
fail: ``drops_last_token`` loses a request's last token, ``swaps_outputs``
hands two requests each other's output, and ``stored_entries_change``
(mlx-lm's BatchGenerator in the server loop) writes into each prompt cache
entry after storing it, as a store sharing memory with a batch would see.
``keeps_last_layer_bf16`` (mlx-lm's BatchGenerator) hands its last layer a
plain ``KVCache``, which batches as a bf16 ``BatchKVCache``: an engine that
was asked for a quantized cache and keeps one layer unquantized.
``leaves_batch_dense`` accepts the quantized settings and serves every request
from mlx-lm's dense prompt cache (a server whose ``--kv-bits`` never reaches
the batch); ``converts_if_layer0_attention`` quantizes only when layer 0 is an
attention layer (a conversion that reads ``cache[0]``), so a hybrid model
whose layer 0 holds SSM state stays dense. ``keeps_stored_rows_dense``
hands merge its stored rows dequantized into dense ``KVCache`` layers: the
cache under test declines them, and that is the engine's finding.
"""

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache

from kvparity.oracle.generation import generate_alone
from kvparity.suites.l3.engines import (BatchGeneratorEngine, EngineRequest, EngineRun, EngineSettings, Generated,
                                     quantized_row_class)


class SerialEngine:
    name = "serial generate_step"

    def __init__(self, model, batch_class: type, settings: EngineSettings):
        self.model = model  # batch_class is unused: nothing is batched here

    def serve(self, requests: Sequence[EngineRequest]) -> EngineRun:
        outputs, step = {}, 0
        for request in sorted(requests, key=lambda r: r.arrival):
            step = max(step, request.arrival)
            alone = generate_alone(self.model, request)  # the oracle's own computation
            steps = list(range(step, step + len(alone.tokens)))
            outputs[request.id] = Generated(alone.tokens, alone.logprobs, steps)
            step += len(alone.tokens)
        return EngineRun(outputs)  # no timeline: this engine does not batch


class ChosenLogprobOnly(SerialEngine):
    """Gives only the chosen token's log-prob, as many servers do."""

    name = "serial, chosen log-prob only"

    def serve(self, requests):
        run = super().serve(requests)
        for out in run.outputs.values():
            out.logprobs = [v[t] for v, t in zip(out.logprobs, out.tokens)]
        return run


class DropsLastToken(SerialEngine):
    name = "serial, drops the first request's last token"

    def serve(self, requests):
        run = super().serve(requests)
        out = run.outputs[requests[0].id]
        del out.tokens[-1], out.logprobs[-1], out.steps[-1]
        return run


class SwapsOutputs(SerialEngine):
    name = "serial, swaps the first two requests' outputs"

    def serve(self, requests):
        run = super().serve(requests)
        a, b = requests[0].id, requests[1].id
        run.outputs[a], run.outputs[b] = run.outputs[b], run.outputs[a]
        return run


class StoreWhoseEntriesChange(LRUPromptCache):
    """Zeroes the first key token of every layer of an entry, in place, once
    it is stored: later fetches copy the changed bytes."""

    def insert_cache(self, model, tokens, prompt_cache, **kwargs):
        super().insert_cache(model, tokens, prompt_cache, **kwargs)
        for layer in prompt_cache:
            layer.keys[0][..., :1, :] = 0


class StoredEntriesChange(BatchGeneratorEngine):
    store_class = StoreWhoseEntriesChange


class KeepsLastLayerBf16(BatchGeneratorEngine):
    def rows(self, request):
        return super().rows(request)[:-1] + [KVCache()]


class LeavesBatchDense(BatchGeneratorEngine):
    def rows(self, request):
        return make_prompt_cache(self.model)


class ConvertsIfLayer0Attention(BatchGeneratorEngine):
    def rows(self, request):
        dense = make_prompt_cache(self.model)
        return super().rows(request) if isinstance(dense[0], KVCache) else dense


class KeepsStoredRowsDense(BatchGeneratorEngine):
    """Stores rows as it should, then hands merge each stored layer
    dequantized into mlx-lm's dense ``KVCache`` (made to merge as a
    quantized row would): an engine whose store keeps rows in bf16. What
    the cache does with it is not the cache's refusal: the engine's finding."""

    def mergeable(self, entry):
        handed = []
        for layer, planned in zip(entry, self.plan.layers):
            if planned.quantized and hasattr(layer, "bits"):
                dense = quantized_row_class(self.batch_class, KVCache)()
                dense.keys, dense.values = (
                    mx.dequantize(*triple, group_size=layer.group_size, bits=layer.bits)[..., : layer.offset, :]
                    for triple in (layer.keys, layer.values))
                dense.offset = layer.offset
                layer = dense
            handed.append(layer)
        return handed


serial = SerialEngine
chosen_logprob_only = ChosenLogprobOnly
drops_last_token = DropsLastToken
swaps_outputs = SwapsOutputs
stored_entries_change = StoredEntriesChange
keeps_last_layer_bf16 = KeepsLastLayerBf16
leaves_batch_dense = LeavesBatchDense
converts_if_layer0_attention = ConvertsIfLayer0Attention
keeps_stored_rows_dense = KeepsStoredRowsDense
