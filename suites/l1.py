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
from collections import OrderedDict
from typing import Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import (Reading, arrays_in, describe_shared, handles, owned_arrays,
                                    shared_memory_later, start_evaluating)
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV
from kvparity.suites.adapter import Implementation
from kvparity.suites.compare import (TRIPLE, Divergence, a_triple, compare_later, in_words, left_padding_divergence,
                                     state_triples, triple_job)
from kvparity.suites.checks import (ALIAS, BYTES, EXTRACT, LAYOUT, LEFT_PADDING, MASK, NBYTES, OFFSET, PAD,
                                    SHARED_PADDING, SOURCE)
from kvparity.suites.evidence import NOT_SUPPORTED, ScheduleResult
from kvparity.suites.replay import Replay, drive

MASK_WIDTHS = (1, 3)


class SoloState:
    """One request alone after some of its calls: mlx-lm's cache, never
    written (a further call works on a fork), and its bytes once read."""

    __slots__ = ("key", "solo", "layer")

    def __init__(self, key: tuple, solo: SoloCache):
        self.key, self.solo = key, solo
        self.layer = None  # its parts on [0, offset), once read

    def parts(self, reading: Reading) -> dict:
        """The cache on ``[0, offset)`` as ``_layer_parts`` gives it, taken
        into ``reading`` the first time and the same parts after."""
        if self.layer is None:
            self.layer = _layer_parts(reading, self.solo.cache)
        return self.layer

    def keep(self):
        """The parts read, evaluated, no longer holding their reading; parts
        of a reading that was never evaluated (its checks raised) are
        dropped, to be read again."""
        if self.layer is not None:
            evaluated = all(part.evaluated for part in self.layer.values())
            self.layer = {name: part.kept() for name, part in self.layer.items()} if evaluated else None


class SoloStates:
    """Requests alone in mlx-lm's caches, each state computed once.

    A state is named by all that made it: the synthetic stream, the request,
    the quantization and the request's calls so far, each at its place in
    the stream. Generated schedules repeat requests and calls, so most
    states were computed before: a joining request's merge source and its
    oracle are one computation, and so are the same calls in two schedules.
    Kept caches are never written: a further call works on a fork, and so
    does every holder that may write (the implementation's merge sources).
    """

    def __init__(self, size: int = 256):
        self.size = size
        self.kept: "OrderedDict[tuple, SoloState]" = OrderedDict()

    def prefilled(self, kv: SyntheticKV, written: Dict[str, int], request, bits: int, group_size: int,
                  n: int) -> SoloState:
        """``request``'s first ``n`` prompt tokens of its stream, drawn from
        ``written`` on (which advances by ``n``), in generate_step's chunks."""
        start = kv.advance(written, request, n)
        key = (kv.identity, request.id, request.seed, request.prefill_step_size, request.quantized_kv_start,
               bits, group_size, start, n)
        drawn = {request.id: start}
        return self._state(key, lambda: SoloCache.prefilled(request, bits, group_size,
                                                            lambda m: kv.draw(drawn, request, m), n))

    def after(self, state: SoloState, kv: SyntheticKV, written: Dict[str, int], request, op: str,
              n: int) -> SoloState:
        """``state`` after one more call: ``append`` the next ``n`` tokens
        from ``written`` (which advances), or ``trim`` ``n``."""
        start = kv.advance(written, request, n if op == "append" else 0)

        def compute():
            solo = state.solo.fork()
            if op == "append":
                solo.append(*kv.tokens(request.id, start, n, seed=request.seed))
            else:
                solo.trim(n)
            return solo

        return self._state(state.key + ((op, start, n),), compute)

    def _state(self, key: tuple, compute) -> SoloState:
        state = self.kept.pop(key, None)
        if state is None:
            state = SoloState(key, compute())
            start_evaluating(owned_arrays(state.solo.cache))
            if len(self.kept) >= self.size:
                self.kept.popitem(last=False)
        self.kept[key] = state
        return state


SOLO_STATES = SoloStates()


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
        # Handles, not the arrays: a member may write a source's arrays in place.
        self.sources.append((member, caches, handles([x for c in caches for x in owned_arrays(c)])))

    def prefill(self, rid, j):
        request = self.schedule.requests[rid]
        return SOLO_STATES.prefilled(self.kv, self.written, request, self.schedule.bits, self.schedule.group_size,
                                     request.prompt_len).solo.fork()

    def resume(self, rid, caches):
        start = self.schedule.requests[rid].quantized_kv_start
        return SoloCache(self.schedule.bits, self.schedule.group_size, start, caches[0])

    def forward(self, layers, rows, n, calls):
        keys, values = zip(*(self.draw(rid, n) for rid in rows))
        fetched = layers[0].update_and_fetch(mx.concatenate(keys), mx.concatenate(values))
        self.fetched = (self.replay.version, fetched)

    def computed(self) -> list:
        """Arrays the implementation computed in this event that the checks
        read, taken without calling a member: what ``update_and_fetch``
        returned, and the batch's offsets and left padding."""
        arrays = arrays_in(self.fetched[1]) if self.fetched is not None else []
        if self.replay.layers:
            batch = self.replay.layers[0]
            arrays += arrays_in((getattr(batch, "offset", None), getattr(batch, "left_padding", None)))
        return arrays

    def append_alone(self, rid, solo, n, j):
        solo.append(*self.draw(rid, n))

    def batched_prefill(self, rids):
        """Several prompts in one right-padded call: prepare/finalize."""
        requests = [self.schedule.requests[rid] for rid in rids]
        width = max(r.prompt_len for r in requests)
        empty = [QuantizedKVCache(self.schedule.group_size, self.schedule.bits) for _ in rids]
        batch = self.implementation.batch_class.merge(empty)
        batch.prepare(right_padding=[width - r.prompt_len for r in requests])
        keys, values = [], []
        for r in requests:
            k, v = self.draw(r.id, r.prompt_len)
            pad_k, pad_v = self.kv.padding(width - r.prompt_len)
            keys.append(mx.concatenate([k, pad_k], axis=2))
            values.append(mx.concatenate([v, pad_v], axis=2))
        start_evaluating(arrays_in(batch.update_and_fetch(mx.concatenate(keys), mx.concatenate(values))))
        batch.finalize()
        return [batch]


class SoloCaches:
    """Every request alone, in mlx-lm's caches, fed the same synthetic tokens
    and the same calls the replay recorded."""

    def __init__(self, schedule, kv: SyntheticKV):
        self.schedule = schedule
        self.kv = kv
        self.states: Dict[str, SoloState] = {}
        self.written: Dict[str, int] = {}
        self.taken: List[SoloState] = []  # states first read at this event

    def cache(self, rid):
        return self.states[rid].solo.cache

    def expected(self, rid, reading: Reading) -> dict:
        """The row's cache on ``[0, offset)`` as ``_layer_parts`` gives it,
        taken into ``reading``; read again only after a call changed the row."""
        state = self.states[rid]
        if state.layer is None:
            self.taken.append(state)
        return state.parts(reading)

    def keep(self):
        """After an event's checks: what they read stays, not their reading."""
        taken, self.taken = self.taken, []
        for state in taken:
            state.keep()

    def apply(self, calls_at: Dict[str, list]):
        bits, group_size = self.schedule.bits, self.schedule.group_size
        for rid, calls in calls_at.items():
            request = self.schedule.requests[rid]
            for call in calls:
                if call.op == "prefill":
                    state = SOLO_STATES.prefilled(self.kv, self.written, request, bits, group_size, call.n)
                else:
                    state = SOLO_STATES.after(self.states[rid], self.kv, self.written, request, call.op, call.n)
                self.states[rid] = state


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
            with self.implementation.watching():
                self.running = drive(self.result, self.replay, events, self.check)
        self.seconds += time.perf_counter() - start
        return self.running

    def check(self, event):
        # The implementation's kernels run while mlx-lm's graph is built, and
        # mlx-lm's while the checks build theirs (two cores: Python and MLX).
        start_evaluating(self.backend.computed())
        self.solo.apply(self.replay.calls_at(event.index))
        try:
            check_event(self.replay, self.backend, self.solo, self.result, event)
        finally:
            self.solo.keep()

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


class EventChecks:
    """The checks of one event. Every array they read is taken when the
    check is made and evaluated with all the others in one go at the end;
    notes are queued in the order the checks are made and written then, so
    the evidence reads as if each check had been noted at once."""

    def __init__(self, result: ScheduleResult, at: int):
        self.result, self.at = result, at
        self.reading = Reading()
        self.queue = []  # what to note, in order: (args of note) or a function that notes
        self.jobs = []  # (request, (expected, actual, prefix, where), comparisons it counts for)

    def note(self, *args):
        self.queue.append(args)

    def later(self, fn):
        self.queue.append(fn)

    def triples(self, rid, expected, actual, name, where):
        job = triple_job(expected, actual, name, **where)
        if isinstance(job, Divergence):
            self.note(self.at, LAYOUT, [rid], 1, [job])
        else:
            self.jobs.append((rid, job, 1))

    def named(self, rid, expected, actual, prefix, where, made=1):
        self.jobs.append((rid, (expected, actual, prefix, where), made))

    def flush(self):
        """The byte comparisons queued so far are noted here, in order."""
        jobs, self.jobs = self.jobs, []
        compared = compare_later(self.reading, [job for _, job, _ in jobs])
        self.later(lambda: self.note_per_row(
            BYTES, ((rid, made, divergences) for (rid, _, made), divergences in zip(jobs, compared()))))

    def note_per_row(self, check, entries):
        """``check`` noted once per request; ``entries``: (request,
        comparisons, divergences), several per request."""
        rows = {}  # request -> [comparisons, divergences]
        for rid, made, found in entries:
            row = rows.setdefault(rid, [0, []])
            row[0] += made
            row[1] += found
        for rid, (made, found) in rows.items():
            self.result.note(self.at, check, [rid], made, found)

    def done(self):
        self.reading.evaluate()
        queue, self.queue = self.queue, []
        for item in queue:
            if callable(item):
                item()
            else:
                self.result.note(*item)


def check_event(replay: Replay, backend: SyntheticBackend, solo: SoloCaches, result: ScheduleResult, event):
    """Every check after one event, each noting the comparisons it made."""
    checks = EventChecks(result, event.index)
    try:
        _check_event(replay, backend, solo, checks, event)
    except BaseException:
        # What was checked before the implementation raised stays noted.
        try:
            checks.done()
        except Exception:
            pass  # the implementation's error is what the run reports
        raise
    checks.done()


def _check_event(replay: Replay, backend: SyntheticBackend, solo: SoloCaches, checks: EventChecks, event):
    label, at = event.label, event.index
    note = checks.note
    batch_known = {}  # the batch's arrays as taken before any extract
    check_sources(replay, backend, checks, event, batch_known)
    for rid, alone in replay.preempted.items():
        expected = solo.cache(rid)
        # An extracted row holds the implementation's bytes; a waiting row holds mlx-lm's own.
        made = 1 if rid in replay.extracted else 0
        note(at, OFFSET, [rid], made, [] if alone.cache.offset == expected.offset else [
            Divergence(OFFSET, label, rid, expected=expected.offset, actual=alone.cache.offset)])
        if made and hasattr(expected, "bits") and not alone.quantized:
            # What extract returned is not quantized: said once, not per missing array.
            unquantized = _not_triples(alone.cache, "extract", _triples(solo.expected(rid, checks.reading)))
            note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, label, rid, tensor="extracted", detail=unquantized)])
            continue
        checks.named(rid, solo.expected(rid, checks.reading), _layer_parts(checks.reading, alone.cache),
                     "extracted.", dict(event=label, request=rid), made)
    batch = replay.layers[0] if replay.layers else None
    if batch is None:
        checks.flush()
        return
    before = checks.reading.take(owned_arrays(batch), batch_known)
    size = batch.size()
    offset, left_padding = batch.offset, batch.left_padding
    mx.eval([x for x in (offset, left_padding) if isinstance(x, mx.array)])  # both in one evaluation
    offsets = _ints(offset)
    pads = _ints(left_padding)
    rows = replay.rows
    if len(offsets) != len(rows) or len(pads) != len(rows):
        note(at, LAYOUT, rows, 1, [Divergence(LAYOUT, label, detail=f"offset has {len(offsets)} and "
                                                 f"left_padding {len(pads)} entries for {len(rows)} rows")])
        return
    triples = state_triples(batch.state)
    if triples is None:
        note(at, LAYOUT, rows, 1, [Divergence(
            LAYOUT, label, tensor="state", detail=f"state returned {in_words(batch.state)}, expected the keys' "
                                                    "and the values' (packed, scales, biases) triples first")])
        return
    note(at, SHARED_PADDING, rows, 1,
         [Divergence(SHARED_PADDING, label, detail=f"every row has >= {min(pads)} pad columns")]
         if min(pads) > 0 else [])
    fetched = None
    if backend.fetched is not None and backend.fetched[0] == replay.version:
        fetched = state_triples(backend.fetched[1])
    pad_slices = []
    # Every array is read once per event: the batch before any extract (a later
    # in-place change is caught below), what update_and_fetch returned, and each
    # oracle row while its cache is untouched.
    fetched_known = {}
    reading = checks.reading
    for i, rid in enumerate(rows):
        expected_cache = solo.cache(rid)
        where = dict(event=label, request=rid)
        if not hasattr(expected_cache, "bits"):
            note(at, LAYOUT, [rid], 1, [Divergence(LAYOUT, detail="an unquantized row is in the batch", **where)])
            continue
        n = expected_cache.offset
        note(at, OFFSET, [rid], 1,
             [Divergence(OFFSET, expected=n, actual=offsets[i], **where)] if offsets[i] != n else [])
        if size - pads[i] != n:
            note(at, LEFT_PADDING, [rid], 1, [left_padding_divergence(i, n, size, pads[i], **where)])
            continue  # the row's columns are unknown: bytes would only echo this
        note(at, LEFT_PADDING, [rid], 1)
        lp = pads[i]
        expected = _triples(solo.expected(rid, reading))
        row = (slice(i, i + 1), slice(None))
        for name, triple in triples.items():
            checks.triples(rid, expected[name], _parts(reading, triple, row + (slice(lp, size),), batch_known),
                           f"batch.{name}", where)
            pad_slices += [(rid, where, f"batch.{name}.{part}", lp, x) for part, x in
                           zip(TRIPLE, _parts(reading, triple, row + (slice(None, lp),), batch_known))]
            if fetched is not None:
                checks.triples(rid, expected[name],
                               _parts(reading, fetched[name], row + (slice(lp, size),), fetched_known),
                               f"fetched.{name}", where)
        check_extract(batch, i, expected_cache, expected, checks, where, batch_known)
    checks.flush()
    check_pad(pad_slices, checks)
    check_unchanged(before, owned_arrays(batch), checks, rows, label)
    check_nbytes(batch, triples, checks, rows, label)
    check_mask(batch, rows, size, pads, checks, event)


def check_pad(pad_slices, checks: EventChecks):
    """Hygiene: pad columns hold zeros."""

    def entries():
        for rid, where, tensor, lp, part in pad_slices:
            # No pad columns (lp == 0): nothing to read, nothing can be non-zero.
            if lp == 0 or not part.bits.any():
                yield rid, 1, []
                continue
            first = int(np.flatnonzero(part.bits)[0])
            yield rid, 1, [Divergence(PAD, tensor=tensor, index=first, expected=0,
                                      actual=int(part.bits.reshape(-1)[first]), detail=f"pad columns [0, {lp})",
                                      **where)]

    checks.later(lambda: checks.note_per_row(PAD, entries()))


def check_nbytes(batch, triples, checks: EventChecks, rows, label):
    """``nbytes`` counts at least the bytes the rows' own columns occupy."""
    live = sum(x.nbytes for triple in triples.values() for x in triple)
    held = batch.nbytes
    ok = isinstance(held, int) and not isinstance(held, bool) and held >= live
    checks.note(checks.at, NBYTES, rows, 1, [] if ok else [Divergence(
        NBYTES, label, expected=f">= {live}", actual=held, detail="bytes of the state's arrays")])


def check_extract(batch, i, solo, expected, checks: EventChecks, where, batch_known):
    """``expected``: the solo row's keys and values triples, already taken;
    ``batch_known``: the batch's arrays as taken before the extracts."""
    extracted = batch.extract(i)
    # Its copies compute while the next rows are checked.
    start_evaluating(arrays_in(tuple(getattr(extracted, name, None) for name in ("keys", "values"))))
    rid, at = where["request"], checks.at
    offset = getattr(extracted, "offset", None)
    if offset != solo.offset:
        checks.note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, expected=solo.offset, actual=offset,
                                                          detail=f"offset of extract({i})", **where)])
        return
    known = {}
    unquantized = _not_triples(extracted, f"extract({i})", expected)
    if unquantized:  # nothing to compare byte for byte: one divergence says what came back
        checks.note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, tensor="extracted", detail=unquantized,
                                                          **where)])
    else:
        bits, group_size = getattr(extracted, "bits", None), getattr(extracted, "group_size", None)
        checks.note(at, EXTRACT, [rid], 1, [] if (bits, group_size) == (solo.bits, solo.group_size) else [
            Divergence(EXTRACT, detail=f"extract({i}) returned a cache of bits {bits}, group_size {group_size}; "
                                         f"the row's are {solo.bits}, {solo.group_size}", **where)])
        for name in ("keys", "values"):
            checks.triples(rid, expected[name], _solo_tokens(checks.reading, extracted, name, known),
                           f"extracted.{name}", where)
    shared = shared_memory_later(checks.reading, owned_arrays(extracted), owned_arrays(batch), known, batch_known)
    checks.later(lambda: _note_alias(checks, at, [rid], shared(), dict(tensor="extract", **where),
                                     "batch buffer"))


def _not_triples(extracted, call: str, expected) -> str:
    """What ``call`` (an extract) returned instead of the row's keys and
    values triples, in words; empty when it returned triples."""
    for name in ("keys", "values"):
        stored = getattr(extracted, name, None)
        if expected[name] is None and stored is None:
            continue
        if not (isinstance(stored, (tuple, list)) and len(stored) == 3):
            return (f"{call} returned {in_words(stored, where_a_triple=True)} as {name}, "
                    f"expected {a_triple(expected[name])}")
    return ""


def check_unchanged(before, after, checks: EventChecks, rows, label):
    """``extract`` left the batch as it was: ``before``, the ticket of its
    arrays taken before the extracts, against ``after`` by bytes (an array
    written in place is still the same object)."""
    changed = [Divergence(EXTRACT, label, detail="extract changed the batch")]
    if len(before) != len(after):
        checks.note(checks.at, EXTRACT, rows, 0, changed)
        return
    reading = checks.reading
    after = reading.take(after)

    def note_changed():
        reading.evaluate()
        if any(not _same_bits(a, b) for a, b in zip(reading[before], reading[after])):
            checks.result.note(checks.at, EXTRACT, rows, 0, changed)

    checks.later(note_changed)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal raw views; two views of one buffer with one layout without reading it."""
    if a.shape != b.shape:
        return False
    same_buffer = a.strides == b.strides and a.__array_interface__["data"] == b.__array_interface__["data"]
    return same_buffer or a.tobytes() == b.tobytes()


def _note_alias(checks, at, rows, shared, where, whose):
    checks.result.note(at, ALIAS, rows, 1, [] if shared is None else [
        Divergence(ALIAS, actual=shared[2],
                   detail=f"{describe_shared(shared)}: keeps {shared[2]} bytes of {whose} alive", **where)])


def check_sources(replay: Replay, backend: SyntheticBackend, checks: EventChecks, event, batch_known):
    """merge/extend left their sources' bytes unchanged (parity); merge keeps
    none of their buffers (hygiene)."""
    label, at = event.label, event.index
    batch_arrays = owned_arrays(replay.layers[0]) if replay.layers else []
    rows = replay.rows or list(replay.running())
    named = lambda arrays: {str(k): x for k, x in enumerate(arrays)}
    for member, caches, before in backend.sources:
        after = [x for c in caches for x in owned_arrays(c)]
        after_known = {}
        # Always by bytes: an array written in place is still the same object.
        compared = compare_later(checks.reading, [(named(before), named(after), "", {"event": label})], after_known)
        checks.later(lambda member=member, compared=compared: checks.result.note(
            at, SOURCE, rows, 1,
            [] if not compared()[0] else [Divergence(SOURCE, label, detail=f"{member} modified its source")]))
        if member == "merge":
            shared = shared_memory_later(checks.reading, batch_arrays, after, batch_known, after_known)
            checks.later(lambda shared=shared: _note_alias(checks, at, rows, shared(),
                                                           dict(event=label, tensor="merge"), "source buffer"))


def check_mask(batch, rows, size, pads, checks: EventChecks, event):
    label = event.label
    for N in MASK_WIDTHS:
        mask = _boolean_mask_later(checks.reading, batch.make_mask(N, return_array=True), len(rows), N, size + N)
        checks.later(lambda N=N, mask=mask: _note_mask(checks, rows, size, pads, label, event.index, N, mask()))


def _note_mask(checks, rows, size, pads, label, at, N, mask):
    columns = np.arange(size + N)[None, :]
    queries = np.arange(N)[:, None]
    # Row i may see column c for query q when c >= pads[i] and c <= size + q.
    expected_rows = (columns[None] >= np.array(pads, dtype=np.int64)[:, None, None]) & (columns <= size + queries)
    equal = None if mask is None else (mask == expected_rows).all(axis=(1, 2))
    for i, rid in enumerate(rows):
        expected = expected_rows[i]
        found = []
        if mask is None or not equal[i]:
            got = None if mask is None else mask[i]
            index = None
            if got is not None and got.shape == expected.shape:
                index = int(np.flatnonzero(got != expected)[0])
            found.append(Divergence(
                MASK, label, rid, tensor=f"make_mask({N})", index=index,
                expected=None if index is None else bool(expected.reshape(-1)[index]),
                actual=None if index is None else bool(got.reshape(-1)[index]),
                detail=f"row has {pads[i]} pad columns of {size}"))
        checks.result.note(at, MASK, [rid], 1, found)


def _boolean_mask_later(reading: Reading, mask, B, N, S):
    """A function giving the mask as bool [B, N, S] once ``reading`` was
    evaluated (its bits are taken now): None means attend everywhere,
    "causal" means causal, additive masks attend where they are 0."""
    if mask is None:
        return lambda: np.ones((B, N, S), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            return lambda: None
        columns, queries = np.arange(S)[None, :], np.arange(N)[:, None]
        return lambda: np.broadcast_to(columns <= S - N + queries, (B, N, S))
    if not isinstance(mask, mx.array):
        return lambda: None
    boolean = mask.dtype == mx.bool_
    ticket = reading.take([mask if boolean else mask.astype(mx.float32)])

    def answer():
        reading.evaluate()
        (bits,) = reading[ticket]
        # Boolean masks attend where true; additive ones where they are 0.
        value = bits.astype(bool) if boolean else bits.view(np.float32) == 0
        if value.ndim == 4:  # [B, heads, N, S]: one mask for every head
            value = value[:, 0]
        try:
            return np.broadcast_to(value, (B, N, S))
        except ValueError:
            return None

    return answer




def _parts(reading: Reading, triple, index, known=None):
    """``x[index]`` of each array, read with the event's other arrays;
    ``known`` collects what was taken, so a second slice of the same arrays
    at the same moment reads them once."""
    return tuple(reading.parts(triple, index, known))


def _layer_parts(reading: Reading, cache) -> dict:
    """``layer_bytes`` of a cache as parts of ``reading`` (sliced by numpy,
    no graph node): {"keys.packed": ..., ...}, or {"keys", "values"} unquantized."""
    index = (Ellipsis, slice(None, cache.offset), slice(None))
    layer = {}
    for name in ("keys", "values"):
        stored = getattr(cache, name, None)
        if isinstance(stored, (tuple, list)):
            layer.update(zip((f"{name}.{part}" for part in TRIPLE), reading.parts(list(stored), index)))
        elif stored is not None:
            layer[name] = reading.parts([stored], index)[0]
    return layer


def _triples(layer: dict) -> dict:
    """{"keys": triple, "values": triple} of a quantized layer; None where one is missing."""
    return {name: tuple(layer[f"{name}.{part}"] for part in TRIPLE) if f"{name}.packed" in layer else None
            for name in ("keys", "values")}


def _solo_tokens(reading: Reading, cache, name, known=None):
    triple = getattr(cache, name, None)
    if triple is None:
        return None
    return _parts(reading, list(triple), (Ellipsis, slice(None, cache.offset), slice(None)), known)


def _ints(x) -> List[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, mx.array) else x)]
