"""L1's checks: after one event, every row of the batch, every extracted
row and every source against the same requests alone in mlx-lm's caches.
What each check compares is declared in ``suites/format/checks.py``."""

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx
import numpy as np

from kvparity.oracle.arrays import Reading, describe_shared, owned_arrays, shared_memory_later
from kvparity.suites.core.raised import LazyArrayFailed, MemberRaised, consuming
from kvparity.suites.format.checks import (
    ALIAS, BYTES, CHECKS, EXTRACT, LAYOUT, LEFT_PADDING, NBYTES, OFFSET, PAD, QUANTIZED, SHARED_PADDING,
    SOURCE, STORED,
)
from kvparity.suites.core.compare import (
    TRIPLE, Divergence, a_triple, compare_later, in_words, left_padding_divergence, size_is_odd, state_triples,
    triple_job,
)
from kvparity.suites.format.events import FROM_A_STORE
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.core.evidence import ScheduleResult
from kvparity.suites.l1.solo import SoloCaches, layer_parts, triples_of
from kvparity.suites.core.replay import Replay
from kvparity.suites.core.stored import check_entries, check_fetch, entry_name

from kvparity.suites.l1.masks import check_mask


BEFORE_CALLS = -1  # Divergence.call of evidence on what an event's first call was handed


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
        try:
            self.reading.evaluate()
        except Exception as error:  # MLX computes lazily: a batch a member left fails only here
            raise MemberRaised(FLIGHT.last_change or "a member", LazyArrayFailed(error)) from error
        queue, self.queue = self.queue, []
        for item in queue:
            if callable(item):
                item()
            else:
                self.result.note(*item)


def check_event(replay: Replay, backend, solo: SoloCaches, checks: EventChecks, event):
    """Every check after one event, each noting the comparisons it made
    (into ``checks``, which may hold the evidence taken after its calls)."""
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


def _check_event(replay: Replay, backend, solo: SoloCaches, checks: EventChecks, event):
    """``backend``: the run's SyntheticBackend (its sources and what update_and_fetch returned)."""
    batch_known = {}  # every layer's arrays as taken before any extract
    check_stored(replay, backend, solo, checks, event)
    check_sources(replay, backend, checks, event, batch_known)
    check_preempted(replay, solo, checks, event)
    if replay.layers is None:
        checks.flush()
        return
    fetched = None
    if backend.fetched is not None and backend.fetched[0] == replay.version:
        fetched = backend.fetched[1]
    for layer, batch in enumerate(replay.layers):
        check_layer(replay, solo, checks, event, layer, batch,
                    None if fetched is None else fetched[layer], batch_known)


def check_layer(replay: Replay, solo: SoloCaches, checks: EventChecks, event, layer, batch, fetched, batch_known):
    """One layer's batch: its layout, every row against the row alone in
    that layer, its pads, nbytes and mask."""
    named = layer_named(solo, layer)
    before = checks.reading.take(owned_arrays(batch), batch_known)
    holds_none = not any(replay.held[rid] for rid in replay.rows)
    layout = check_layout(batch, replay.rows, checks, event, named, replay.schedule.bits, replay.schedule.group_size,
                          holds_none)
    if layout is None:
        return
    size, _, pads, triples = layout
    fetched = None if fetched is None else state_triples(fetched)
    pad_slices = check_rows(replay.rows, solo, checks, event, batch, layout, fetched, batch_known, layer)
    checks.flush()
    check_pad(pad_slices, checks)
    check_unchanged(before, owned_arrays(batch), checks, replay.rows, event.label, named)
    check_nbytes(batch, triples, checks, replay.rows, event.label, named)
    check_mask(batch, replay.rows, size, pads, checks, event, named)


def layer_named(solo: SoloCaches, layer: int) -> dict:
    """The layer as a divergence names it: only in a schedule of several layers."""
    return {"layer": layer} if len(solo.schedule.shapes) > 1 else {}


def check_stored(replay: Replay, backend, solo: SoloCaches, checks: EventChecks, event):
    """Stored prompt caches (``suites/core/stored.py``), and here their bytes: a
    new entry is what ``extract`` returned, so it holds the row's bytes
    (``extract``); a request resumed from a store holds, before it merges,
    the bytes of the same request resumed from mlx-lm's store holding
    mlx-lm's rows (``stored``)."""
    label = event.label
    jobs = []  # (check, request, (expected, actual, prefix, where))
    for entry in check_entries(replay, backend.stored_digests, checks.note, event):
        rid = entry.request
        for layer, (expected, stored) in enumerate(zip(solo.expected(rid, checks.reading), entry.caches)):
            where = dict(event=label, request=rid, **layer_named(solo, layer))
            unquantized = _not_triples(stored, "extract", triples_of(expected))
            if unquantized:  # said once, as for an extracted row
                checks.note(checks.at, EXTRACT, [rid], 1, [Divergence(EXTRACT, tensor=entry.name,
                                                                      detail=unquantized, **where)])
                continue
            jobs.append((EXTRACT, rid, (expected, layer_parts(checks.reading, stored), f"{entry.name}: ", where)))
    # What a join took from the store is what merge was handed: evidence before the event's first call.
    handed = dict(call=BEFORE_CALLS, member=CHECKS[STORED].reads)
    for rid, (entry, reused) in (replay.resumed.items() if event.kind in FROM_A_STORE else ()):
        # A batched join's rows are handed to merge as fetched: held after the event, as every row.
        if check_fetch(rid, entry, reused, solo.reused[rid], checks.note, event, **handed) and rid in backend.resumed:
            for layer, (expected, resumed) in enumerate(zip(solo.expected(rid, checks.reading),
                                                            backend.resumed[rid].layers)):
                jobs.append((STORED, rid, (expected, layer_parts(checks.reading, resumed),
                                           f"resumed from {entry_name(entry)}: ",
                                           dict(event=label, request=rid, **handed, **layer_named(solo, layer)))))
    compared = compare_later(checks.reading, [job for _, _, job in jobs])

    def note():
        # The comparator names what differs as bytes; here each job says whose they are.
        for (check, rid, _), found in zip(jobs, compared()):
            checks.result.note(checks.at, check, [rid], 1, [replace(d, check=check) for d in found])

    checks.later(note)


def check_preempted(replay: Replay, solo: SoloCaches, checks: EventChecks, event):
    """Rows out of the batch: extracted ones hold the implementation's bytes,
    waiting ones mlx-lm's own (compared, but no evidence)."""
    label, at = event.label, event.index
    for rid, alone in replay.preempted.items():
        made = 1 if rid in replay.extracted else 0
        for layer, (expected, cache, parts) in enumerate(zip(solo.caches(rid), alone.layers,
                                                             solo.expected(rid, checks.reading))):
            # An extracted row holds what extract returned, appended to by mlx-lm's own code alone.
            where = dict(event=label, request=rid, member="extract" if made else "", **layer_named(solo, layer))
            checks.note(at, OFFSET, [rid], made, [] if cache.offset == expected.offset else [
                Divergence(OFFSET, expected=expected.offset, actual=cache.offset, **where)])
            if made and hasattr(expected, "bits") and not hasattr(cache, "bits"):
                # What extract returned is not quantized: said once, not per missing array.
                unquantized = _not_triples(cache, "extract", triples_of(parts))
                checks.note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, tensor="extracted", detail=unquantized,
                                                               **where)])
                continue
            checks.named(rid, parts, layer_parts(checks.reading, cache), "extracted.", where, made)


def check_layout(batch, rows, checks: EventChecks, event, named, bits: int, group_size: int, holds_none=False):
    """Per-row offsets and pads, and a state of two triples: (size, offsets,
    pads, triples), or None when the batch cannot be read row by row (noted)
    or holds nothing to read (``holds_none``: no row holds a token, and its
    state holds None, as mlx-lm's caches do then).
    ``named``: the layer, as divergences name it."""
    label, at = event.label, event.index
    size = batch.size()
    offset, left_padding = batch.offset, batch.left_padding
    mx.eval([x for x in (offset, left_padding) if isinstance(x, mx.array)])  # both in one evaluation
    offsets, pads = per_row_ints(offset), per_row_ints(left_padding)
    read = {"size": size, "offset": offset, "left_padding": left_padding}
    wrong = layout_of_ints(size, offsets, pads, rows, lambda name: in_words(read[name]))
    if wrong is not None:
        checks.note(at, LAYOUT, rows, 1, [replace(wrong, event=label, **named)])
        return None
    triples = state_triples(batch.state)
    if triples is None and holds_none and size == 0 and not any(offsets):
        checks.note(at, LAYOUT, rows, 1, [])  # a batch merged from rows of no tokens: nothing written yet
        check_nbytes(batch, {}, checks, rows, label, named)  # holding nothing, it counts no less than 0
        return None
    if triples is None:
        checks.note(at, LAYOUT, rows, 1, [Divergence(
            LAYOUT, label, tensor="state", detail=f"state returned {in_words(batch.state)}, expected the keys' "
                                                    "and the values' (packed, scales, biases) triples first",
            **named)])
        return None
    checks.note(at, SHARED_PADDING, rows, 1,
                [Divergence(SHARED_PADDING, label, detail=f"every row has >= {min(pads)} pad columns", **named)]
                if min(pads) > 0 else [])
    checks.note(at, QUANTIZED, rows, 1, quantization_divergences(batch, bits, group_size, "the batch", event=label,
                                                                 **named))
    return size, offsets, pads, triples


def quantization_divergences(batch, bits: int, group_size: int, whose: str, **where) -> List[Divergence]:
    """The batch's ``bits`` and ``group_size`` against its rows' (``whose``: the batch, in words)."""
    held = (getattr(batch, "bits", None), getattr(batch, "group_size", None))
    return [] if held == (bits, group_size) else [Divergence(
        QUANTIZED, tensor="bits, group_size", expected=(bits, group_size), actual=held,
        detail=f"of {whose}, against its rows' bits and group size", **where)]


def check_rows(rows, solo: SoloCaches, checks: EventChecks, event, batch, layout, fetched, batch_known,
               layer) -> list:
    """Each row's offset, left padding, bytes in ``layer`` (in the state, in what
    update_and_fetch returned, in extract) against its solo cache; returns
    the pad columns' parts for the pad check. Every array is read once per
    event: the batch before any extract (a later in-place change is caught
    by check_unchanged), what update_and_fetch returned, and each oracle row
    while its cache is untouched."""
    size, offsets, pads, triples = layout
    label, at, reading = event.label, event.index, checks.reading
    pad_slices, fetched_known = [], {}
    lengths = [solo.caches(rid)[layer].offset for rid in rows]
    width = fetched["keys"][0].shape[2] if fetched is not None else None
    odd = width if size_is_odd(size, pads, lengths, width) else None  # size() disagrees with the rest
    for i, rid in enumerate(rows):
        expected_cache = solo.caches(rid)[layer]
        where = dict(event=label, request=rid, **layer_named(solo, layer))
        if not hasattr(expected_cache, "bits"):
            checks.note(at, LAYOUT, [rid], 1, [Divergence(LAYOUT, detail="an unquantized row is in the batch",
                                                          **where)])
            continue
        n, offset = expected_cache.offset, offsets[i]
        checks.note(at, OFFSET, [rid], 1, [Divergence(OFFSET, expected=n, actual=offset, **where)] if offset != n
                    else [])
        if size - pads[i] != n:
            checks.note(at, LEFT_PADDING, [rid], 1, [left_padding_divergence(i, n, size, pads[i], odd, **where)])
            continue  # the row's columns are unknown: bytes would only echo this
        checks.note(at, LEFT_PADDING, [rid], 1)
        lp = pads[i]
        expected = triples_of(solo.expected(rid, reading)[layer])
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
    return pad_slices


def check_pad(pad_slices, checks: EventChecks):
    """Hygiene: pad columns hold zeros."""
    checks.later(lambda: checks.note_per_row(PAD, pad_findings(pad_slices)))


def pad_findings(pad_slices):
    """(request, 1, divergences) per pad slice (request, where, tensor, pad
    columns, part), once their reading was evaluated."""
    for rid, where, tensor, lp, part in pad_slices:
        # No pad columns (lp == 0): nothing to read, nothing can be non-zero.
        if lp == 0 or not part.bits.any():
            yield rid, 1, []
            continue
        first = int(np.flatnonzero(part.bits)[0])
        yield rid, 1, [Divergence(PAD, tensor=tensor, index=first, expected=0,
                                  actual=int(part.bits.reshape(-1)[first]), detail=f"pad columns [0, {lp})", **where)]


def check_nbytes(batch, triples, checks: EventChecks, rows, label, named):
    """``nbytes`` counts at least the bytes the rows' own columns occupy."""
    live = sum(x.nbytes for triple in triples.values() for x in triple)
    held = batch.nbytes
    ok = isinstance(held, int) and not isinstance(held, bool) and held >= live
    checks.note(checks.at, NBYTES, rows, 1, [] if ok else [Divergence(
        NBYTES, label, expected=f">= {live}", actual=held, detail="bytes of the state's arrays", **named)])


def check_extract(batch, i, solo, expected, checks: EventChecks, where, batch_known):
    """``expected``: the solo row's keys and values triples, already taken;
    ``batch_known``: the batch's arrays as taken before the extracts."""
    # Its copies are evaluated with the event's other arrays (one mx.eval): an
    # async_eval per row cost more main-thread time than the overlap saved.
    extracted = batch.extract(i)
    where = {**where, "member": "extract"}  # what it returned is compared: its own output
    rid, at = where["request"], checks.at
    offset = getattr(extracted, "offset", None)
    if offset != solo.offset:
        checks.note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, expected=solo.offset, actual=offset,
                                                          detail=f"offset of extract({i})", **where)])
        return
    known = {}
    # A row of no tokens may come back as mlx-lm's empty cache (keys and values None): it holds the same nothing.
    holds_none = solo.offset == 0 and all(getattr(extracted, name, None) is None for name in ("keys", "values"))
    unquantized = "" if holds_none else _not_triples(extracted, f"extract({i})", expected)
    if unquantized:  # nothing to compare byte for byte: one divergence says what came back
        checks.note(at, EXTRACT, [rid], 1, [Divergence(EXTRACT, tensor="extracted", detail=unquantized,
                                                          **where)])
    else:
        held = (getattr(extracted, "bits", None), getattr(extracted, "group_size", None))
        checks.note(at, EXTRACT, [rid], 1, [] if held == (solo.bits, solo.group_size) else [
            Divergence(EXTRACT, tensor="bits, group_size", expected=(solo.bits, solo.group_size), actual=held,
                       detail=f"of the cache extract({i}) returned, against the row's", **where)])
        for name in () if holds_none else ("keys", "values"):
            checks.triples(rid, expected[name], _solo_tokens(checks.reading, extracted, name, known),
                           f"extracted.{name}", where)
    if holds_none:
        return  # no arrays: nothing to read, nothing shared
    # Its arrays are read through its state, as mlx-lm's generate_step reads a prompt cache's: what that raises
    # (a row of no tokens whose state indexes keys it does not hold) is extract's failure, never kvparity's.
    with consuming("extract", "the state of the row (as mlx-lm's generate_step evaluates it)",
                   lambda: in_words(extracted)):
        own = owned_arrays(extracted)
    shared = shared_memory_later(checks.reading, own, owned_arrays(batch), known, batch_known)
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


def check_unchanged(before, after, checks: EventChecks, rows, label, named):
    """``extract`` left the batch as it was: ``before``, the ticket of its
    arrays taken before the extracts, against ``after`` by bytes (an array
    written in place is still the same object)."""
    changed = [Divergence(EXTRACT, label, detail="extract changed the batch", **named)]
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
        Divergence(ALIAS, expected=0, actual=shared[2],
                   detail=f"{describe_shared(shared)}: keeps {shared[2]} bytes of {whose} alive", **where)])


def check_sources(replay: Replay, backend, checks: EventChecks, event, batch_known):
    """merge/extend left their sources' bytes unchanged (parity); merge keeps
    none of their buffers (hygiene)."""
    label, at = event.label, event.index
    batch_arrays = [x for batch in replay.layers or () for x in owned_arrays(batch)]
    rows = replay.rows or list(replay.running())
    named = lambda arrays: {str(k): x for k, x in enumerate(arrays)}
    for member, caches, before in backend.sources:
        after = [x for c in caches for x in owned_arrays(c)]
        after_known = {}
        # Always by bytes: an array written in place is still the same object.
        compared = compare_later(checks.reading, [(named(before), named(after), "", {"event": label})], after_known)
        checks.later(lambda member=member, compared=compared: checks.result.note(
            at, SOURCE, rows, 1,
            [] if not compared()[0] else [Divergence(SOURCE, label, detail=f"{member} modified its source",
                                                     member=member)]))
        if member == "merge":
            shared = shared_memory_later(checks.reading, batch_arrays, after, batch_known, after_known)
            checks.later(lambda shared=shared: _note_alias(checks, at, rows, shared(),
                                                           dict(event=label, tensor="merge", member="merge"),
                                                           "source buffer"))


def _parts(reading: Reading, triple, index, known=None):
    """``x[index]`` of each array, read with the event's other arrays;
    ``known`` collects what was taken, so a second slice of the same arrays
    at the same moment reads them once."""
    return tuple(reading.parts(triple, index, known))


def _solo_tokens(reading: Reading, cache, name, known=None):
    triple = getattr(cache, name, None)
    if triple is None:
        return None
    return _parts(reading, list(triple), (Ellipsis, slice(None, cache.offset), slice(None)), known)


def per_row_ints(x) -> Optional[List[int]]:
    """Per-row integers as a member gave them (an array, a list), a lone
    number as one entry; None where they are no integers at all."""
    values = x.tolist() if hasattr(x, "tolist") else x
    values = values if isinstance(values, (list, tuple)) else [values]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() for v in values):
        return None
    return [int(v) for v in values]


def layout_of_ints(size, offsets, pads, rows, said) -> Optional[Divergence]:
    """Why ``size()``, offsets and pads cannot place the rows (``said``: what
    was read, in words, by name), or None where they can."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return Divergence(LAYOUT, "", tensor="size()", detail=f"size() returned {said('size')}, expected the batch's "
                                                           "width in columns (an int)", member="size")
    for name, values in (("offset", offsets), ("left_padding", pads)):
        if values is None or len(values) != len(rows):
            return Divergence(LAYOUT, "", tensor=name, detail=f"{name} is {said(name)}, expected one integer for each "
                                                          f"of the {len(rows)} rows")
    return None
