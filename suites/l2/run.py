"""L2, the model per row: the model replays a schedule through the
implementation's batch while the oracle replays each request alone; per row
and call, logits must be bit-identical (greedy tokens are reported
separately), and per layer the cache bytes bit-identical at every event
boundary.

Joiners prefill alone through the oracle's own path (mlx-lm's prompt cache
and conversion rule), then enter the batch through ``merge`` and ``extend``,
one batch cache per layer. Decode steps and verify windows run every row of
the batch in one batched forward. Inputs are teacher-forced from the solo
traces so one flipped argmax cannot derail the comparison.

Only what came out of the implementation is evidence: a batched forward, a
row's bytes in the batch, and a row extracted from it. A request decoding
alone because mlx-lm has not converted it yet compares mlx-lm with itself.

The oracle is trusted only as far as it agrees with itself. With
``repeat_oracle`` (by default on when MLX's default device is a GPU, whose
kernels may not be run-to-run deterministic; off on the CPU) every solo
trace is computed a second time, fresh, never from the oracle cache, and the
two must be equal byte for byte: logits of every call, then every layer's
cache bytes at every event boundary. When they differ the schedule's outcome
is "oracle nondeterministic", naming the request, call (or event and layer),
tensor, flat index and both values; it is never blamed on the
implementation, never a pass, and the stored trace is dropped from the cache.
"""

import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import mlx.core as mx

from kvparity.oracle.mlx_lm_versions import defect_for_model
from kvparity.oracle.models import load_model, random_model_for
from kvparity.oracle.solo import SoloCall, SoloRequest, SoloTrace, greedy, layer_bytes, run_solo, run_solos
from kvparity.oracle.sealed import drop_entry
from kvparity.oracle.trace import cached_solo, oracle_cache, request_key
from kvparity.suites.core.adapter import Implementation
from kvparity.suites.core.raised import forward_of
from kvparity.suites.core.compare import (
    TRIPLE, Divergence, compare_named, first_difference, in_words, left_padding_divergence, state_triples,
)
from kvparity.suites.format.checks import BYTES, LAYOUT, LEFT_PADDING, LOGITS, OFFSET, STORED, TOKENS
from kvparity.suites.core.evidence import (
    MLX_LM_DEFECT, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC, OracleFailed, OracleNondeterministic,
    ScheduleResult,
)
from kvparity.suites.format.levels import L2
from kvparity.suites.core.metrics import LogitStats
from kvparity.suites.core.replay import Replay
from kvparity.suites.core.event_loop import drive
from kvparity.suites.core.loading import parse
from kvparity.suites.core.stored import check_entries, check_fetch, entry_name


def model_for(schedule, forced=None) -> str:
    """The schedule's model: forced, named in the file, or the default
    family's random model with the schedule's head_dim and dtype."""
    if forced:
        return forced
    if schedule.model:
        return schedule.model
    return random_model_for(schedule.head_dim, schedule.dtype)


def fit_to_model(schedule, model):
    """Tokenize text prompts and check the kv settings fit the model; returns
    (schedule, why it cannot run on this model or None)."""
    unfit = model.plan.group_sizes_fit(schedule.group_size)
    if unfit:
        return schedule, f"{unfit} of {model.name}"
    if any(r.text is not None for r in schedule.requests.values()):
        if model.tokenizer is None:
            return schedule, f"text prompts need a tokenizer; {model.name} has none"
        doc = schedule.to_json()
        for rid, request in schedule.requests.items():
            if request.text is not None:
                doc["requests"][rid].pop("text")
                doc["requests"][rid]["prompt"] = list(model.tokenizer.encode(request.text))
        schedule = parse(doc, source=schedule.path)
    return schedule, None


@dataclass
class Output:
    """Logits the model produced for one call of one request."""

    request: str
    step: int  # index of the call in the request's trace
    logits: mx.array  # [positions, vocab]
    from_implementation: bool  # through the batch, or from a cache extracted from it


class ModelBackend:
    """Tokens are the oracle's, fed to a model: teacher forcing."""

    def __init__(self, model, implementation: Implementation, schedule, traces: Dict[str, SoloTrace]):
        self.model = model  # a LoadedModel
        self.implementation = implementation
        self.schedule = schedule
        self.traces = traces
        self.outputs: List[Output] = []
        self.replay = None  # the replay driving this backend, set by the run
        self.resumed: Dict[str, SoloRequest] = {}  # this event's joiners from a store, before merge

    def alone(self, rid, cache=None) -> SoloRequest:
        m = self.model
        return SoloRequest(m.model, self.schedule.requests[rid], self.schedule.bits, self.schedule.group_size,
                           m.vocab_size, m.tokenizer, cache)

    def inputs(self, rid, j):
        return self.traces[rid].calls[j].inputs

    def begin(self, event):
        self.outputs, self.resumed = [], {}

    def watch(self, member, caches):
        pass  # sources are L1's business: L2 reads the same protocol

    def prefill(self, rid, j):
        solo = self.alone(rid)
        self.outputs.append(Output(rid, j, solo.prefill(), False))
        return solo

    def resume(self, rid, caches):
        return self.alone(rid, caches)

    def prefill_from(self, rid, cache, rest, j):
        """The rest of the prompt alone through mlx-lm, on the copy of the
        implementation's stored row (evidence), or on a new cache (a miss)."""
        solo = self.alone(rid, cache)
        inputs = [self.traces[stream].own[k] for stream, k in rest]
        if cache is None:
            self.outputs.append(Output(rid, j, solo.prefill(inputs), False))
            return solo
        with forward_of(self.model.model, "the model's forward on the stored row's copy"):
            logits = solo.prefill(inputs)
            mx.eval(logits)
        self.outputs.append(Output(rid, j, logits, True))
        self.resumed[rid] = solo
        return solo

    def forward(self, layers, rows, n, calls):
        inputs = mx.array([self.inputs(rid, calls[rid]) for rid in rows])
        with forward_of(self.model.model):
            logits = self.model.model(inputs, cache=layers)
            mx.eval(logits)  # what raises while it runs, too, is the forward's
        self.outputs += [Output(rid, calls[rid], logits[i], True) for i, rid in enumerate(rows)]

    def append_alone(self, rid, solo, n, j):
        # A row extracted from the batch decodes on the implementation's bytes: evidence.
        extracted = rid in self.replay.extracted
        if not extracted:  # mlx-lm alone on its own cache: the oracle's path
            self.outputs.append(Output(rid, j, solo.append(self.inputs(rid, j)), False))
            return
        with forward_of(self.model.model, "the model's forward on the extracted cache"):
            logits = solo.append(self.inputs(rid, j))
            mx.eval(logits)
        self.outputs.append(Output(rid, j, logits, True))

    def batched_prefill(self, rids, starts):
        raise AssertionError("the dry run refuses a batched prefill at L2")

    def untrimmable(self) -> str:
        """The model's layers mlx-lm cannot trim (SSM state), in words; empty when none."""
        return ", ".join(f"layer {layer.index} is an {layer.cache}" for layer in self.model.plan.untrimmable())



def repeat_oracle_default() -> bool:
    """Run every solo trace twice where the default device is a GPU."""
    return mx.default_device().type == mx.DeviceType.gpu


def trace_difference(rid: str, first: SoloTrace, second: SoloTrace) -> Optional[OracleNondeterministic]:
    """Where two solo runs of one request first differ, or None when every
    call's inputs and logits and every snapshot's bytes and offset are equal."""
    if len(first.calls) != len(second.calls):
        return OracleNondeterministic(rid, "calls", "trace", None, len(first.calls), len(second.calls),
                                      "number of calls")
    for j, (a, b) in enumerate(zip(first.calls, second.calls)):
        if a.inputs != b.inputs:
            k = next((i for i, (x, y) in enumerate(zip(a.inputs, b.inputs)) if x != y), None)
            return OracleNondeterministic(rid, j, "inputs", k, a.inputs if k is None else a.inputs[k],
                                          b.inputs if k is None else b.inputs[k], "tokens fed")
        if (a.logits is None) != (b.logits is None):
            return OracleNondeterministic(rid, j, "logits", None, a.logits is not None, b.logits is not None,
                                          "logits present")
        if a.logits is not None:
            diff = first_difference(a.logits, b.logits)
            if diff is not None:
                index, x, y = diff
                return OracleNondeterministic(rid, j, "logits", index, x, y,
                                              "" if index is not None else "dtype or shape")
    for event in sorted(set(first.snapshots) | set(second.snapshots)):
        a, b = first.snapshots.get(event), second.snapshots.get(event)
        where = f"snapshot after event #{event}"
        if a is None or b is None or len(a) != len(b):
            return OracleNondeterministic(rid, where, "layers", None, None if a is None else len(a),
                                          None if b is None else len(b))
        if first.offsets.get(event) != second.offsets.get(event):
            return OracleNondeterministic(rid, where, "offset", None, first.offsets.get(event),
                                          second.offsets.get(event))
        for layer, (x, y) in enumerate(zip(a, b)):
            for name in sorted(set(x) | set(y)):
                if name not in x or name not in y:
                    return OracleNondeterministic(rid, f"{where}, layer {layer}", name, None, name in x, name in y,
                                                  "tensor present")
                diff = first_difference(x[name], y[name])
                if diff is not None:
                    index, u, v = diff
                    return OracleNondeterministic(rid, f"{where}, layer {layer}", name, index, u, v,
                                                  "" if index is not None else "dtype or shape")
    return None


def solo_traces(schedule, model, use_cache=True, repeat=False) -> Dict[str, SoloTrace]:
    """Each request alone through mlx-lm. With ``repeat``, a second run,
    always fresh, must equal the first (stored or not) byte for byte, else
    ``OracleNondeterministic`` (and the stored trace is dropped)."""
    if schedule.stores:
        return solo_traces_together(schedule, model, repeat)
    traces = {}
    for rid in schedule.requests:
        run = lambda rid=rid: run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
        try:
            traces[rid] = cached_solo(run, schedule, rid, model) if use_cache else run()
            again = run() if repeat else None
        except Exception as error:  # mlx-lm's own path, not ours: say so, never blame the cache
            raise OracleFailed(f"mlx-lm's solo path for {rid!r} raised {type(error).__name__}: {error}") from error
        if again is not None:
            differs = trace_difference(rid, traces[rid], again)
            if differs is not None:
                if use_cache:  # a trace that differs from itself is no golden
                    drop_entry(oracle_cache() / request_key(schedule, rid, model))
                raise differs
    return traces


def solo_traces_together(schedule, model, repeat=False) -> Dict[str, SoloTrace]:
    """A schedule with stores: every request alone, together (chat turns
    read the tokens of the turns before them); never from the oracle cache,
    whose entries are one request's."""
    run = lambda: run_solos(model.model, schedule, list(schedule.requests), model.vocab_size, model.tokenizer)
    try:
        traces = run()
        again = run() if repeat else None
    except Exception as error:  # mlx-lm's own path, not ours: say so, never blame the cache
        raise OracleFailed(f"mlx-lm's solo path raised {type(error).__name__}: {error}") from error
    for rid in traces if again is not None else ():
        differs = trace_difference(rid, traces[rid], again[rid])
        if differs is not None:
            raise differs
    return traces


def run_l2(schedule, implementation: Implementation, model_name=None, use_cache=True,
           capture: Optional[dict] = None, model=None, repeat_oracle: Optional[bool] = None) -> ScheduleResult:
    """Replay ``schedule`` on the model. ``capture``, when given, receives the
    run's own trace per request (the oracle's format). ``model`` overrides
    the loaded model for the batched side only (tests perturb it).
    ``repeat_oracle``: run every solo trace twice and require equal bytes
    (None: on when the default device is a GPU, see ``repeat_oracle_default``)."""
    loaded = load_model(model_for(schedule, model_name))
    schedule, unfit = fit_to_model(schedule, loaded)
    if unfit:
        raise ValueError(f"{schedule.path}: {unfit}")
    result = ScheduleResult(schedule.name, L2, implementation.name, [e.kind for e in schedule.events],
                            path=schedule.path, model=loaded.name, model_sha256=loaded.sha256, model_source=loaded.source())
    for rid in schedule.requests:
        result.row(rid)
    missing = implementation.missing(schedule.needs)
    if missing:
        result.stop(NOT_SUPPORTED, f"needs {', '.join(missing)}")
        return result
    defect = defect_for_model(loaded)
    if defect is not None:
        result.stop(MLX_LM_DEFECT, defect.attribution())
        return result
    start = time.perf_counter()
    calls_before = dict(implementation.calls)
    if repeat_oracle is None:
        repeat_oracle = repeat_oracle_default()
    try:
        traces = solo_traces(schedule, loaded, use_cache, repeat=repeat_oracle)
    except OracleFailed as error:
        result.stop(ORACLE_CANNOT_RUN, str(error))
        return result
    except OracleNondeterministic as error:
        result.stop(ORACLE_NONDETERMINISTIC, str(error))
        return result
    if capture is not None:
        capture.update({rid: SoloTrace(rid, [SoloCall(c.event, c.op, c.inputs) for c in t.calls])
                        for rid, t in traces.items()})
    backend = ModelBackend(model or loaded, implementation, schedule, traces)
    replay = Replay(schedule, backend)
    backend.replay = replay
    stats: Dict[str, LogitStats] = {rid: LogitStats() for rid in schedule.requests}
    digests: Dict[int, str] = {}  # stored entries' bytes when stored

    def check(event):
        label, at = event.label, event.index
        check_entries(replay, digests, result.note, event)
        for rid, (entry, reused) in (replay.resumed.items() if event.kind == "join_stored" else ()):
            j = len(replay.calls[rid]) - 1  # its resume call: the prompt, and what mlx-lm's store lacked of it
            expected = len(replay.calls[rid][j].tokens) - len(traces[rid].calls[j].inputs)
            if check_fetch(rid, entry, reused, expected, result.note, event) and rid in backend.resumed:
                # Before merge, per layer: the copy of the stored row with the rest of the prompt.
                where = dict(event=label, request=rid)
                for layer, (e, cache) in enumerate(zip(traces[rid].snapshots[at], backend.resumed[rid].cache)):
                    found = compare_named(e, layer_bytes(cache), f"resumed from {entry_name(entry)}: ",
                                          layer=layer, **where)
                    result.note(at, STORED, [rid], 1, [replace(d, check=STORED) for d in found])
        for out in backend.outputs:
            expected = traces[out.request].calls[out.step].logits
            if out.from_implementation:
                stats[out.request].add(expected, out.logits, out.step)
                result.note(at, LOGITS, [out.request], 1,
                            compare_logits(expected, out.logits, label, out.request, out.step))
            if capture is not None:
                capture[out.request].calls[out.step].logits = out.logits
        compare_caches(replay, traces, result, event)
        if capture is not None:
            for rid in replay.running() + list(replay.preempted):
                capture[rid].snapshots[at], capture[rid].offsets[at] = row_bytes(replay, rid)

    with implementation.watching():
        drive(result, replay, schedule.events, check)
    for row in result.rows:
        row.metrics = stats[row.request].as_dict()
        row.series = stats[row.request].series if row.metrics["positions"] else {}
    result.members = implementation.calls_since(calls_before)
    result.seconds = time.perf_counter() - start
    return result


def row_bytes(replay: Replay, rid: str):
    """Per layer, the request's cache bytes as the run holds them, named
    like the oracle's snapshots, and its RoPE offset."""
    alone = replay.waiting.get(rid) or replay.preempted.get(rid)
    if alone is not None:
        return [layer_bytes(c) for c in alone.cache], alone.offset
    i = replay.rows.index(rid)
    plan = replay.backend.model.plan
    layers = []
    for layer, batch in zip(plan.layers, replay.layers):
        if not layer.quantized:  # mlx-lm's own batched class: the row as it extracts it
            layers.append(layer_bytes(batch.extract(i)))
            continue
        start, stop = int(batch.left_padding[i].item()), batch.size()
        triples = state_triples(batch.state)
        if triples is None:  # what the state was instead, for a layout divergence
            layers.append(f"state returned {in_words(batch.state)}, expected the keys' and the values' "
                          "(packed, scales, biases) triples first")
            continue
        layers.append({f"{name}.{part}": x[i : i + 1, :, start:stop]
                       for name, triple in triples.items() for part, x in zip(TRIPLE, triple)})
    return layers, int(replay.layers[plan.attention].offset[i].item())


def compare_caches(replay: Replay, traces, result: ScheduleResult, event):
    """Every layer of every row, batched or alone, against its solo bytes;
    only rows whose bytes came from the implementation count as evidence."""
    label, at = event.label, event.index
    for rid in replay.running() + list(replay.preempted):
        from_implementation = rid in replay.rows or rid in replay.extracted
        made = 1 if from_implementation else 0
        expected, offset = traces[rid].snapshot_at(at)
        where = dict(event=label, request=rid, step=len(replay.calls[rid]) - 1)
        if rid in replay.rows:
            i = replay.rows.index(rid)
            batch = replay.layers[replay.backend.model.plan.attention]
            pad, size = int(batch.left_padding[i].item()), batch.size()
            if size - pad != offset:
                result.note(at, LEFT_PADDING, [rid], 1, [left_padding_divergence(i, offset, size, pad, **where)])
                continue
            result.note(at, LEFT_PADDING, [rid], 1)
        actual, actual_offset = row_bytes(replay, rid)
        prefix = "extracted." if rid in replay.preempted else "waiting." if rid in replay.waiting else ""
        result.note(at, OFFSET, [rid], made, [] if actual_offset == offset else [
            Divergence(OFFSET, expected=offset, actual=actual_offset, detail="RoPE offset", **where)])
        if len(actual) != len(expected):
            result.note(at, LAYOUT, [rid], made, [Divergence(
                LAYOUT, expected=len(expected), actual=len(actual), detail="layers", **where)])
        for layer, (e, a) in enumerate(zip(expected, actual)):
            if isinstance(a, str):
                result.note(at, LAYOUT, [rid], made, [Divergence(LAYOUT, layer=layer, tensor="state", detail=a,
                                                                 **where)])
                continue
            result.note(at, BYTES, [rid], made, compare_named(e, a, prefix, layer=layer, **where))


def compare_logits(expected: mx.array, actual: mx.array, event: str, rid: str, step: int) -> List[Divergence]:
    diff = first_difference(expected, actual)
    if diff is None:
        return []
    index, want, got = diff
    if index is None:  # dtype or shape differ: not comparable
        return [Divergence(LAYOUT, event, rid, tensor="logits", step=step, expected=want, actual=got)]
    e32, a32 = expected.astype(mx.float32), actual.astype(mx.float32)
    max_abs = mx.abs(e32 - a32).max().item()
    positions = expected.shape[0]
    flipped = [p for p in range(positions) if greedy(expected[p]) != greedy(actual[p])]
    found = [Divergence(LOGITS, event, rid, tensor="logits", step=step, index=index, expected=want, actual=got,
                        detail=f"max abs diff {max_abs}, top-1 agree {positions - len(flipped)}/{positions}")]
    if flipped:
        p = flipped[0]
        found.append(Divergence(TOKENS, event, rid, tensor="argmax", step=step, index=p,
                                expected=greedy(expected[p]), actual=greedy(actual[p])))
    return found


def compare_traces(name: str, golden: Dict[str, SoloTrace], candidate: Dict[str, SoloTrace],
                   source: str) -> ScheduleResult:
    """The L2 comparison between two recorded trace sets: logits per call and
    cache bytes per layer at every recorded event boundary. Whatever the
    golden holds and the candidate lacks is a ``layout`` divergence."""
    events = max((c.event for t in golden.values() for c in t.calls), default=-1) + 1
    result = ScheduleResult(name, L2, source, ["trace"] * events)
    stats = {rid: LogitStats() for rid in golden}
    for rid, expected in golden.items():
        result.row(rid)
        got = candidate.get(rid)
        if got is None or len(got.calls) != len(expected.calls):
            result.note(0, LAYOUT, [rid], 1, [Divergence(
                LAYOUT, "#0 trace", rid, expected=len(expected.calls),
                actual=None if got is None else len(got.calls), detail="calls in the candidate's trace")])
            continue
        for step, (e, a) in enumerate(zip(expected.calls, got.calls)):
            if e.logits is None:
                continue
            label = f"#{e.event} trace"
            if a.logits is None:
                result.note(e.event, LAYOUT, [rid], 1, [Divergence(
                    LAYOUT, label, rid, tensor="logits", step=step, detail="missing in the candidate")])
                continue
            stats[rid].add(e.logits, a.logits, step)
            result.note(e.event, LOGITS, [rid], 1, compare_logits(e.logits, a.logits, label, rid, step))
        for event, layers in sorted(expected.snapshots.items()):
            label = f"#{event} trace"
            actual, actual_offset = got.snapshots.get(event), got.offsets.get(event)
            if actual is None or len(actual) != len(layers):
                result.note(event, LAYOUT, [rid], 1, [Divergence(
                    LAYOUT, label, rid, expected=len(layers), actual=None if actual is None else len(actual),
                    detail="cache snapshot layers in the candidate")])
                continue
            result.note(event, OFFSET, [rid], 1, [] if actual_offset == expected.offsets[event] else [
                Divergence(OFFSET, label, rid, expected=expected.offsets[event], actual=actual_offset)])
            for layer, (e, a) in enumerate(zip(layers, actual)):
                result.note(event, BYTES, [rid], 1, compare_named(e, a, event=label, request=rid, layer=layer))
    for row in result.rows:
        row.metrics = stats[row.request].as_dict()
        row.series = stats[row.request].series if row.metrics["positions"] else {}
    return result
