"""A continuous-batching engine for an mlx-lm model that replays a schedule.

Joiners prefill alone through the oracle's path (mlx-lm's prompt cache and
conversion rule), then enter the running batch through the implementation's
``merge`` and ``extend``, one batch cache per layer. Decode steps and verify
windows run every row of the batch in one batched forward. Inputs are
teacher-forced from the solo traces so one flipped argmax cannot derail the
comparison; the engine's own argmax is recorded separately.

The batch is quantized, and a forward runs every row through one attention
path, so a request that joins before its ``quantized_kv_start`` waits: it
decodes alone through mlx-lm, and enters the batch at the call after which
mlx-lm converts it (per-row delayed conversion).
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
        self.rows: List[str] = []  # batch rows, in order
        self.waiting: Dict[str, SoloRequest] = {}  # joined, not yet quantized: decode alone
        self.preempted: Dict[str, SoloRequest] = {}  # extracted: decode only when told
        self.consumed: Dict[str, int] = {}  # calls of each request's trace replayed

    def alone(self, rid: str, cache=None) -> SoloRequest:
        return SoloRequest(self.model, self.schedule.requests[rid], self.schedule.bits,
                           self.schedule.group_size, self.vocab_size, self.tokenizer, cache)

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

    def enter(self, solos: Dict[str, SoloRequest]):
        """Quantized rows join the batch together; the others wait."""
        ready = [rid for rid, solo in solos.items() if solo.quantized]
        if ready:
            self.add_rows([solos[rid].cache for rid in ready], ready)
        self.waiting.update({rid: solo for rid, solo in solos.items() if not solo.quantized})

    def keep_rows(self, keep: List[str]):
        if not keep:
            self.layers, self.rows = None, []
            return
        indices = [self.rows.index(r) for r in keep]
        for batch in self.layers:
            batch.filter(indices)
        self.rows = keep

    def drop_tokens(self, amounts: Dict[str, int]):
        """Roll back the named rows, batched or waiting, by their counts."""
        batched = [amounts.get(rid, 0) for rid in self.rows]
        if len(set(batched)) <= 1:
            if batched and batched[0]:
                for batch in self.layers:
                    batch.trim(batched[0])
        elif not self.impl.supports("per_row_rollback"):
            raise NotImplementedError("per-row rollback is not supported")
        else:
            for batch in self.layers:
                batch.rollback(batched)
        for rid, n in amounts.items():
            if rid in self.waiting and n:
                self.waiting[rid].trim(n)
        for rid in self.rows + list(self.waiting):
            if amounts.get(rid, 0):
                self.next_call(rid, "trim")

    def forward(self, n: int) -> List[Output]:
        """One call of n tokens for every running row: one batched forward,
        and one alone for each waiting row; rows mlx-lm just converted enter."""
        outputs = []
        if self.rows:
            calls = [self.next_call(rid, "append") for rid in self.rows]
            inputs = mx.array([call.inputs for _, call in calls])
            logits = self.model(inputs, cache=self.layers)
            outputs += [Output(rid, j, logits[i]) for i, (rid, (j, _)) in enumerate(zip(self.rows, calls))]
        waiting, self.waiting = self.waiting, {}
        for rid, solo in waiting.items():
            j, call = self.next_call(rid, "append")
            outputs.append(Output(rid, j, solo.append(call.inputs)))
        self.enter(waiting)
        return outputs

    def row_bytes(self, rid: str):
        """Per layer, the request's cache bytes as the engine holds them, named
        like the oracle's snapshots, and its RoPE offset."""
        alone = self.waiting.get(rid) or self.preempted.get(rid)
        if alone is not None:
            return [layer_bytes(c) for c in alone.cache], alone.offset
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

    def running(self) -> List[str]:
        return self.rows + list(self.waiting)

    # -- events ----------------------------------------------------------------------

    def apply(self, event) -> List[Output]:
        return getattr(self, f"on_{event.kind}")(event.args) or []

    def on_join(self, rids):
        outputs, solos = [], {}
        for rid in rids:
            solo = solos[rid] = self.alone(rid)
            j, _ = self.next_call(rid, "prefill")
            outputs.append(Output(rid, j, solo.prefill()))
        self.enter(solos)
        return outputs

    def on_step(self, n: int):
        outputs = []
        for _ in range(n):
            outputs += self.forward(1)
        return outputs

    def on_leave(self, rids):
        for rid in rids:
            self.waiting.pop(rid, None)
        self.keep_rows([r for r in self.rows if r not in rids])

    def on_spec_round(self, args):
        k, accepted = args["k"], args.get("accepted", {})
        outputs = self.forward(k + 1)
        self.drop_tokens({rid: k - accepted.get(rid, k) for rid in self.running()})
        return outputs

    def on_rollback(self, amounts):
        self.drop_tokens(amounts)

    def on_trim(self, n: int):
        self.drop_tokens({rid: n for rid in self.running()})

    def on_extract(self, rid):
        if rid in self.waiting:
            self.preempted[rid] = self.waiting.pop(rid)
            return
        i = self.rows.index(rid)
        self.preempted[rid] = self.alone(rid, [batch.extract(i) for batch in self.layers])
        self.keep_rows([r for r in self.rows if r != rid])

    def on_solo_step(self, steps):
        outputs = []
        for rid, n in steps.items():
            for _ in range(n):
                j, call = self.next_call(rid, "append")
                outputs.append(Output(rid, j, self.preempted[rid].append(call.inputs)))
        return outputs

    def on_reinsert(self, rid):
        self.enter({rid: self.preempted.pop(rid)})
