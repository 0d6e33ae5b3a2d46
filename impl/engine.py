"""A continuous-batching engine for an mlx-lm model that replays a schedule.

Joiners prefill alone through the oracle's path (mlx-lm's prompt cache and
conversion rule), then enter the running batch through the implementation's
``merge`` and ``extend``, one batch cache per layer. Decode steps and verify
windows run every row in one batched forward. Inputs are teacher-forced from
the solo traces so one flipped argmax cannot derail the comparison; the
engine's own argmax is recorded separately.
"""

from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx

from kvparity.impl.adapter import Implementation
from kvparity.oracle.solo import SoloRequest, SoloTrace, layer_bytes

TRIPLE = ("packed", "scales", "biases")


@dataclass
class Output:
    """Logits the engine produced for one call of one request."""

    request: str
    step: int  # index of the call in the request's trace
    logits: mx.array  # [positions, vocab]


class Engine:
    def __init__(self, model, implementation: Implementation, schedule, traces: Dict[str, SoloTrace],
                 vocab_size: int, tokenizer=None):
        self.model = model
        self.impl = implementation
        self.schedule = schedule
        self.traces = traces
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.layers = None  # one batch cache per layer, or None when no row runs
        self.rows: List[str] = []
        self.preempted: Dict[str, list] = {}  # request -> per-layer solo caches
        self.consumed: Dict[str, int] = {}  # calls of each request's trace replayed

    # -- teacher forcing ---------------------------------------------------------

    def next_call(self, rid: str, op: str):
        trace = self.traces[rid]
        j = self.consumed.get(rid, 0)
        call = trace.calls[j]
        if call.op != op:
            raise RuntimeError(f"engine and oracle disagree on the calls of {rid!r}: {call.op} vs {op}")
        self.consumed[rid] = j + 1
        return j, call

    # -- batch helpers -------------------------------------------------------------

    def add_rows(self, per_row_caches: List[list], rids: List[str]):
        new = [self.impl.merge(list(layer)) for layer in zip(*per_row_caches)]
        if self.layers is None:
            self.layers = new
        else:
            for batch, other in zip(self.layers, new):
                batch.extend(other)
        self.rows.extend(rids)

    def keep_rows(self, keep: List[str]):
        if not keep:
            self.layers, self.rows = None, []
            return
        indices = [self.rows.index(r) for r in keep]
        for batch in self.layers:
            batch.filter(indices)
        self.rows = keep

    def drop_tokens(self, amounts: List[int]):
        if len(set(amounts)) == 1:
            if amounts[0]:
                for batch in self.layers:
                    batch.trim(amounts[0])
        elif not self.impl.supports("per_row_rollback"):
            raise NotImplementedError("per-row rollback is not supported")
        else:
            for batch in self.layers:
                batch.rollback(amounts)
        for rid, n in zip(self.rows, amounts):
            if n:
                self.next_call(rid, "trim")

    def forward_batch(self, n: int) -> List[Output]:
        """One batched call of n tokens per row, inputs from the traces."""
        calls = [self.next_call(rid, "append") for rid in self.rows]
        inputs = mx.array([call.inputs for _, call in calls])
        logits = self.model(inputs, cache=self.layers)
        return [Output(rid, j, logits[i]) for i, (rid, (j, _)) in enumerate(zip(self.rows, calls))]

    def row_bytes(self, rid: str):
        """Per layer, the request's cache bytes as the engine holds them, named
        like the oracle's snapshots, and its RoPE offset."""
        if rid in self.preempted:
            caches = self.preempted[rid]
            return [layer_bytes(c) for c in caches], caches[0].offset
        i = self.rows.index(rid)
        layers = []
        for batch in self.layers:
            start, stop = batch.left_padding[i].item(), batch.size()
            named = {}
            for name, triple in zip(("keys", "values"), batch.state[:2]):
                for part, x in zip(TRIPLE, triple):
                    named[f"{name}.{part}"] = x[i : i + 1, :, start:stop]
            layers.append(named)
        return layers, int(self.layers[0].offset[i].item())

    # -- events ----------------------------------------------------------------------

    def apply(self, event) -> List[Output]:
        return getattr(self, f"on_{event.kind}")(event.args) or []

    def on_join(self, rids):
        outputs, caches = [], []
        for rid in rids:
            request = self.schedule.requests[rid]
            solo = SoloRequest(self.model, request, self.schedule.bits, self.schedule.group_size,
                               self.vocab_size, self.tokenizer)
            j, _ = self.next_call(rid, "prefill")
            outputs.append(Output(rid, j, solo.prefill()))
            caches.append(solo.cache)
        self.add_rows(caches, rids)
        return outputs

    def on_step(self, n: int):
        outputs = []
        for _ in range(n):
            outputs += self.forward_batch(1)
        return outputs

    def on_leave(self, rids):
        self.keep_rows([r for r in self.rows if r not in rids])

    def on_spec_round(self, args):
        k, accepted = args["k"], args.get("accepted", {})
        outputs = self.forward_batch(k + 1)
        self.drop_tokens([k - accepted.get(rid, k) for rid in self.rows])
        return outputs

    def on_rollback(self, amounts):
        self.drop_tokens([amounts.get(rid, 0) for rid in self.rows])

    def on_trim(self, n: int):
        self.drop_tokens([n] * len(self.rows))

    def on_extract(self, rid):
        i = self.rows.index(rid)
        self.preempted[rid] = [batch.extract(i) for batch in self.layers]
        self.keep_rows([r for r in self.rows if r != rid])

    def on_solo_step(self, steps):
        outputs = []
        for rid, n in steps.items():
            for _ in range(n):
                j, call = self.next_call(rid, "append")
                logits = self.model(mx.array(call.inputs)[None], cache=self.preempted[rid])[0]
                outputs.append(Output(rid, j, logits))
        return outputs

    def on_reinsert(self, rid):
        self.add_rows([self.preempted.pop(rid)], [rid])
