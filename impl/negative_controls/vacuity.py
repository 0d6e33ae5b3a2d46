"""Caches that try to pass without evidence: refusing members, empty state,
zero-width rows, optional members declined."""

import mlx.core as mx

from kvparity.impl.batch_quantized import BatchQuantizedKVCache


# Each names the outcome a run of the catalog must reach. None may pass.


class RefusesUpdateAndFetch(BatchQuantizedKVCache):
    """A required member declines: every schedule is refused, a failure."""

    expected_outcome = "refused"

    def update_and_fetch(self, keys, values):
        raise NotImplementedError("update_and_fetch is not implemented")


class ZeroesMergeRefusesFilter(BatchQuantizedKVCache):
    """Wrong bytes from merge, then filter declines: the divergences already
    recorded stay, the schedule fails rather than reading "not supported"."""

    expected_outcome = "FAIL"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        batch.keys = tuple(mx.zeros_like(x) for x in batch.keys)
        return batch

    def filter(self, batch_indices):
        raise NotImplementedError("filter is not implemented")


class StateReturnsNone(BatchQuantizedKVCache):
    """``state`` gives nothing to compare: a layout failure, not a crash."""

    expected_outcome = "FAIL"

    @property
    def state(self):
        return None

    @state.setter
    def state(self, value):
        BatchQuantizedKVCache.state.fset(self, value)


class ZeroWidthState(BatchQuantizedKVCache):
    """``state`` holds arrays with no token columns: layout, under every policy."""

    expected_outcome = "FAIL"

    @property
    def state(self):
        keys, values, *rest = BatchQuantizedKVCache.state.fget(self)
        empty = lambda triple: tuple(x[..., :0, :] for x in triple)
        return (empty(keys), empty(values), *rest)

    @state.setter
    def state(self, value):
        BatchQuantizedKVCache.state.fset(self, value)


class WithoutPerRowRollback(BatchQuantizedKVCache):
    """No per-row rollback: the capability is detected as missing, so the
    schedules that need it are "not supported" and the rest must pass."""

    rollback = None


class RollbackRaisesNotImplemented(BatchQuantizedKVCache):
    """An optional member that declines when called: "not supported"."""

    def rollback(self, amounts):
        raise NotImplementedError("per-row rollback is not implemented")


VACUITY = [RefusesUpdateAndFetch, ZeroesMergeRefusesFilter, StateReturnsNone, ZeroWidthState]
