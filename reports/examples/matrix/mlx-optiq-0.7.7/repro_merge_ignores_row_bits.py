"""mlx-optiq 0.7.7: a batch merged from fresh (empty) rows ignores the rows'
bits and group size and stores KV at 8 bits, group 64.

optiq's batch hook gives every new request an empty
``MergeableQuantizedKVCache(group_size, bits)`` (optiq/runtime/kv/batch.py:427).
mlx-lm's BatchGenerator merges those rows to prefill prompts together, and
``BatchQuantizedKVCache.merge`` takes bits and group size only from a row that
already holds keys (batch.py:229-231), else 8 and 64. Runs with plain mlx,
mlx-lm and mlx-optiq; exits 1 while the defect is there, 0 once it is gone.
"""

import sys

import mlx.core as mx
from optiq.runtime.kv.batch import BatchQuantizedKVCache, MergeableQuantizedKVCache

BITS, GROUP_SIZE = 3, 32  # what the server was asked for (any pair but 8, 64)

rows = [MergeableQuantizedKVCache(group_size=GROUP_SIZE, bits=BITS)]  # a fresh request
batch = BatchQuantizedKVCache.merge(rows)

mx.random.seed(0)
keys = mx.random.normal((1, 2, 1, 128)).astype(mx.float16)  # one prompt token, 2 KV heads
values = mx.random.normal((1, 2, 1, 128)).astype(mx.float16)
stored_keys, _ = batch.update_and_fetch(keys, values)
expected = mx.quantize(keys, group_size=GROUP_SIZE, bits=BITS)

print(f"rows: bits {BITS}, group_size {GROUP_SIZE}; batch: bits {batch.bits}, group_size {batch.group_size}")
print(f"stored packed keys {stored_keys[0].shape}, expected {expected[0].shape}")
same = (batch.bits, batch.group_size) == (BITS, GROUP_SIZE) and all(
    a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(stored_keys, expected))
print("holds" if same else "DEFECT: the batch quantizes at other bits than its rows")
sys.exit(0 if same else 1)
