"""mlx-vlm: QuantizedKVCache.prefix_cache_merge of a single row returns a
batch that holds the row's own arrays, so the batch and the row write into
each other.

prefix_cache_merge (mlx_vlm/models/cache.py:445 in 0.7.10, :446 in 0.7.2)
puts each row's key and value triples into a one-row BatchQuantizedKVCache
as they are (``batch.keys = row.keys``, :478) and joins several rows with
``extend``, which concatenates into new arrays; a single row is returned
as that one-row batch (:483-486), holding the very arrays the row holds.
BatchQuantizedKVCache.update_and_fetch writes its new tokens in place into
those arrays (``self.keys[i][..., prev:self._idx, :] = ...``), so a decode
step on the batch writes into the row's buffer; a second batch merged from
the same row then writes into the first batch's columns.

mlx-vlm's server is not affected: its prefix cache clones an entry before
merging it (apc_adapters.py:465 ``clone_cache_entry``). Code that merges a
row it keeps (the row as a stored prefix, merged for two requests) is.

Plain mlx + mlx-vlm; exits 1 while the defect is there, 0 once a merge of a
row leaves the row's bytes unchanged and two batches from one row stay apart.
Run: python single_row_merge_shares_buffers.py
"""

import sys

import mlx.core as mx
from mlx_vlm.models.cache import QuantizedKVCache

GROUP_SIZE, BITS, HEADS, HEAD_DIM, PREFIX = 64, 4, 2, 64, 5


def tokens(seed, n=1):
    mx.random.seed(seed)
    return (mx.random.normal((1, HEADS, n, HEAD_DIM)).astype(mx.bfloat16),
            mx.random.normal((1, HEADS, n, HEAD_DIM)).astype(mx.bfloat16))


def packed_keys(cache):
    """The packed keys of row 0 as bytes, up to the cache's width."""
    keys = cache.state[0][0]
    mx.eval(keys)
    return bytes(memoryview(keys[0]))


stored = QuantizedKVCache(group_size=GROUP_SIZE, bits=BITS)  # a stored prefix of 5 tokens
stored.update_and_fetch(*tokens(0, PREFIX))
stored_before = bytes(memoryview(mx.contiguous(stored.keys[0])))

# Two requests start from the stored prefix, each merged alone.
batch_a = stored.prefix_cache_merge([stored], [PREFIX])
batch_b = stored.prefix_cache_merge([stored], [PREFIX])
token_a, token_b = tokens(1), tokens(2)
batch_a.update_and_fetch(*token_a)
a_after_own_step = packed_keys(batch_a)
batch_b.update_and_fetch(*token_b)
a_after_other_step = packed_keys(batch_a)

expected_a = mx.quantize(token_a[0], group_size=GROUP_SIZE, bits=BITS)[0]
a_column = mx.array(batch_a.state[0][0][..., PREFIX:PREFIX + 1, :])
problems = []
if bytes(memoryview(mx.contiguous(stored.keys[0]))) != stored_before:
    problems.append("decoding the merged batch changed the stored row's packed keys (its buffer past offset)")
if a_after_other_step != a_after_own_step:
    problems.append("a decode step of batch B changed batch A's packed keys at column "
                    f"{PREFIX}: A's own token is gone")
if not mx.array_equal(a_column, expected_a).item():
    problems.append(f"batch A's key at column {PREFIX} is not mx.quantize of A's token")
print("batch A and batch B share buffers:", batch_a.keys[0] is batch_b.keys[0])
for p in problems:
    print("FAIL", p)
print("ok" if not problems else f"{len(problems)} problems")
sys.exit(1 if problems else 0)
