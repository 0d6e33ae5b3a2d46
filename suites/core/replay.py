"""The one replay core: a schedule's events driven through a batch cache.

``Replay`` owns the bookkeeping every level shares: which requests are rows
of the batch (in row order), which joined but wait outside it until mlx-lm
converts them to the quantized cache, which were extracted, how many tokens
each generated, and the calls each request sees. It makes every protocol
call on the implementation's batch, one batch per layer. What a token *is*
comes from a backend:

* the dry run (``core/dry_run.py``): no cache at all; it refuses what cannot happen and
  records the calls and the optional capabilities a schedule needs;
* synthetic keys and values (L1, ``suites/l1/run.py``);
* a model (L2, ``suites/l2/run.py``).

Stores are mlx-lm's own ``LRUPromptCache``: ``store`` puts rows taken out
through ``extract`` in one, keyed by the tokens they hold, and
``join_stored`` starts requests from the nearest stored prefix of their
prompt, as mlx-lm's server does (``oracle/prompt_store.py``).

A request that joins before its ``quantized_kv_start`` waits: a forward runs
every row of the batch through one attention path, so the row decodes alone
through mlx-lm and enters the batch through ``merge``/``extend`` at the call
after which mlx-lm converts it.
"""

import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from mlx_lm.models.cache import LRUPromptCache

from kvparity.oracle.prompt_store import MODEL_KEY, fetch_nearest
from kvparity.suites.core.raised import consuming, returned_as_expected
from kvparity.suites.core.compare import in_words, row_in_words, rows_in_words
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.format.levels import L2
from kvparity.suites.format.schedule import ScheduledCall


class NotSupported(Exception):
    """The schedule needs an optional capability the implementation lacks."""

    def __init__(self, capability: str, why: str = ""):
        super().__init__(why or f"needs {capability}, which the implementation does not have")
        self.capability = capability


def is_count(value) -> bool:
    """A Python (or NumPy) integer, not a bool and not an array."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def mlx_lm_batch(rows: list):
    """One layer's solo rows as one batch: a quantized layer through the class
    under test (set by ``enter``), any other through mlx-lm's own class for it,
    as ``BatchGenerator`` merges it (``rows[0].merge(rows)``)."""
    return rows[0].merge(list(rows))


@dataclass
class StoredEntry:
    """A row's cache as a store holds it: what ``extract`` returned, per layer."""

    store: str
    request: str
    tokens: Tuple[tuple, ...]
    event: str  # the label of the store event
    caches: list

    @property
    def name(self) -> str:
        return f"stored entry {self.request!r} of store {self.store!r} ({len(self.tokens)} tokens, {self.event})"


class Replay:
    def __init__(self, schedule, backend):
        self.schedule = schedule
        self.backend = backend
        self.rows: List[str] = []  # request id of each batch row, in order
        self.layers: Optional[list] = None  # the implementation's batch, one per layer; None when empty
        self.waiting: Dict[str, object] = {}  # joined, not yet converted: decoding alone
        self.preempted: Dict[str, object] = {}  # extracted, decoding alone
        self.extracted: set = set()  # rows out of the batch whose cache extract returned (preempted, or waiting)
        self.gone: set = set()
        self.generated: Dict[str, int] = {}
        self.calls: Dict[str, List[ScheduledCall]] = {rid: [] for rid in schedule.requests}
        self.needs: set = set()
        self.version = 0  # bumped by every protocol call that changes the batch
        self.event = None
        self.held: Dict[str, List[tuple]] = {}  # the tokens each request's cache holds
        self.drawn: Dict[str, int] = {}  # tokens each request drew from its own stream
        self.stored_tokens: Dict[str, tuple] = {}  # what a request held when it was last stored
        self.stores: Dict[str, LRUPromptCache] = {}  # mlx-lm's own stores, by name
        self.entries: List[StoredEntry] = []  # every entry stored, in order
        self.order: List[Tuple[str, int]] = []  # (request, call index) of every call, in order
        self.resumed: Dict[str, tuple] = {}  # joiner -> (entry or None, tokens reused), this event
        # L1: told after every protocol call on the batch, as
        # (member, layer, the batch it was called on, that batch's rows, what else it was given or returned)
        self.on_call = None

    # -- driving -------------------------------------------------------------------

    def apply(self, event):
        self.event = event
        self.backend.begin(event)
        getattr(self, f"_{event.kind}")(event)

    def run(self):
        for event in self.schedule.events:
            self.apply(event)

    def running(self) -> List[str]:
        return self.rows + list(self.waiting)

    def calls_at(self, event_index: int) -> List[Tuple[str, ScheduledCall]]:
        """(request, call) of every call made at that event, in the order they
        were made: rows stored together evict one another in that order."""
        at = []
        for rid, j in reversed(self.order):
            call = self.calls[rid][j]
            if call.event < event_index:
                break
            if call.event == event_index:
                at.append((rid, call))
        return at[::-1]

    # -- validation ------------------------------------------------------------------

    def fail(self, reason):
        raise ScheduleError(f"{self.schedule.path}: event {self.event.label}: {reason}")

    def known(self, rid):
        if rid not in self.schedule.requests:
            self.fail(f"unknown request {rid!r}")

    def require_running(self, rid):
        self.known(rid)
        if rid not in self.rows and rid not in self.waiting:
            state = ("was extracted" if rid in self.preempted else
                     "has left" if rid in self.gone else "has not joined")
            self.fail(f"request {rid!r} is not in the batch (it {state})")

    def require_preempted(self, rid):
        self.known(rid)
        if rid not in self.preempted:
            self.fail(f"request {rid!r} is not extracted")

    def require_in_batch(self, rid):
        self.require_running(rid)
        if rid in self.waiting:
            self.fail(f"request {rid!r} is not in the batch yet: it decodes alone until mlx-lm "
                      f"converts it (quantized_kv_start)")

    def store_named(self, name) -> LRUPromptCache:
        if name not in self.stores:
            limits = self.schedule.stores.get(name)
            if limits is None:
                declared = ", ".join(self.schedule.stores) or "none"
                self.fail(f"unknown store {name!r} (declared in stores: {declared})")
            self.stores[name] = LRUPromptCache(limits.max_size, limits.max_bytes)
        return self.stores[name]

    def prompt_of(self, rid) -> Tuple[tuple, ...]:
        """The request's prompt as tokens: its own, or a chat turn's."""
        request = self.schedule.requests[rid]
        if request.continues is None:
            return tuple((rid, k) for k in range(request.prompt_len))
        source = request.continues
        if source not in self.stored_tokens:
            self.fail(f"request {rid!r} continues {source!r}, which has not been stored yet")
        before = self.stored_tokens[source]
        keep = len(before) if request.keep is None else request.keep
        if keep > len(before):
            self.fail(f"request {rid!r} keeps {keep} tokens of {source!r}, which was stored with {len(before)}")
        return before[:keep] + tuple((rid, k) for k in range(request.new_tokens))

    def require_some_running(self):
        if not self.running():
            self.fail(f"{self.event.kind} on an empty batch")

    # -- bookkeeping -----------------------------------------------------------------

    def called(self, member: str, layer: int, batch, rows: List[str], **what):
        """A protocol call on the batch was made: evidence is taken after it (L1)."""
        if self.on_call is not None:
            self.on_call(member, layer, batch, list(rows), **what)

    def call(self, rid, op, n, store="", tokens=()) -> int:
        """Record a call of ``rid``; returns its index among the request's calls."""
        self.calls[rid].append(ScheduledCall(self.event.index, op, n, store, tuple(tokens)))
        self.order.append((rid, len(self.calls[rid]) - 1))
        if op == "prefill":
            self.held[rid], self.drawn[rid] = [(rid, k) for k in range(n)], n
        elif op == "resume":
            self.held[rid] = list(tokens)
            self.drawn[rid] = sum(1 for stream, _ in tokens if stream == rid)
        elif op == "append":
            self.generated[rid] += n
            self.held[rid] += [(rid, self.drawn[rid] + k) for k in range(n)]
            self.drawn[rid] += n
        elif op == "trim":
            self.generated[rid] -= n
            del self.held[rid][len(self.held[rid]) - n:]
        return len(self.calls[rid]) - 1

    def admit(self, rids):
        for rid in rids:
            self.known(rid)
            if rid in self.rows or rid in self.waiting or rid in self.preempted or rid in self.gone:
                self.fail(f"request {rid!r} already joined")
            self.generated[rid] = 0
            self.calls.setdefault(rid, [])  # a generated schedule grows its requests as it goes

    def enter(self, solos: Dict[str, object]):
        """Converted rows join the batch together; the others wait."""
        ready = [rid for rid, solo in solos.items() if solo.quantized]
        self.extracted.difference_update(ready)
        if ready:
            layers = list(zip(*(solos[rid].layers for rid in ready)))
            quantized = [rows for rows in layers if hasattr(rows[0], "bits")]
            self.backend.watch("merge", [c for rows in quantized for c in rows])
            merge = self.backend.implementation.batch_class.merge
            merged = []
            for layer, rows in enumerate(layers):
                if hasattr(rows[0], "bits"):
                    merged.append(merge(list(rows)))
                    self.returned_a_batch("merge", merged[-1])
                    self.called("merge", layer, merged[-1], ready, sources=rows)
                else:
                    merged.append(mlx_lm_batch(rows))
            self.add_rows(merged, ready)
        self.waiting.update({rid: solo for rid, solo in solos.items() if not solo.quantized})

    def add_rows(self, layers, rids):
        if self.layers is None:
            self.layers = layers
        else:
            self.backend.watch("extend", layers)
            for layer, (batch, new) in enumerate(zip(self.layers, layers)):
                batch.extend(new)
                self.called("extend", layer, batch, self.rows + list(rids))
        self.rows = self.rows + list(rids)
        self.version += 1

    def keep_rows(self, keep: List[str]):
        if keep == self.rows:
            return
        if not keep:
            self.layers, self.rows = None, []  # as mlx-lm does: no rows, no batch
        else:
            indices = [self.rows.index(rid) for rid in keep]
            for layer, batch in enumerate(self.layers):
                batch.filter(indices)
                self.called("filter", layer, batch, keep)
            self.rows = keep
        self.version += 1

    def forward(self, n: int):
        """One call of n tokens for every running row: one batched call for
        the batch, one alone for each waiting row; rows mlx-lm just
        converted enter the batch."""
        calls = {rid: self.call(rid, "append", n) for rid in self.running()}
        if self.rows:
            self.backend.forward(self.layers, self.rows, n, calls)
        waiting, self.waiting = self.waiting, {}
        for rid, solo in waiting.items():
            self.backend.append_alone(rid, solo, n, calls[rid])
        self.enter(waiting)

    def drop(self, amounts: Dict[str, int]):
        """Roll back each named running row by its count."""
        for rid, n in amounts.items():
            if L2 not in self.schedule.levels and n > len(self.held[rid]):
                self.fail(f"rollback of {n} for {rid!r} is past what it holds ({len(self.held[rid])})")
            if L2 in self.schedule.levels and n > self.generated[rid]:
                # A model's row rolls back only what it generated: its prompt is the model's input.
                self.fail(f"rollback of {n} for {rid!r} is past what it generated ({self.generated[rid]})")
        untrimmable = self.backend.untrimmable() if any(amounts.values()) else None
        if untrimmable:
            raise NotSupported("rollback", f"rollback on this model: {untrimmable}, which mlx-lm cannot trim "
                                           "(trim_prompt_cache trims nothing then)")
        batched = [amounts.get(rid, 0) for rid in self.rows]
        even = len(set(batched)) == 1
        if any(batched) and not even:
            self.needs.add("per_row_rollback")
            if not self.backend.implementation.supports("per_row_rollback"):
                raise NotSupported("per_row_rollback")
        for rid, n in amounts.items():  # recorded first: the evidence after the batch's call reads them
            if n:
                self.call(rid, "trim", n)
        if any(batched):
            for layer, batch in enumerate(self.layers):
                if even:
                    # As mlx-lm's trim_prompt_cache trims a prompt cache: nothing where is_trimmable() says no.
                    trimmable = batch.is_trimmable()
                    trimmed = batch.trim(batched[0]) if trimmable else 0
                    self.called("trim", layer, batch, self.rows, amount=batched[0], trimmed=trimmed,
                                trimmable=trimmable)
                else:
                    batch.rollback(batched)
                    self.called("rollback", layer, batch, self.rows)
            self.version += 1
        for rid, solo in self.waiting.items():
            if amounts.get(rid):
                solo.trim(amounts[rid])

    # -- events ------------------------------------------------------------------------

    def _join(self, event):
        self.admit(event.requests)
        solos = {}
        for rid in event.requests:
            if self.schedule.requests[rid].continues is not None:
                self.fail(f"request {rid!r} continues {self.schedule.requests[rid].continues!r}: "
                          "it joins through join_stored")
            j = self.call(rid, "prefill", self.schedule.requests[rid].prompt_len)
            solos[rid] = self.backend.prefill(rid, j)
        self.enter(solos)

    def _batched_join(self, event):
        self.admit(event.requests)
        for rid in event.requests:
            request = self.schedule.requests[rid]
            if request.continues is not None:
                self.fail(f"request {rid!r} continues {request.continues!r}: it joins through join_stored")
            self.call(rid, "prefill", request.prompt_len)
        self.batched(event.requests, {})

    def _batched_join_stored(self, event):
        """As mlx-lm's BatchGenerator admits requests from a store: each
        from its nearest stored prefix or from nothing, merged as they are,
        then the rests of their prompts in one right-padded call."""
        self.admit(event.requests)
        self.batched(event.requests, self.fetch(event))

    def batched(self, rids, starts: Dict[str, tuple]):
        """Rows prefilled together (prepare/finalize) join the batch;
        ``starts``: a request's (stored prefix or None, rest of its prompt)."""
        if L2 in self.schedule.levels:
            self.fail(f"{self.event.kind} (padded batched prefill) is an L1 event")
        for rid in rids:
            request = self.schedule.requests[rid]
            if request.quantized_kv_start > len(self.held[rid]):
                self.fail(f"{rid!r} would join unquantized: {self.event.kind} prefills straight into "
                          "the quantized batch, so quantized_kv_start must be <= prompt_len")
        self.add_rows(self.backend.batched_prefill(list(rids), starts), rids)

    def _step(self, event):
        self.require_some_running()
        for _ in range(event.n):
            self.forward(1)

    def _leave(self, event):
        for rid in event.requests:
            self.require_running(rid)
        for rid in event.requests:
            self.waiting.pop(rid, None)
            self.extracted.discard(rid)
            self.gone.add(rid)
        self.keep_rows([rid for rid in self.rows if rid not in event.requests])

    def _spec_round(self, event):
        self.require_some_running()
        for rid in event.accepted:
            self.require_running(rid)
        self.forward(event.k + 1)
        self.drop({rid: event.k - event.accepted.get(rid, event.k) for rid in self.running()})

    def _rollback(self, event):
        for rid in event.amounts:
            self.require_running(rid)
        self.drop(dict(event.amounts))

    def _trim(self, event):
        self.require_some_running()
        self.drop({rid: event.n for rid in self.running()})

    def _extract(self, event):
        rid = event.request
        self.require_running(rid)
        if rid in self.waiting:
            self.preempted[rid] = self.waiting.pop(rid)
            return
        self.extracted.add(rid)
        self.preempted[rid] = self.backend.resume(rid, self.extract_row(rid))
        self.keep_rows([r for r in self.rows if r != rid])

    def _solo_step(self, event):
        for rid in event.amounts:
            self.require_preempted(rid)
        for rid, n in event.amounts.items():
            for _ in range(n):
                self.backend.append_alone(rid, self.preempted[rid], 1, self.call(rid, "append", 1))

    def _reinsert(self, event):
        # A row reinserted unquantized waits, still holding what extract returned (a later extract hands
        # out that again): it stays marked until it enters the batch.
        self.require_preempted(event.request)
        self.enter({event.request: self.preempted.pop(event.request)})

    def _store(self, event):
        """As mlx-lm's server stores a prompt or a finished request: the row
        through ``extract``, keyed by the tokens it holds; the rows stay."""
        store = self.store_named(event.store)
        for rid in event.requests:
            self.require_in_batch(rid)
        for rid in event.requests:
            caches = self.extract_row(rid)
            tokens = tuple(self.held[rid])
            self.entries.append(StoredEntry(event.store, rid, tokens, event.label, caches))
            with consuming("extract", "mlx-lm's LRUPromptCache.insert_cache", lambda: rows_in_words(caches)):
                store.insert_cache(MODEL_KEY, list(tokens), caches)
            self.stored_tokens[rid] = tokens
            self.call(rid, "store", len(tokens), event.store, tokens)

    def _join_stored(self, event):
        """As mlx-lm's server admits a request: the store's nearest prefix of
        its prompt (a deep copy, trimmed when the stored prompt is longer),
        the rest of the prompt alone, then merge + extend."""
        self.admit(event.requests)
        self.enter({rid: self.backend.prefill_from(rid, cache, rest, len(self.calls[rid]) - 1)
                    for rid, (cache, rest) in self.fetch(event).items()})

    def fetch(self, event) -> Dict[str, tuple]:
        """Each request's nearest stored prefix in the event's store (None
        where it holds none) and the rest of its prompt, recorded as a resume."""
        store = self.store_named(event.store)
        starts, self.resumed = {}, {}
        for rid in event.requests:
            prompt = self.prompt_of(rid)
            if not prompt:
                self.fail(f"request {rid!r} has an empty prompt (keep it or give it new_tokens)")
            entry = self.nearest_entry(event.store, prompt)
            with consuming("extract", "mlx-lm's LRUPromptCache.fetch_nearest_cache (a deep copy, then trim)",
                           lambda: rows_in_words(entry.caches) if entry else "a stored row"):
                cache, rest = fetch_nearest(store, prompt)
            self.resumed[rid] = (entry if cache is not None else None, len(prompt) - len(rest))
            self.call(rid, "resume", len(rest), event.store, prompt)
            starts[rid] = (cache, rest)
        return starts

    def extract_row(self, rid) -> list:
        """Row ``rid`` of the batch, through ``extract``, one cache per layer."""
        i, caches, cls = self.rows.index(rid), [], self.backend.implementation.batch_class
        for layer, batch in enumerate(self.layers):
            caches.append(batch.extract(i))
            row = caches[-1]
            if isinstance(cls, type) and isinstance(batch, cls):  # a layer of the class under test, not mlx-lm's
                # mlx-lm slices a solo row by its offset, a Python int: an array there is no row it can take.
                returned_as_expected("extract", row, all(hasattr(row, name) for name in ("offset", "keys", "values"))
                                     and is_count(row.offset), "a solo cache (an int offset, keys and values)",
                                     lambda r: row_in_words(r) if hasattr(r, "offset") else in_words(r))
            self.called("extract", layer, batch, self.rows, row=rid, extracted=row)
        return caches

    def returned_a_batch(self, member: str, batch):
        """What merge returned is a batch of the class under test, as every later call takes it."""
        cls = self.backend.implementation.batch_class
        if isinstance(cls, type):  # a class under test (the coverage model's walk stands in for one)
            returned_as_expected(member, batch, isinstance(batch, cls), f"a batch of {cls.__name__}", in_words)

    def nearest_entry(self, store: str, prompt) -> Optional[StoredEntry]:
        """The entry a fetch of ``prompt`` copies (for messages): the latest
        stored one of that store whose tokens share the longest prefix."""
        def shared(entry):
            n = 0
            for a, b in zip(entry.tokens, prompt):
                if a != b:
                    break
                n += 1
            return n

        found = [e for e in self.entries if e.store == store and shared(e) > 0]
        return max(reversed(found), key=shared, default=None)
