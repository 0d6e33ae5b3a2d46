"""Tiny engines that test the L3 engine adapter itself.

``serial`` serves requests one at a time through mlx-lm's ``generate_step``
with the cache semantics the L3 oracle uses: it must pass (trivially, which is
the point: the adapter's plumbing is all it exercises). The broken ones must
fail: ``drops_last_token`` loses a request's last token, ``swaps_outputs``
hands two requests each other's output.
"""

from typing import Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.suites.engines import EngineRequest, EngineRun, EngineSettings, Generated


class SerialEngine:
    name = "serial generate_step"

    def __init__(self, model, batch_class: type, settings: EngineSettings):
        self.model = model  # batch_class is unused: nothing is batched here

    def serve(self, requests: Sequence[EngineRequest]) -> EngineRun:
        outputs, step = {}, 0
        for request in sorted(requests, key=lambda r: r.arrival):
            step = max(step, request.arrival)
            if request.quantized_kv_start is None:
                caches = [QuantizedKVCache(group_size=request.group_size, bits=request.bits)
                          for _ in self.model.layers]
                kv = {"prompt_cache": caches}
            else:
                kv = {"kv_bits": request.bits, "kv_group_size": request.group_size,
                      "quantized_kv_start": request.quantized_kv_start}
            out = outputs[request.id] = Generated()
            for token, logprobs in generate_step(mx.array(request.prompt), self.model,
                                                 max_tokens=request.max_tokens,
                                                 prefill_step_size=request.prefill_step_size, **kv):
                out.tokens.append(token)
                out.logprobs.append(logprobs)
                out.steps.append(step)
                step += 1
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


serial = SerialEngine
chosen_logprob_only = ChosenLogprobOnly
drops_last_token = DropsLastToken
swaps_outputs = SwapsOutputs
