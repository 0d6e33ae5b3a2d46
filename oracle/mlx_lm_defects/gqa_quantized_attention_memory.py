"""mlx-lm's quantized attention copies a layer's keys and values once per query head of a group.

quantized_scaled_dot_product_attention (mlx_lm/models/base.py) gives grouped-query
heads' keys and values a repeats axis of size 1 (mx.expand_dims(x, axis=-3)) and
calls mx.quantized_matmul against queries of shape (B, kv_heads, repeats, L, D);
the matmul broadcasts the packed keys and values over the repeats, materialising
them repeats times. A decode step over a long context thus allocates about
repeats x a layer's quantized bytes beyond the cache, where the same cache read
with one query head per kv head allocates next to nothing. This measures both at
the same cache (the same bytes; only the query heads differ). Exits 1 while the
grouped read allocates more than one layer's bytes, 0 once it does not.
"""

import sys

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

B, KV_HEADS, REPEATS, DIM, CONTEXT, BITS, GROUP_SIZE = 1, 2, 4, 128, 8192, 4, 64


def peak_beyond_held(fn) -> int:
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() - held


cache = QuantizedKVCache(group_size=GROUP_SIZE, bits=BITS)
x = mx.random.normal((B, KV_HEADS, CONTEXT, DIM), key=mx.random.key(0)).astype(mx.bfloat16)
keys, values = cache.update_and_fetch(x, x)
mx.eval(keys, values)
layer = sum(a.nbytes for a in (*keys, *values))
peaks = {}
for heads in (KV_HEADS, KV_HEADS * REPEATS):
    queries = mx.random.normal((B, heads, 1, DIM), key=mx.random.key(1)).astype(mx.bfloat16)
    mx.eval(queries)
    peaks[heads] = peak_beyond_held(lambda: quantized_scaled_dot_product_attention(
        queries, keys, values, scale=DIM**-0.5, mask=None, group_size=GROUP_SIZE, bits=BITS))
grouped, per_head = peaks[KV_HEADS * REPEATS], peaks[KV_HEADS]
line = (f"{BITS}-bit attention over {CONTEXT} tokens, {KV_HEADS} kv heads x {DIM} (a layer of "
        f"{layer / 2**20:.2f} MiB): {KV_HEADS * REPEATS} query heads allocate {grouped / 2**20:.2f} MiB "
        f"({grouped / layer:.2f}x the layer), {KV_HEADS} query heads {per_head / 2**20:.2f} MiB "
        f"({per_head / layer:.2f}x)")
if grouped > layer:
    print(f"DEFECT: {line}")
    sys.exit(1)
print(f"fixed: {line}")
