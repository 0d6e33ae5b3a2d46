"""L1, cache bytes: replay a schedule on the implementation and, after every
event, hold every row against the same request run alone through mlx-lm.

Checked after each event, per row ``i`` of request ``r`` (``lp`` its left
padding, ``size`` the batch width):

* ``offset``: ``offset[i]`` (the row's RoPE position) equals the solo offset;
* ``left_padding``: ``size - lp`` equals the solo offset;
* ``bytes``: keys and values, packed, scales and biases, on ``[lp, size)`` of
  the batch state and of what ``update_and_fetch`` returned equal the solo
  cache on ``[0, offset)``, dtype and shape included;
* ``pad``: columns ``[0, lp)`` are zero;
* ``extract``: ``extract(i)`` is a solo cache equal to the oracle, owning its
  memory, and leaves the batch unchanged;
* ``mask``: ``make_mask(N)`` hides exactly the padding and the future;
* ``shared_padding``: no column is padding in every row;
* ``source``: merge/extend left their sources unchanged and unaliased.
"""

import time
from typing import Dict, List

import mlx.core as mx
import numpy as np

from kvparity.impl.adapter import Implementation
from kvparity.impl.cache_replay import CacheReplay
from kvparity.oracle.parity import (
    any_shared,
    compare_batch_row,
    compare_named,
    compare_triples,
    digest,
    owned_arrays,
    raw,
)
from kvparity.oracle.solo import layer_bytes
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV
from kvparity.reports.policy import row_tier
from kvparity.reports.results import FAIL, NOT_SUPPORTED, Divergence, ScheduleResult

MASK_WIDTHS = (1, 3)


def run_l1(schedule, implementation: Implementation) -> ScheduleResult:
    run = L1Run(schedule, implementation)
    run.advance(schedule)
    return run.finish()


class L1Run:
    """One schedule in progress: the replay, the oracle and what was found.

    ``advance`` takes the same schedule grown by more events, so a generator
    can extend a schedule one event at a time and see each event checked.
    """

    def __init__(self, schedule, implementation: Implementation):
        self.implementation = implementation
        self.result = ScheduleResult(
            schedule.name, "L1", implementation.name, 0, path=schedule.path
        )
        self.kv = SyntheticKV(schedule.kv_heads, schedule.head_dim, schedule.dtype)
        self.replay = CacheReplay(implementation, schedule, self.kv)
        self.oracle = Oracle(schedule, self.kv)
        self.stopped = False
        self.applied = 0  # events of the schedule replayed so far
        self.seconds = 0.0

    def advance(self, schedule) -> List[Divergence]:
        """Apply the events of ``schedule`` not applied yet; return what they broke."""
        start = time.perf_counter()
        result = self.result
        self.replay.schedule = self.oracle.schedule = schedule
        result.events, result.path = len(schedule.events), schedule.path
        for rid in schedule.requests:
            result.row(rid)
        missing = [c for c in schedule.needs if not self.implementation.supports(c)]
        if missing and not self.stopped:
            self.not_supported(f"needs {', '.join(missing)}")
        found = []
        for event in schedule.events[self.applied :]:
            if self.stopped:
                break
            found += self.apply(event)
            self.applied += 1
        self.seconds += time.perf_counter() - start
        return found

    def not_supported(self, reason):
        self.result.verdict, self.result.reason = NOT_SUPPORTED, reason
        for row in self.result.rows:
            row.verdict = NOT_SUPPORTED
        self.stopped = True

    def apply(self, event) -> List[Divergence]:
        result, replay = self.result, self.replay
        try:
            replay.apply(event)
        except NotImplementedError as error:
            self.not_supported(f"event {event.describe()}: {error}")
            return []
        except Exception as error:  # the implementation under test broke
            result.reason = f"event {event.describe()} raised {type(error).__name__}: {error}"
            found = [
                Divergence("raised", event.describe(), rid, detail=result.reason)
                for rid in replay.rows or list(replay.schedule.requests)
            ]
            self.record(found, replay.rows)
            self.stopped = True
            return found
        self.oracle.apply(event.index)
        found = check_event(replay, self.oracle, event.describe())
        self.record(found, replay.rows)
        for rid in replay.running():
            result.row(rid).checks += 1
        return found

    def record(self, found, rows):
        for divergence in found:
            if divergence.request is not None:
                self.result.row(divergence.request).divergences.append(divergence)
            else:  # a batch-wide divergence belongs to every row in it
                for rid in rows:
                    self.result.row(rid).divergences.append(divergence)

    def finish(self) -> ScheduleResult:
        result = self.result
        result.seconds = self.seconds
        if result.verdict == NOT_SUPPORTED:
            return result
        for row in result.rows:
            if row.divergences:
                row.verdict = FAIL
            row.tier = row_tier(row)
        if result.divergences or result.reason:
            result.verdict = FAIL
        return result


class Oracle:
    """Every request alone, in mlx-lm's caches, fed the same synthetic tokens."""

    def __init__(self, schedule, kv: SyntheticKV):
        self.schedule = schedule
        self.kv = kv
        self.solo: Dict[str, SoloCache] = {}
        self.written: Dict[str, int] = {}

    def draw(self, rid, n):
        return self.kv.draw(self.written, self.schedule.requests[rid], n)

    def apply(self, event_index: int):
        for rid, calls in self.schedule.calls_at(event_index).items():
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


def check_event(replay: CacheReplay, oracle: Oracle, event: str) -> List[Divergence]:
    found = check_sources(replay, event)
    for prefix, alone in (("extracted.", replay.preempted), ("waiting.", replay.waiting)):
        for rid, solo in alone.items():
            expected = oracle.solo[rid].cache
            if solo.cache.offset != expected.offset:
                found.append(Divergence("offset", event, rid, expected=expected.offset, actual=solo.cache.offset))
            found += compare_named(layer_bytes(expected), layer_bytes(solo.cache), prefix, event=event, request=rid)
    batch = replay.batch
    if batch is None:
        return found
    before = digest(owned_arrays(batch))
    size = batch.size()
    offsets = _ints(batch.offset)
    pads = _ints(batch.left_padding)
    keys, values = batch.state[0], batch.state[1]
    if pads and min(pads) > 0:
        found.append(
            Divergence("shared_padding", event, detail=f"every row has >= {min(pads)} pad columns")
        )
    for i, rid in enumerate(replay.rows):
        solo = oracle.solo[rid].cache
        where = dict(event=event, request=rid)
        if not hasattr(solo, "bits"):
            found.append(Divergence("unquantized_row", **where))
            continue
        n = solo.offset
        if offsets[i] != n:
            found.append(Divergence("offset", expected=n, actual=offsets[i], **where))
        if size - pads[i] != n:
            found.append(
                Divergence(
                    "left_padding",
                    expected=size - n,
                    actual=pads[i],
                    detail=f"size() is {size}",
                    **where,
                )
            )
            continue  # the row's columns are unknown: bytes would only echo this
        lp = pads[i]
        expected = {name: _solo_tokens(solo, name) for name in ("keys", "values")}
        state = {"keys": keys, "values": values}
        found += compare_batch_row(state, i, lp, size, expected, "batch.", **where)
        for name, got in state.items():
            found += _check_zero_pad(got, i, lp, name, where)
        if replay.last_fetch is not None:
            fetched = dict(zip(("keys", "values"), replay.last_fetch))
            found += compare_batch_row(fetched, i, lp, size, expected, "fetched.", **where)
        found += check_extract(batch, i, solo, where)
    if digest(owned_arrays(batch)) != before:
        found.append(Divergence("extract_modified_batch", event))
    found += check_mask(batch, replay.rows, size, pads, event)
    return found


def check_extract(batch, i, solo, where) -> List[Divergence]:
    extracted = batch.extract(i)
    found = []
    if getattr(extracted, "offset", None) != solo.offset:
        found.append(
            Divergence("extract", expected=solo.offset, actual=getattr(extracted, "offset", None),
                       detail="offset of the extracted cache", **where)
        )
        return found
    if (extracted.bits, extracted.group_size) != (solo.bits, solo.group_size):
        found.append(
            Divergence("extract", expected=(solo.bits, solo.group_size),
                       actual=(extracted.bits, extracted.group_size), detail="bits, group_size", **where)
        )
    for name in ("keys", "values"):
        found += compare_triples(
            _solo_tokens(solo, name), _solo_tokens(extracted, name), f"extracted.{name}", **where
        )
    shared = any_shared(owned_arrays(extracted), owned_arrays(batch))
    if shared:
        found.append(Divergence("alias", detail=f"extract: {shared}", **where))
    return found


def check_sources(replay: CacheReplay, event: str) -> List[Divergence]:
    found = []
    batch_arrays = owned_arrays(replay.batch) if replay.batch is not None else []
    for what, caches, before in replay.sources:
        arrays = [x for c in caches for x in owned_arrays(c)]
        if digest(arrays) != before:
            found.append(Divergence("source", event, detail=f"{what} modified its source"))
        shared = any_shared(batch_arrays, arrays)
        if shared and what == "merge":
            found.append(Divergence("alias", event, detail=f"{what}: {shared}"))
    return found


def check_mask(batch, rows, size, pads, event) -> List[Divergence]:
    found = []
    for N in MASK_WIDTHS:
        mask = _boolean_mask(batch.make_mask(N, return_array=True), len(rows), N, size + N)
        columns = np.arange(size + N)[None, :]
        queries = np.arange(N)[:, None]
        for i, rid in enumerate(rows):
            expected = (columns >= pads[i]) & (columns <= size + queries)
            if mask is None or not np.array_equal(mask[i], expected):
                got = None if mask is None else mask[i]
                index = None
                if got is not None and got.shape == expected.shape:
                    index = int(np.flatnonzero(got != expected)[0])
                found.append(
                    Divergence(
                        "mask",
                        event,
                        rid,
                        tensor=f"make_mask({N})",
                        index=index,
                        expected=None if index is None else bool(expected.reshape(-1)[index]),
                        actual=None if index is None else bool(got.reshape(-1)[index]),
                        detail=f"row has {pads[i]} pad columns of {size}",
                    )
                )
    return found


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


def _check_zero_pad(triple, i, lp, name, where) -> List[Divergence]:
    found = []
    if lp == 0:
        return found
    for part, x in zip(("packed", "scales", "biases"), triple):
        pad = raw(x[i : i + 1, :, :lp])
        nonzero = np.flatnonzero(pad)
        if nonzero.size:
            found.append(
                Divergence("pad", tensor=f"batch.{name}.{part}", index=int(nonzero[0]),
                           expected=0, actual=int(pad.reshape(-1)[nonzero[0]]),
                           detail=f"pad columns [0, {lp})", **where)
            )
    return found


def _solo_tokens(cache, name):
    triple = getattr(cache, name)
    if triple is None:
        return None
    return tuple(x[..., : cache.offset, :] for x in triple)


def _ints(x) -> List[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, mx.array) else x)]
