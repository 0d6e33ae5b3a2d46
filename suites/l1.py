"""L1, cache bytes: replay a schedule on the implementation with synthetic
keys and values and, after every event, hold every row against the same
request run alone through mlx-lm's caches.

Checked after each event, per row ``i`` of request ``r`` (``lp`` its left
padding, ``size`` the batch width). Parity, what a request can observe:

* ``offset``: ``offset[i]`` (the row's RoPE position) equals the solo offset;
* ``left_padding``: ``size - lp`` equals the solo offset;
* ``bytes``: keys and values, packed, scales and biases, on ``[lp, size)`` of
  the batch state, of what ``update_and_fetch`` returned and of
  ``extract(i)`` equal the solo cache on ``[0, offset)``, dtype and shape included;
* ``layout``: the state holds triples of the expected dtypes and shapes;
* ``extract``: ``extract(i)`` has the row's offset, bits and group size, and
  leaves the batch unchanged;
* ``mask``: ``make_mask(N)`` hides exactly the padding and the future;
* ``shared_padding``: no column is padding in every row;
* ``source``: merge/extend leave their sources' bytes unchanged.

Hygiene, what no request can observe (reported; gating under ``strict``):

* ``pad``: columns ``[0, lp)`` are zero;
* ``alias``: ``extract`` returns memory of its own, and ``merge`` keeps none
  of its sources' buffers (sharing keeps a buffer alive: it costs memory).
"""

import time
from typing import Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import describe_shared, owned_arrays, raw, raw_many, shared_memory
from kvparity.oracle.solo import layer_bytes
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV
from kvparity.suites.adapter import Implementation
from kvparity.suites.compare import Divergence, batch_row, compare_all, triple_job
from kvparity.suites.evidence import NOT_SUPPORTED, ScheduleResult, drive
from kvparity.suites.replay import Replay

MASK_WIDTHS = (1, 3)
# What no request can observe: reported, and gating only under a strict policy.
HYGIENE_CHECKS = ("pad", "alias")


class SyntheticBackend:
    """Tokens are synthetic keys and values per (request, token); one layer."""

    def __init__(self, implementation: Implementation, schedule, kv: SyntheticKV):
        self.implementation = implementation
        self.schedule = schedule
        self.kv = kv
        self.written: Dict[str, int] = {}  # tokens each request has drawn
        self.fetched = None  # (replay version, triples) of the last update_and_fetch
        self.sources = []  # (member, caches, their arrays before) of this event's merges/extends
        self.replay = None

    def draw(self, rid: str, n: int):
        return self.kv.draw(self.written, self.schedule.requests[rid], n)

    def begin(self, event):
        self.fetched, self.sources = None, []

    def watch(self, member, caches):
        # MLX arrays are immutable: holding them is holding the bytes as they were.
        self.sources.append((member, caches, [x for c in caches for x in owned_arrays(c)]))

    def prefill(self, rid, j):
        return SoloCache.prefilled(self.schedule.requests[rid], self.schedule.bits, self.schedule.group_size,
                                   lambda n: self.draw(rid, n))

    def resume(self, rid, caches):
        start = self.schedule.requests[rid].quantized_kv_start
        return SoloCache(self.schedule.bits, self.schedule.group_size, start, caches[0])

    def forward(self, layers, rows, n, calls):
        keys, values = zip(*(self.draw(rid, n) for rid in rows))
        fetched = layers[0].update_and_fetch(mx.concatenate(keys), mx.concatenate(values))
        self.fetched = (self.replay.version, fetched)

    def append_alone(self, rid, solo, n, j):
        solo.append(*self.draw(rid, n))

    def batched_prefill(self, rids):
        """Several prompts in one right-padded call: prepare/finalize."""
        requests = [self.schedule.requests[rid] for rid in rids]
        width = max(r.prompt_len for r in requests)
        empty = [QuantizedKVCache(self.schedule.group_size, self.schedule.bits) for _ in rids]
        batch = self.implementation.merge(empty)
        batch.prepare(right_padding=[width - r.prompt_len for r in requests])
        keys, values = [], []
        for r in requests:
            k, v = self.draw(r.id, r.prompt_len)
            pad_k, pad_v = self.kv.padding(width - r.prompt_len)
            keys.append(mx.concatenate([k, pad_k], axis=2))
            values.append(mx.concatenate([v, pad_v], axis=2))
        batch.update_and_fetch(mx.concatenate(keys), mx.concatenate(values))
        batch.finalize()
        return [batch]


class SoloCaches:
    """Every request alone, in mlx-lm's caches, fed the same synthetic tokens
    and the same calls the replay recorded."""

    def __init__(self, schedule, kv: SyntheticKV):
        self.schedule = schedule
        self.kv = kv
        self.solo: Dict[str, SoloCache] = {}
        self.written: Dict[str, int] = {}

    def draw(self, rid, n):
        return self.kv.draw(self.written, self.schedule.requests[rid], n)

    def apply(self, calls_at: Dict[str, list]):
        for rid, calls in calls_at.items():
            request = self.schedule.requests[rid]
            for call in calls:
                if call.op == "prefill":
                    self.solo[rid] = SoloCache.prefilled(
                        request, self.schedule.bits, self.schedule.group_size,
                        lambda n, rid=rid: self.draw(rid, n), call.n,
                    )
                elif call.op == "append":
                    self.solo[rid].append(*self.draw(rid, call.n))
                else:
                    self.solo[rid].trim(call.n)


class L1Run:
    """One schedule in progress: the replay, the solo caches and the evidence.

    ``advance`` takes more events of the same schedule, so a generator can
    grow a schedule one event at a time and see each event checked.
    """

    def __init__(self, schedule, implementation: Implementation):
        self.implementation = implementation
        self.kv = SyntheticKV(schedule.kv_heads, schedule.head_dim, schedule.dtype)
        self.backend = SyntheticBackend(implementation, schedule, self.kv)
        self.replay = Replay(schedule, self.backend)
        self.backend.replay = self.replay
        self.solo = SoloCaches(schedule, self.kv)
        self.result = ScheduleResult(schedule.name, "L1", implementation.name, path=schedule.path)
        for rid in schedule.requests:
            self.result.row(rid)
        self.running = True
        self.seconds = 0.0
        self.calls_before = dict(implementation.calls)

    def advance(self, events) -> bool:
        """Apply and check ``events``; False once the run has stopped."""
        start = time.perf_counter()
        self.result.event_kinds += [e.kind for e in events]
        if self.running:
            self.running = drive(self.result, self.replay, events, self.check)
        self.seconds += time.perf_counter() - start
        return self.running

    def check(self, event):
        self.solo.apply(self.replay.calls_at(event.index))
        check_event(self.replay, self.backend, self.solo, self.result, event)

    def finish(self) -> ScheduleResult:
        result = self.result
        result.seconds = self.seconds
        result.members = self.implementation.calls_since(self.calls_before)
        return result


def run_l1(schedule, implementation: Implementation) -> ScheduleResult:
    run = L1Run(schedule, implementation)
    missing = implementation.missing(schedule.needs)
    if missing:
        run.result.event_kinds = [e.kind for e in schedule.events]
        run.result.stop(NOT_SUPPORTED, f"needs {', '.join(missing)}")
        return run.finish()
    run.advance(schedule.events)
    return run.finish()


class ByteChecks:
    """The byte comparisons of one event, evaluated together in one go."""

    def __init__(self, result: ScheduleResult, at: int):
        self.result, self.at = result, at
        self.jobs = []  # (request, (expected, actual, prefix, where), comparisons it counts for)

    def triples(self, rid, expected, actual, name, where):
        job = triple_job(expected, actual, name, **where)
        if isinstance(job, Divergence):
            self.result.note(self.at, "layout", [rid], 1, [job])
        else:
            self.jobs.append((rid, job, 1))

    def named(self, rid, expected, actual, prefix, where, made=1):
        self.jobs.append((rid, (expected, actual, prefix, where), made))

    def flush(self):
        found = compare_all([job for _, job, _ in self.jobs])
        for (rid, _, made), divergences in zip(self.jobs, found):
            self.result.note(self.at, "bytes", [rid], made, divergences)
        self.jobs = []


def check_event(replay: Replay, backend: SyntheticBackend, solo: SoloCaches, result: ScheduleResult, event):
    """Every check after one event, each noting the comparisons it made."""
    label, at = event.describe(), event.index
    note = result.note
    check_sources(replay, backend, result, event)
    checks = ByteChecks(result, at)
    for rid, alone in replay.preempted.items():
        expected = solo.solo[rid].cache
        # An extracted row holds the implementation's bytes; a waiting row holds mlx-lm's own.
        made = 1 if rid in replay.extracted else 0
        note(at, "offset", [rid], made, [] if alone.cache.offset == expected.offset else [
            Divergence("offset", label, rid, expected=expected.offset, actual=alone.cache.offset)])
        checks.named(rid, layer_bytes(expected), layer_bytes(alone.cache), "extracted.",
                     dict(event=label, request=rid), made)
    batch = replay.layers[0] if replay.layers else None
    if batch is None:
        checks.flush()
        return
    before = owned_arrays(batch)
    size = batch.size()
    offsets = _ints(batch.offset)
    pads = _ints(batch.left_padding)
    rows = replay.rows
    if len(offsets) != len(rows) or len(pads) != len(rows):
        note(at, "layout", rows, 1, [Divergence("layout", label, detail=f"offset has {len(offsets)} and "
                                                 f"left_padding {len(pads)} entries for {len(rows)} rows")])
        return
    triples = _state_triples(batch.state)
    if triples is None:
        note(at, "layout", rows, 1, [Divergence("layout", label, tensor="state", actual=_kind(batch.state),
                                                 detail="state must begin with the key and value triples")])
        return
    note(at, "shared_padding", rows, 1,
         [Divergence("shared_padding", label, detail=f"every row has >= {min(pads)} pad columns")]
         if min(pads) > 0 else [])
    fetched = None
    if backend.fetched is not None and backend.fetched[0] == replay.version:
        fetched = _state_triples(backend.fetched[1])
    pad_slices = []
    for i, rid in enumerate(rows):
        expected_cache = solo.solo[rid].cache
        where = dict(event=label, request=rid)
        if not hasattr(expected_cache, "bits"):
            note(at, "layout", [rid], 1, [Divergence("layout", detail="an unquantized row is in the batch", **where)])
            continue
        n = expected_cache.offset
        note(at, "offset", [rid], 1,
             [Divergence("offset", expected=n, actual=offsets[i], **where)] if offsets[i] != n else [])
        if size - pads[i] != n:
            note(at, "left_padding", [rid], 1, [Divergence("left_padding", expected=size - n, actual=pads[i],
                                                           detail=f"size() is {size}", **where)])
            continue  # the row's columns are unknown: bytes would only echo this
        note(at, "left_padding", [rid], 1)
        lp = pads[i]
        expected = {name: _solo_tokens(expected_cache, name) for name in ("keys", "values")}
        for name, triple in triples.items():
            checks.triples(rid, expected[name], batch_row(triple, i, lp, size), f"batch.{name}", where)
            pad_slices += [(rid, where, f"batch.{name}.{part}", lp, x[i : i + 1, :, :lp])
                           for part, x in zip(("packed", "scales", "biases"), triple)]
            if fetched is not None:
                checks.triples(rid, expected[name], batch_row(fetched[name], i, lp, size), f"fetched.{name}", where)
        check_extract(batch, i, expected_cache, result, checks, where)
    checks.flush()
    check_pad(pad_slices, result, at)
    if any(x is not y for x, y in zip(before, owned_arrays(batch))):
        note(at, "extract", rows, 0, [Divergence("extract", label, detail="extract changed the batch")])
    check_nbytes(batch, triples, result, at, rows, label)
    check_mask(batch, rows, size, pads, result, event)


def check_pad(pad_slices, result, at):
    """Hygiene: pad columns hold zeros (one evaluation for all rows)."""
    for (rid, where, tensor, lp, _), bits in zip(pad_slices, raw_many([p[-1] for p in pad_slices])):
        nonzero = np.flatnonzero(bits)
        result.note(at, "pad", [rid], 1, [] if not nonzero.size else [Divergence(
            "pad", tensor=tensor, index=int(nonzero[0]), expected=0, actual=int(bits.reshape(-1)[nonzero[0]]),
            detail=f"pad columns [0, {lp})", **where)])


def check_nbytes(batch, triples, result, at, rows, label):
    """``nbytes`` counts at least the bytes the rows' own columns occupy."""
    live = sum(x.nbytes for triple in triples.values() for x in triple)
    held = batch.nbytes
    ok = isinstance(held, int) and not isinstance(held, bool) and held >= live
    result.note(at, "nbytes", rows, 1, [] if ok else [Divergence(
        "nbytes", label, expected=f">= {live}", actual=held, detail="bytes of the state's arrays")])


def check_extract(batch, i, solo, result, checks: ByteChecks, where):
    extracted = batch.extract(i)
    rid, at = where["request"], checks.at
    offset = getattr(extracted, "offset", None)
    if offset != solo.offset:
        result.note(at, "extract", [rid], 1, [Divergence("extract", expected=solo.offset, actual=offset,
                                                          detail="offset of the extracted cache", **where)])
        return
    found = []
    if (getattr(extracted, "bits", None), getattr(extracted, "group_size", None)) != (solo.bits, solo.group_size):
        found.append(Divergence("extract", expected=(solo.bits, solo.group_size),
                                actual=(getattr(extracted, "bits", None), getattr(extracted, "group_size", None)),
                                detail="bits, group_size", **where))
    result.note(at, "extract", [rid], 1, found)
    for name in ("keys", "values"):
        checks.triples(rid, _solo_tokens(solo, name), _solo_tokens(extracted, name), f"extracted.{name}", where)
    shared = shared_memory(owned_arrays(extracted), owned_arrays(batch))
    result.note(at, "alias", [rid], 1, [] if shared is None else [
        Divergence("alias", tensor="extract", actual=shared[2],
                   detail=f"{describe_shared(shared)}: keeps {shared[2]} bytes of batch buffer alive", **where)])


def check_sources(replay: Replay, backend: SyntheticBackend, result: ScheduleResult, event):
    """merge/extend left their sources' bytes unchanged (parity); merge keeps
    none of their buffers (hygiene)."""
    label, at = event.describe(), event.index
    batch_arrays = owned_arrays(replay.layers[0]) if replay.layers else []
    rows = replay.rows or list(replay.running())
    for member, caches, before in backend.sources:
        after = [x for c in caches for x in owned_arrays(c)]
        same = len(after) == len(before) and all(x is y for x, y in zip(before, after))
        if not same:  # the source holds other arrays now: are their bytes the same?
            named = lambda arrays: {str(k): x for k, x in enumerate(arrays)}
            same = not compare_all([(named(before), named(after), "", {"event": label})])[0]
        result.note(at, "source", rows, 1,
                    [] if same else [Divergence("source", label, detail=f"{member} modified its source")])
        if member == "merge":
            shared = shared_memory(batch_arrays, after)
            result.note(at, "alias", rows, 1, [] if shared is None else [
                Divergence("alias", label, tensor="merge", actual=shared[2],
                           detail=f"{describe_shared(shared)}: keeps {shared[2]} bytes of source buffer alive")])


def check_mask(batch, rows, size, pads, result, event):
    label = event.describe()
    for N in MASK_WIDTHS:
        mask = _boolean_mask(batch.make_mask(N, return_array=True), len(rows), N, size + N)
        columns = np.arange(size + N)[None, :]
        queries = np.arange(N)[:, None]
        for i, rid in enumerate(rows):
            expected = (columns >= pads[i]) & (columns <= size + queries)
            found = []
            if mask is None or not np.array_equal(mask[i], expected):
                got = None if mask is None else mask[i]
                index = None
                if got is not None and got.shape == expected.shape:
                    index = int(np.flatnonzero(got != expected)[0])
                found.append(Divergence(
                    "mask", label, rid, tensor=f"make_mask({N})", index=index,
                    expected=None if index is None else bool(expected.reshape(-1)[index]),
                    actual=None if index is None else bool(got.reshape(-1)[index]),
                    detail=f"row has {pads[i]} pad columns of {size}"))
            result.note(event.index, "mask", [rid], 1, found)


def _boolean_mask(mask, B, N, S):
    """Normalise a mask to bool [B, N, S]: None means attend everywhere,
    "causal" means causal, additive masks attend where they are 0."""
    if mask is None:
        return np.ones((B, N, S), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            return None
        columns, queries = np.arange(S)[None, :], np.arange(N)[:, None]
        return np.broadcast_to(columns <= S - N + queries, (B, N, S))
    if not isinstance(mask, mx.array):
        return None
    if mask.dtype == mx.bool_:
        mask = raw(mask).astype(bool)
    else:
        mask = np.array(mask.astype(mx.float32)) == 0
    if mask.ndim == 4:  # [B, heads, N, S]: one mask for every head
        mask = mask[:, 0]
    try:
        return np.broadcast_to(mask, (B, N, S))
    except ValueError:
        return None


def _state_triples(state):
    """{"keys": triple, "values": triple} from a state or a fetch result, or None."""
    try:
        keys, values = state[0], state[1]
    except (TypeError, IndexError, KeyError):
        return None
    for triple in (keys, values):
        if not isinstance(triple, (tuple, list)) or len(triple) != 3 or not all(
                isinstance(x, mx.array) and x.ndim == 4 for x in triple):
            return None
    return {"keys": tuple(keys), "values": tuple(values)}


def _kind(value):
    return type(value).__name__


def _solo_tokens(cache, name):
    triple = getattr(cache, name, None)
    if triple is None:
        return None
    return tuple(x[..., : cache.offset, :] for x in triple)


def _ints(x) -> List[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, mx.array) else x)]
