"""mlx-beam 0.1.0a11: the first write into a batch merged from fresh (empty)
rows fails at 5 and 6 bits (and at 3 bits for some head widths).

``BatchQuantizedKVCache._alloc`` sizes the packed buffer as
``dim // (32 // bits)`` uint32 words
(mlx_beam/_vendor/optiq/kv_batch.py:54-57), but ``mx.quantize`` packs a
head vector into ``dim * bits / 32`` words: 20 at 5 bits and 24 at 6 bits
for head_dim 128, where ``_alloc`` makes 21 and 25. The slice write of the
quantized update then cannot broadcast. Runs with plain mlx and mlx-beam;
exits 1 while the defect is there, 0 once it is gone.
"""

import sys

import mlx.core as mx
from mlx_beam._vendor.optiq.kv_batch import BatchQuantizedKVCache, MergeableQuantizedKVCache

BITS, GROUP_SIZE, HEAD_DIM = 5, 64, 128

rows = [MergeableQuantizedKVCache(group_size=GROUP_SIZE, bits=BITS)]  # a fresh request
batch = BatchQuantizedKVCache.merge(rows)

mx.random.seed(0)
keys = mx.random.normal((1, 2, 1, HEAD_DIM))  # one prompt token, 2 KV heads
values = mx.random.normal((1, 2, 1, HEAD_DIM))
expected = mx.quantize(keys, group_size=GROUP_SIZE, bits=BITS)
try:
    stored_keys, _ = batch.update_and_fetch(keys, values)
    mx.eval(stored_keys)
except ValueError as error:
    print(f"DEFECT: the first write into the merged batch raised: {error}")
    print(f"mx.quantize packs {expected[0].shape[-1]} words per head vector at {BITS} bits, head_dim {HEAD_DIM}")
    sys.exit(1)
same = all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(stored_keys, expected))
print("holds" if same else "DEFECT: stored keys differ from mx.quantize's")
sys.exit(0 if same else 1)
