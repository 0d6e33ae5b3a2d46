"""Controls each seen as one failure group that names its member
(``at_fault``), where a guess from the last member before the failing event
would name another."""

from mlx_lm.models.cache import QuantizedKVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache, _tokens


# Bugs of kinds the failure groups were not first built on: a reader's own
# output, a batch's quantization, a buffer freed too far, an extracted row's
# description. The evidence after every call must name the member, whatever
# the check that sees it first or the event it is seen at.


class MaskUnmaskedForOneToken(BatchQuantizedKVCache):
    """make_mask gives no mask for a one-token step, as a solo cache may
    (one query attends to every column): in a batch, rows then attend to
    their own left padding at every decode step."""

    caught_by = "mask"
    at_fault = "make_mask"

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if N == 1:
            return None
        return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)


class MergeOfEmptyRowsTakesDefaults(BatchQuantizedKVCache):
    """merge reads bits and group size off the first row that holds keys;
    where none does (a padded batched prefill merges never-filled rows) it
    builds the batch with the constructor's defaults (8 bits, group 64)."""

    caught_by = "quantized"
    at_fault = "merge"

    @classmethod
    def merge(cls, caches):
        if all(c.keys is None for c in caches):
            return cls([c.offset for c in caches])
        return super().merge(caches)


class TrimReleasesStepsRoundingDown(BatchQuantizedKVCache):
    """trim gives buffer memory back in whole steps, keeping the steps its
    tokens need counted by floor division: the last, partly filled step is
    given back with the tokens in it."""

    caught_by = "layout"
    at_fault = "trim"

    def trim(self, n):
        n = super().trim(n)
        kept = self._idx // self.step * self.step  # rounds down where it must round up
        if self.keys is not None and kept < self._capacity():
            self.keys, self.values = _tokens(self.keys, 0, kept), _tokens(self.values, 0, kept)
        return n


class ExtractDescribes8BitRowsAtGroup64(BatchQuantizedKVCache):
    """extract copies the row's bytes right but describes an 8-bit row with
    group size 64 (mlx-lm's default), whatever group it was quantized at:
    mlx-lm's own update_and_fetch then raises on the row's next token."""

    caught_by = "extract"
    at_fault = "extract"

    def extract(self, idx):
        row = super().extract(idx)
        described = QuantizedKVCache(group_size=64 if row.bits == 8 else row.group_size, bits=row.bits)
        described.offset, described.keys, described.values = row.offset, row.keys, row.values
        return described
