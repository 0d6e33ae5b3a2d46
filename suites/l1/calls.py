"""L1's evidence after each protocol call on the batch, not only after each
event: what the call's own output must hold, and what the batch must hold
for the rows it touched, against the same rows alone in mlx-lm's caches at
that moment. The first call after which something diverged is the member at
fault (``Divergence.call`` and ``member``); a check that reads one member's
own output blames that member by construction (``Check.reads``).

Per call, taken when the call returns (handles on its arrays, no
evaluation) and compared with the event's other arrays at its end:

* every call: the batch's ``bits`` and ``group_size`` are the rows'
  (``quantized``); its ``offset`` and ``size() - left_padding`` are each
  touched row's length alone (``offset``, ``left_padding``);
* ``merge``, ``finalize``: the rows' bytes on ``[left_padding, size())``
  (``merge``'s against the rows it was handed), and their padding zero
  (``pad``, hygiene);
* ``update_and_fetch``: each row, in what it returned and in the state,
  equals the row alone (where the next write follows it, the columns it
  wrote, in what it returned: the next one's evidence reads the rest); in a
  padded prefill (before ``finalize``) each row's prompt on its first
  columns;
* ``extract``: the row it returned has the row's offset, bits and group size
  (its bytes are compared after the event, as every extracted row's).

The last call on the batch an event ends with is not compared here: the
event's own checks (``suites/l1/checks.py``) read all of it after that call.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import Part
from kvparity.suites.core.members import WRITE
from kvparity.suites.format.checks import (BYTES, CHECKS, EXTRACT, LAYOUT, LEFT_PADDING, OFFSET, PAD, QUANTIZED, RAISED,
                                    TRIMMED)
from kvparity.suites.core.compare import (TRIPLE, Divergence, compare_later, in_words, left_padding_divergence,
                                     size_is_odd, state_triples)
from kvparity.suites.l1.checks import layout_of_ints, pad_findings, per_row_ints, quantization_divergences

# The calls that leave the batch's rows in place (right-aligned, left-padded).
LAID_OUT = ("merge", "extend", "filter", "trim", "rollback", "finalize", WRITE)


@dataclass
class CallRecord:
    """One call on one layer's batch, as taken when it returned."""

    position: int  # its place among the event's calls on the batch
    member: str
    layer: int
    batch: object
    rows: List[str]
    lengths: List[int]  # each row's length alone after the call
    size: int = 0
    ints: tuple = ()  # (offset, left_padding): tickets of the reading, or the values as given
    triples: Dict[str, tuple] = field(default_factory=dict)  # "batch"/"fetched" -> {"keys": ticket, ...}
    alone: Dict[str, object] = field(default_factory=dict)  # request -> its solo cache in the layer
    notes: list = field(default_factory=list)  # (check, rows, comparisons, divergences), known at once
    tokens: int = 0  # update_and_fetch: the tokens it appended
    prefill: bool = False  # a padded prefill before finalize: rows start at column 0


class CallChecks:
    """The evidence after each call of one L1 run (``L1Run``)."""

    def __init__(self, run):
        self.run = run
        self.event = None
        self.checks = None  # the event's EventChecks: one reading for its calls and its own checks
        self.records: List[CallRecord] = []
        self.position = 0  # calls made in the event so far
        self.last = ""  # the member of the last call, in this event or before
        self.marks: Dict[str, int] = {}  # request -> divergences it had when the event began
        self.offset_member = _offset_is_a_member(run.implementation.batch_class)
        self.several_layers = len(run.schedule.shapes) > 1

    def for_event(self, event, make_checks):
        """The event's EventChecks (made by ``make_checks(index)`` at its first use)."""
        if self.event is not event:
            self.event, self.checks, self.records, self.position = event, make_checks(event.index), [], 0
            self.marks = {row.request: len(row.divergences) for row in self.run.result.rows}
        return self.checks

    def after(self, member: str, layer: int, batch, rows: List[str], **what):
        """Taken right after ``member`` returned on ``layer``'s batch holding ``rows``."""
        run = self.run
        trail = run.implementation.trail
        mark = len(trail)
        self.for_event(run.replay.event, run.event_checks)
        run.sync_solo()
        prefill = bool(what.get("prefill"))
        # What a call is held to: merge, the rows it was handed (a row from a store or an extract is
        # held to the oracle before it is merged, as that member's); every other call, the rows alone.
        sources = what.get("sources")
        alone = dict(zip(rows, sources)) if sources else {rid: run.solo.caches(rid)[layer] for rid in rows}
        # A padded prefill's merge of new rows holds none; one handed rows (a stored prefix) holds theirs.
        lengths = [0 if prefill and member == "merge" and not sources else alone[rid].offset for rid in rows]
        record = CallRecord(self.position, member, layer, batch, rows, lengths, alone=alone, prefill=prefill,
                            tokens=what.get("tokens", 0))
        try:
            if member == "extract":
                self._extracted(record, what["row"], what["extracted"])
            else:
                self._batch(record, what.get("fetched"))
            if member == "trim":
                self._trimmed(record, what["amount"], what["trimmed"], what["trimmable"])
        finally:
            del trail[mark:]  # what the evidence called is not what the event called
        self.records.append(record)
        self.position += 1
        self.last = member

    def where(self, record: CallRecord, rid: Optional[str] = None, member: str = "") -> dict:
        named = {"layer": record.layer} if self.several_layers else {}
        return dict(event=self.event.label, request=rid, call=record.position, member=member or record.member,
                    **named)

    # -- taken when the call returns ----------------------------------------------

    def _extracted(self, record: CallRecord, rid: str, cache):
        expected = record.alone[rid]
        got = (getattr(cache, "offset", None), getattr(cache, "bits", None), getattr(cache, "group_size", None))
        want = (expected.offset, expected.bits, expected.group_size)
        record.notes.append((EXTRACT, [rid], 1, [] if got == want else [Divergence(
            EXTRACT, tensor="extracted", expected=f"offset {want[0]}, bits {want[1]}, group_size {want[2]}",
            actual=f"offset {got[0]!r}, bits {got[1]!r}, group_size {got[2]!r}",
            detail=f"what extract({record.rows.index(rid)}) returned", **self.where(record, rid, "extract"))]))

    def _trimmed(self, record: CallRecord, n: int, returned, trimmable):
        """What trim returned, against what mlx-lm's QuantizedKVCache.trim
        returns for the same trim of the shortest row (every row is trimmed
        by ``n``; trim_prompt_cache passes the count on). Noted at once: the
        event's own checks do not read it. A batch whose is_trimmable() is
        not True is not trimmed, as trim_prompt_cache leaves it."""
        if trimmable is not True:
            self.checks.note(self.checks.at, TRIMMED, record.rows, 1, [Divergence(
                TRIMMED, self.event.label, tensor="is_trimmable", expected=True,
                actual=trimmable if isinstance(trimmable, bool) else in_words(trimmable),
                detail=f"so mlx-lm's trim_prompt_cache trims nothing (trim({n}) was not called), as mlx-lm's "
                       "QuantizedKVCache rows are trimmable", **{k: v for k, v in self.where(
                           record, member="is_trimmable").items() if k != "event"})])
            return
        expected = _trim_count(min(record.lengths) + n, n)  # the rows held n more before
        ok = isinstance(returned, int) and not isinstance(returned, bool) and returned == expected
        self.checks.note(self.checks.at, TRIMMED, record.rows, 1, [] if ok else [Divergence(
            TRIMMED, self.event.label, tensor="trim", expected=expected,
            actual=returned if isinstance(returned, int) else in_words(returned),
            detail=f"the count trim({n}) returned; its rows hold {record.lengths} tokens after it",
            **{k: v for k, v in self.where(record).items() if k != "event"})])

    def _batch(self, record: CallRecord, fetched):
        batch, schedule, reading = record.batch, self.run.schedule, self.checks.reading
        record.notes.append((QUANTIZED, record.rows, 1, quantization_divergences(
            batch, schedule.bits, schedule.group_size, f"the batch {record.member} left", **self.where(record))))
        if record.member == "prepare":
            return
        record.size = batch.size()
        # Offsets and pads as they are now, read with the event's other arrays.
        record.ints = tuple((reading.take([x])[0], x.dtype) if isinstance(x, mx.array) else (None, x)
                            for x in (batch.offset, batch.left_padding))
        sources = {"batch": batch.state}
        if record.member == WRITE:
            sources["fetched"] = fetched
        for name, value in sources.items():
            triples = state_triples(value)
            if triples is None and not any(record.lengths):
                continue  # nothing held yet: mlx-lm's caches hold None then too
            if triples is None:
                said = "state" if name == "batch" else record.member
                record.notes.append((LAYOUT, record.rows, 1, [Divergence(
                    LAYOUT, tensor="state" if name == "batch" else name,
                    detail=f"{said} returned {in_words(value)}, expected the keys' and the values' (packed, scales, "
                           "biases) triples first", **self.where(record))]))
            else:
                record.triples[name] = {tensor: (reading.take(list(t)), t) for tensor, t in triples.items()}

    # -- compared at the event's end -------------------------------------------------

    def finish(self, final_layers):
        """Queue what each call's evidence found, except the last call on each
        batch the event ends with (the event's checks read that)."""
        if self.checks is None or self.event is None:
            return
        covered = set()
        for batch in final_layers or ():
            last = next((r for r in reversed(self.records) if r.batch is batch and r.member != "extract"), None)
            if last is not None:
                covered.add(id(last))
        checks = self.checks
        for k, record in enumerate(self.records):
            if id(record) in covered:
                continue
            for check, rows, made, found in record.notes:
                checks.note(checks.at, check, rows, made, found)
            if record.ints:
                after = next((r for r in self.records[k + 1:] if r.batch is record.batch), None)
                # A write the next write on its batch follows: what it returned is its own to
                # show; its offsets and columns the next one's evidence reads, as the same member.
                only_fetched = record.member == WRITE and after is not None and after.member == WRITE
                checks.later(lambda record=record, only=only_fetched: self._compare(record, only))
        self.records = []

    def _compare(self, record: CallRecord, only_fetched: bool = False):
        """A record's offsets, pads and bytes, once the reading was evaluated
        (``only_fetched``: what update_and_fetch returned, nothing else)."""
        checks, reading = self.checks, self.checks.reading
        reading.evaluate()
        if only_fetched:
            self._bytes(record, range(len(record.rows)), None, ("fetched",))
            return
        read = [x if k is None else _signed(reading[[k]][0], x) for k, x in record.ints]
        offsets, pads = (per_row_ints(x) for x in read)
        rows, size = record.rows, record.size
        said = dict(zip(("offset", "left_padding"), read), size=size)
        wrong = layout_of_ints(size, offsets, pads, rows, lambda name: in_words(said[name]))
        if wrong is not None:
            checks.result.note(checks.at, LAYOUT, rows, 1, [replace(wrong, **{
                **self.where(record), "member": wrong.member or self.own_offset(wrong) or record.member})])
            return
        placed = []  # rows whose columns are where their length says
        width = _width(record.triples.get("fetched"))
        odd = width if size_is_odd(size, pads, record.lengths, width) else None  # size() disagrees with the rest
        for i, (rid, n) in enumerate(zip(rows, record.lengths)):
            if record.prefill and record.member != "merge":
                placed.append(i)  # rows start at column 0 until finalize
                continue
            where = self.where(record, rid)
            offset_where = {**where, "member": "offset"} if self.offset_member else where
            checks.result.note(checks.at, OFFSET, [rid], 1, [] if offsets[i] == n else [
                Divergence(OFFSET, expected=n, actual=offsets[i], **offset_where)])
            ok = size - pads[i] == n
            checks.result.note(checks.at, LEFT_PADDING, [rid], 1, [] if ok else [
                left_padding_divergence(i, n, size, pads[i], odd, **where)])
            if ok or odd is not None:  # where size() alone is wrong, the rows' columns end at the width returned
                placed.append(i)
        self._bytes(record, placed, pads, ("fetched", "batch"), odd)
        if record.member in ("merge", "finalize"):  # the padding the rows it placed came with (hygiene)
            taken = record.triples.get("batch", {})
            checks.note_per_row(PAD, pad_findings([
                (rows[i], self.where(record, rows[i]), f"batch.{tensor}.{part}", pads[i],
                 Part(reading, k, (slice(i, i + 1), slice(None), slice(None, pads[i]), slice(None)), x.dtype))
                for i in placed for tensor, (ticket, arrays) in taken.items()
                for part, k, x in zip(TRIPLE, ticket, arrays)]))

    def _bytes(self, record: CallRecord, placed, pads, names, size: Optional[int] = None):
        """The rows ``placed`` in ``names`` ("fetched", "batch"), against the
        rows alone: merge's and finalize's on [left_padding, size()); a
        write's whole rows, in what it returned (at its own width) and in the
        batch (up to ``size``, else size()), or with no ``pads`` (a write
        the next write follows) the columns it wrote, in what it returned."""
        checks, reading, rows = self.checks, self.checks.reading, record.rows
        size = record.size if size is None else size
        jobs = []
        for i in placed:
            rid, n, alone = rows[i], record.lengths[i], record.alone[rows[i]]
            if record.member in ("merge", "finalize"):
                spans = {"batch": (pads[i], size, n)} if n else {}
            elif record.member == WRITE:
                last = n if record.prefill or pads is not None else record.tokens
                pad = pads[i] if pads is not None else 0  # a prefill's rows start after their padding
                spans = {name: (pad, pad + n, n) if record.prefill else (end - last, end, last) for name, end in (
                    ("fetched", _width(record.triples.get("fetched"))), ("batch", size)) if isinstance(end, int)}
            else:
                continue
            for name in names:
                start, stop, last = spans.get(name, (0, -1, 0))
                if start < 0 or stop < start:
                    continue
                index = (slice(i, i + 1), slice(None), slice(start, stop), slice(None))
                for tensor, (ticket, arrays) in record.triples.get(name, {}).items():
                    expected = reading.parts(list(getattr(alone, tensor)),
                                             (Ellipsis, slice(n - last, n), slice(None)))
                    actual = [Part(reading, k, index, x.dtype) for k, x in zip(ticket, arrays)]
                    jobs.append((rid, (dict(zip(TRIPLE, expected)), dict(zip(TRIPLE, actual)), f"{name}.{tensor}.",
                                       self.where(record, rid))))
        if jobs:
            compared = compare_later(reading, [job for _, job in jobs])()
            checks.note_per_row(BYTES, ((rid, 1, found) for (rid, _), found in zip(jobs, compared)))

    def own_offset(self, d: Divergence) -> str:
        """``offset`` where the class computes it (a property) and ``d`` read it: its own output."""
        return "offset" if self.offset_member and (d.check == OFFSET or d.tensor == "offset") else ""

    def stamp(self, raised: str = "", in_call: bool = False):
        """Every divergence noted since the event began, as evidence after a
        call: the call it was seen after (the event's last; for what raised
        in a call, that call) and the member it blames (``Check.reads``, else
        that call's; ``raised``: the member that raised)."""
        if self.event is None:
            return
        last = self.position - 1
        for row in self.run.result.rows:
            for k in range(self.marks.get(row.request, 0), len(row.divergences)):
                d = row.divergences[k]
                if d.call is not None:
                    continue
                if d.check == RAISED:
                    call, member = (self.position if in_call else last), raised
                else:
                    call, member = last, d.member or CHECKS[d.check].reads or self.own_offset(d)
                row.divergences[k] = replace(d, call=call if call >= 0 else None, member=member or self.last)
        self.marks = {row.request: len(row.divergences) for row in self.run.result.rows}


def _trim_count(length: int, n: int) -> int:
    """What mlx-lm's QuantizedKVCache.trim(n) returns on a row of ``length`` tokens."""
    row = QuantizedKVCache()
    row.offset = length
    return row.trim(n)


def _width(triples) -> Optional[int]:
    """The token columns of taken triples ({"keys": (ticket, arrays), ...}); None without them."""
    return triples["keys"][1][0].shape[2] if triples else None


def _offset_is_a_member(batch_class) -> bool:
    """``offset`` computed by the class itself (a property): a wrong one is its own."""
    for klass in batch_class.__mro__:
        if "offset" in klass.__dict__:
            return isinstance(klass.__dict__["offset"], property)
    return False


_SIGNED = {mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64}


def _signed(bits: np.ndarray, dtype):
    """What a reading gives as unsigned bits, as values of ``dtype`` again."""
    return bits.view(_SIGNED[dtype]) if dtype in _SIGNED else mx.array(bits).view(dtype)
