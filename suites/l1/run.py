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
from contextlib import contextmanager
from typing import Dict

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import arrays_in, handles, owned_arrays, start_evaluating
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV
from kvparity.suites.core.members import WRITE
from kvparity.suites.core.adapter import Implementation
from kvparity.suites.core.raised import MemberRaised, consuming
from kvparity.suites.core.compare import rows_in_words
from kvparity.suites.core.evidence import NOT_JUDGED, NOT_SUPPORTED, ScheduleResult
from kvparity.suites.l1.calls import CallChecks
from kvparity.suites.l1.checks import EventChecks, check_event
from kvparity.suites.l1.solo import SOLO_STATES, SoloCaches, prefilled_from
from kvparity.suites.format.levels import L1
from kvparity.suites.core.replay import Replay
from kvparity.suites.core.event_loop import drive


class SyntheticBackend:
    """Tokens are synthetic keys and values per (request, token), in every
    layer of the schedule's shapes."""

    def __init__(self, implementation: Implementation, schedule, kv: SyntheticKV):
        self.implementation = implementation
        self.schedule = schedule
        self.kv = kv
        self.written: Dict[str, int] = {}  # tokens each request has drawn
        self.fetched = None  # (replay version, triples) of the last update_and_fetch
        self.sources = []  # (member, caches, their arrays before) of this event's merges/extends
        self.replay = None
        self.stored_digests: Dict[int, str] = {}  # entry's place in replay.entries -> its bytes when stored
        self.resumed: Dict[str, SoloCache] = {}  # this event's joiners from a store, before merge

    def draw(self, rid: str, n: int):
        return self.kv.draw(self.written, self.schedule.requests[rid], n)

    def begin(self, event):
        self.fetched, self.sources, self.resumed = None, [], {}

    def watch(self, member, caches):
        # Handles, not the arrays: a member may write a source's arrays in place.
        self.sources.append((member, caches, handles([x for c in caches for x in owned_arrays(c)])))

    def prefill(self, rid, j):
        request = self.schedule.requests[rid]
        return SOLO_STATES.prefilled(self.kv, self.written, request, self.schedule.bits, self.schedule.group_size,
                                     request.prompt_len).solo.fork()

    def prefill_from(self, rid, cache, rest, j):
        self.written[rid] = self.replay.drawn[rid]
        # A copy of a row the implementation's extract returned, appended to by mlx-lm.
        with consuming("extract", "mlx-lm's QuantizedKVCache.update_and_fetch (the rest of the prompt, on the "
                       "stored row)", lambda: rows_in_words(cache or ())):
            solo = prefilled_from(self.kv, self.schedule, self.schedule.requests[rid], cache, rest)
        self.resumed[rid] = solo
        return solo

    def stored_as_merged(self, rid, cache) -> list:
        """A stored prefix (a copy) as merge takes it in a batched join: given
        to mlx-lm first, as a join from a store gives it (``prefill_from``),
        so a row the implementation's extract handed out unquantized is
        converted by mlx-lm's own code and merged (its bytes then held by
        ``stored``), not refused by merge. It is converted before the rest of
        its prompt: the batch it joins is quantized, and the request holds
        quantized_kv_start tokens by its end (``Replay.batched``)."""
        solo = SoloCache(self.schedule.bits, self.schedule.group_size, 0, cache)
        with consuming("extract", "mlx-lm's maybe_quantize_kv_cache (the stored row, before merge)",
                       lambda: rows_in_words(cache)):
            solo.convert()
        return solo.layers

    def resume(self, rid, caches):
        start = self.schedule.requests[rid].quantized_kv_start
        return SoloCache(self.schedule.bits, self.schedule.group_size, start, caches)

    def forward(self, layers, rows, n, calls):
        drawn = zip(*(self.draw(rid, n) for rid in rows))  # per layer: each row's (keys, values)
        fetched = []
        for i, (batch, layer) in enumerate(zip(layers, drawn)):
            with self.in_layer(i):
                fetched.append(batch.update_and_fetch(*(mx.concatenate(xs) for xs in zip(*layer))))
                self.replay.called(WRITE, i, batch, rows, fetched=fetched[-1], tokens=n)
        self.fetched = (self.replay.version, fetched)

    @contextmanager
    def in_layer(self, layer: int):
        """A member that raises in a schedule of several layers is named with its layer."""
        try:
            yield
        except MemberRaised as raised:
            if len(self.schedule.shapes) > 1 and raised.layer is None:
                raised.layer = layer
            raise

    def computed(self) -> list:
        """Arrays the implementation computed in this event that the checks
        read, taken without calling a member: what ``update_and_fetch``
        returned, and each layer's offsets and left padding."""
        arrays = arrays_in(self.fetched[1]) if self.fetched is not None else []
        for batch in self.replay.layers or ():
            arrays += arrays_in((getattr(batch, "offset", None), getattr(batch, "left_padding", None)))
        return arrays

    def append_alone(self, rid, solo, n, j):
        if rid not in self.replay.extracted:  # mlx-lm's own row, waiting to be converted
            solo.append(self.draw(rid, n))
            return
        with consuming("extract", "mlx-lm's QuantizedKVCache.update_and_fetch (the row decoding alone)",
                       lambda: rows_in_words(solo.layers)):
            solo.append(self.draw(rid, n))

    def untrimmable(self) -> str:
        return ""  # synthetic layers are quantized caches: every one trims

    def batched_prefill(self, rids, starts):
        """Several prompts in one right-padded call: prepare/finalize, in every
        layer. ``starts``: a request's stored prefix (a copy, one cache per
        layer, or None) and the rest of its prompt; a request not in it starts
        from nothing with its whole prompt."""
        seeds = {rid: r.seed for rid, r in self.schedule.requests.items()}
        own = []  # per request, per layer: the keys and values it prefills
        for rid in rids:
            if rid in starts:
                self.written[rid] = self.replay.drawn[rid]
                own.append(self.kv.named(starts[rid][1], seeds))
            else:
                own.append(self.draw(rid, self.schedule.requests[rid].prompt_len))
        lengths = [len(starts[rid][1]) if rid in starts else self.schedule.requests[rid].prompt_len for rid in rids]
        width = max(lengths)
        # Per request, per layer: its prompt's keys and values, then junk to the width.
        padded = [[tuple(mx.concatenate([x, pad], axis=2) for x, pad in zip(layer, junk))
                   for layer, junk in zip(mine, self.kv.padding(width - n))] for mine, n in zip(own, lengths)]
        rows = [self.stored_as_merged(rid, starts[rid][0]) if starts.get(rid, (None,))[0]
                else [QuantizedKVCache(self.schedule.group_size, self.schedule.bits) for _ in self.schedule.shapes]
                for rid in rids]
        self.watch("merge", [c for row in rows for c in row])
        layers, called = [], self.replay.called
        for i, layer in enumerate(zip(*padded)):
            with self.in_layer(i):
                batch = self.implementation.batch_class.merge([row[i] for row in rows])
                self.replay.returned_a_batch("merge", batch)
                # Rows handed a stored prefix are held to what merge was handed, as a join's.
                called("merge", i, batch, rids, prefill=True, **({"sources": [row[i] for row in rows]}
                                                                 if starts else {}))
                batch.prepare(right_padding=[width - n for n in lengths])
                called("prepare", i, batch, rids, prefill=True)
                keys, values = (mx.concatenate(xs) for xs in zip(*layer))
                fetched = batch.update_and_fetch(keys, values)
                called(WRITE, i, batch, rids, prefill=True, fetched=fetched, tokens=width)
                start_evaluating(arrays_in(fetched))
                batch.finalize()
                called("finalize", i, batch, rids)
            layers.append(batch)
        return layers


class L1Run:
    """One schedule in progress: the replay, the solo caches and the evidence.

    ``advance`` takes more events of the same schedule, so a generator can
    grow a schedule one event at a time and see each event checked.
    """

    def __init__(self, schedule, implementation: Implementation, every_call: bool = True):
        """``every_call``: evidence after every protocol call (False: after
        every event only, the yardstick its cost is measured against)."""
        self.implementation = implementation
        self.kv = SyntheticKV(schedule.shapes, schedule.dtype)
        self.backend = SyntheticBackend(implementation, schedule, self.kv)
        self.replay = Replay(schedule, self.backend)
        self.backend.replay = self.replay
        self.solo = SoloCaches(schedule, self.kv)
        self.result = ScheduleResult(schedule.name, L1, implementation.name, path=schedule.path)
        for rid in schedule.requests:
            self.result.row(rid)
        self.running = True
        self.seconds = 0.0
        self.calls_before = dict(implementation.calls)
        self.calls = CallChecks(self)  # the evidence after each protocol call
        self.replay.on_call = self.calls.after if every_call else None
        self.applied = 0  # calls of the replay the solo caches have taken
        self.checked = None  # the last event whose own checks began

    @property
    def schedule(self):
        return self.replay.schedule

    def event_checks(self, index: int) -> EventChecks:
        return EventChecks(self.result, index)

    def sync_solo(self):
        """The solo caches take the calls the replay recorded since they last did."""
        order = self.replay.order
        self.solo.apply([(rid, self.replay.calls[rid][j]) for rid, j in order[self.applied:]])
        self.applied = len(order)

    def advance(self, events) -> bool:
        """Apply and check ``events``; False once the run has stopped."""
        start = time.perf_counter()
        self.result.event_kinds += [e.kind for e in events]
        if self.running:
            with self.implementation.watching():
                self.running = drive(self.result, self.replay, events, self.check)
                if not self.running and self.result.stopped != NOT_JUDGED:  # not judged: nothing more is called
                    self.settle()
        self.seconds += time.perf_counter() - start
        return self.running

    def check(self, event):
        # The implementation's kernels run while mlx-lm's graph is built, and
        # mlx-lm's while the checks build theirs (two cores: Python and MLX).
        start_evaluating(self.backend.computed())
        checks = self.calls.for_event(event, self.event_checks)
        self.sync_solo()
        self.checked = event
        try:
            self.calls.finish(self.replay.layers)
            check_event(self.replay, self.backend, self.solo, checks, event)
        finally:
            self.solo.keep()
        self.calls.stamp()

    def settle(self):
        """The run stopped in an event: what its calls showed before, noted;
        what raised, as evidence after the call that raised."""
        in_call = self.checked is not self.replay.event  # it stopped before the event's own checks
        checks = self.calls.checks
        if in_call and checks is not None and self.calls.event is self.replay.event:
            try:
                self.calls.finish(None)
                checks.done()
            finally:
                self.solo.keep()
        self.calls.stamp(self.result.raised_by, in_call=in_call)

    def finish(self) -> ScheduleResult:
        result = self.result
        result.seconds = self.seconds
        result.members = self.implementation.calls_since(self.calls_before)
        return result


def run_l1(schedule, implementation: Implementation, every_call: bool = True) -> ScheduleResult:
    run = L1Run(schedule, implementation, every_call)
    missing = implementation.missing(schedule.needs)
    if missing:
        run.result.event_kinds = [e.kind for e in schedule.events]
        run.result.stop(NOT_SUPPORTED, f"needs {', '.join(missing)}")
        return run.finish()
    run.advance(schedule.events)
    return run.finish()
