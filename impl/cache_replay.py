"""Replays a schedule on a batch cache with synthetic keys and values (L1).

This is the cache half of an engine: no model, one layer. Joiners prefill
alone through mlx-lm's path (the same ``SoloCache`` the oracle uses) and
enter the batch through ``merge``/``extend``; every other event drives the
implementation under test through the protocol only. As in the model engine,
a request that joins before its ``quantized_kv_start`` waits outside the
batch, appending alone, and enters when mlx-lm converts it.
"""

from typing import Dict, List

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.impl.adapter import Implementation
from kvparity.oracle.parity import digest, owned_arrays
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import SyntheticKV


class CacheReplay:
    def __init__(self, implementation: Implementation, schedule, kv: SyntheticKV):
        self.impl = implementation
        self.schedule = schedule
        self.kv = kv
        self.batch = None
        self.rows: List[str] = []  # request id of each batch row, in order
        self.waiting: Dict[str, SoloCache] = {}  # joined, not yet quantized
        self.preempted: Dict[str, SoloCache] = {}
        self.written: Dict[str, int] = {}  # tokens each request has drawn
        self.last_fetch = None  # what the last update_and_fetch returned
        self.sources = []  # (what, caches, digest before) given to merge/extend

    # -- helpers -------------------------------------------------------------

    def draw(self, rid: str, n: int):
        return self.kv.draw(self.written, self.schedule.requests[rid], n)

    def prefill_alone(self, rid: str) -> SoloCache:
        return SoloCache.prefilled(
            self.schedule.requests[rid], self.schedule.bits, self.schedule.group_size,
            lambda n: self.draw(rid, n),
        )

    def watch(self, what: str, caches):
        """Remember the sources of a merge/extend so the checker can prove
        they were neither modified nor aliased."""
        arrays = [x for c in caches for x in owned_arrays(c)]
        self.sources.append((what, caches, digest(arrays)))

    def add_rows(self, new_batch, rids: List[str]):
        if self.batch is None:
            self.batch = new_batch
        else:
            self.watch("extend", [new_batch])
            self.batch.extend(new_batch)
        self.rows.extend(rids)

    def enter(self, solos: Dict[str, SoloCache]):
        """Quantized rows join the batch together; the others wait."""
        ready = [rid for rid, solo in solos.items() if solo.quantized]
        if ready:
            rows = [solos[rid].cache for rid in ready]
            self.watch("merge", rows)
            self.add_rows(self.impl.merge(rows), ready)
        self.waiting.update({rid: solo for rid, solo in solos.items() if not solo.quantized})

    def running(self) -> List[str]:
        return self.rows + list(self.waiting)

    def append_all(self, n: int):
        if self.rows:
            keys, values = zip(*(self.draw(rid, n) for rid in self.rows))
            self.last_fetch = self.batch.update_and_fetch(
                mx.concatenate(keys), mx.concatenate(values)
            )
        waiting, self.waiting = self.waiting, {}
        for rid, solo in waiting.items():
            solo.append(*self.draw(rid, n))
        self.enter(waiting)
        if len(self.waiting) < len(waiting):
            self.last_fetch = None  # rows entered: it shows the batch before them

    def drop_rows(self, amounts: Dict[str, int]):
        batched = [amounts.get(rid, 0) for rid in self.rows]
        if len(set(batched)) <= 1:
            if batched and batched[0]:
                self.batch.trim(batched[0])
        elif not self.impl.supports("per_row_rollback"):
            raise NotImplementedError("per-row rollback is not supported")
        else:
            self.batch.rollback(batched)
        for rid, solo in self.waiting.items():
            if amounts.get(rid, 0):
                solo.trim(amounts[rid])

    def keep_rows(self, keep: List[str]):
        if not keep:
            self.batch, self.rows = None, []  # as mlx-lm does: no rows, no batch
            return
        self.batch.filter([self.rows.index(rid) for rid in keep])
        self.rows = keep

    # -- events --------------------------------------------------------------

    def apply(self, event):
        self.last_fetch = None
        self.sources = []
        getattr(self, f"on_{event.kind}")(event.args)

    def on_join(self, rids):
        self.enter({rid: self.prefill_alone(rid) for rid in rids})

    def on_batched_join(self, rids):
        """Prefill several requests in one right-padded call: prepare/finalize."""
        requests = [self.schedule.requests[rid] for rid in rids]
        width = max(r.prompt_len for r in requests)
        empty = [QuantizedKVCache(self.schedule.group_size, self.schedule.bits) for _ in rids]
        batch = self.impl.merge(empty)
        batch.prepare(right_padding=[width - r.prompt_len for r in requests])
        keys, values = [], []
        for r in requests:
            k, v = self.draw(r.id, r.prompt_len)
            pad_k, pad_v = self.kv.padding(width - r.prompt_len)
            keys.append(mx.concatenate([k, pad_k], axis=2))
            values.append(mx.concatenate([v, pad_v], axis=2))
        batch.update_and_fetch(mx.concatenate(keys), mx.concatenate(values))
        batch.finalize()
        self.add_rows(batch, rids)

    def on_step(self, n: int):
        for _ in range(n):
            self.append_all(1)

    def on_leave(self, rids):
        for rid in rids:
            self.waiting.pop(rid, None)
        self.keep_rows([rid for rid in self.rows if rid not in rids])

    def on_spec_round(self, args):
        k, accepted = args["k"], args.get("accepted", {})
        self.append_all(k + 1)
        dropped = {rid: k - accepted.get(rid, k) for rid in self.running()}
        self.drop_rows(dropped)
        if any(dropped.values()):
            self.last_fetch = None  # it showed the window before the rollback

    def on_rollback(self, amounts):
        self.drop_rows(amounts)

    def on_trim(self, n: int):
        self.drop_rows({rid: n for rid in self.running()})

    def on_extract(self, rid: str):
        if rid in self.waiting:
            self.preempted[rid] = self.waiting.pop(rid)
            return
        row = self.batch.extract(self.rows.index(rid))
        request = self.schedule.requests[rid]
        self.preempted[rid] = SoloCache(
            self.schedule.bits, self.schedule.group_size, request.quantized_kv_start, row
        )
        self.keep_rows([r for r in self.rows if r != rid])

    def on_solo_step(self, steps):
        for rid, n in steps.items():
            for _ in range(n):
                self.preempted[rid].append(*self.draw(rid, 1))

    def on_reinsert(self, rid: str):
        self.enter({rid: self.preempted.pop(rid)})
