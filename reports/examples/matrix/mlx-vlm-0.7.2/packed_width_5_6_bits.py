"""mlx-vlm: BatchQuantizedKVCache sizes its packed buffer wrongly at 5 and 6
bits for head_dim 96 and 128, so the first write raises.

update_and_fetch allocates ``head_dim // (32 // bits)`` uint32 words per
token (models/cache.py:2411 and :2419 in mlx-vlm 0.7.2; the solo
QuantizedKVCache at :343 and :349); mx.quantize packs
``head_dim * bits // 32``. For bits 5 and 6, 32 // bits rounds down, and for
head_dim 96 and 128 the two differ (128 at 6 bits: 25 words allocated, 24
packed). mlx-vlm's own BatchGenerator builds this cache for ``kv_bits`` 5
or 6 (generate/ar.py ``_make_cache``). The solo QuantizedKVCache has the same
allocation.

Plain mlx + mlx-vlm; exits 1 while the defect is there, 0 once every cell
writes and returns the triples mx.quantize gives. Run: python packed_width_5_6_bits.py
"""

import sys

import mlx.core as mx
from mlx_vlm.models.cache import BatchQuantizedKVCache, QuantizedKVCache

GROUP_SIZE = 32  # divides every head_dim below


def first_write(cache, head_dim, bits):
    """Write one token of keys and values; the packed keys it returns, or the error."""
    mx.random.seed(0)
    keys = mx.random.normal((1, 2, 1, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((1, 2, 1, head_dim)).astype(mx.bfloat16)
    expected = mx.quantize(keys, group_size=GROUP_SIZE, bits=bits)
    try:
        got, _ = cache.update_and_fetch(keys, values)
    except ValueError as error:
        return f"raised ValueError: {error}"
    if all(mx.array_equal(g, e).item() and g.dtype == e.dtype for g, e in zip(got, expected)):
        return None
    return f"returned packed keys of shape {got[0].shape}, mx.quantize gives {expected[0].shape}"


failures = 0
for bits in (4, 5, 6, 8):
    for head_dim in (64, 96, 128):
        for name, make in (("BatchQuantizedKVCache", lambda: BatchQuantizedKVCache([0], GROUP_SIZE, bits)),
                           ("QuantizedKVCache", lambda: QuantizedKVCache(GROUP_SIZE, bits))):
            problem = first_write(make(), head_dim, bits)
            words = head_dim * bits // 32
            print(f"{name:22s} bits={bits} head_dim={head_dim:3d} (packs {words:2d} words): "
                  + ("ok" if problem is None else "FAIL " + problem))
            failures += problem is not None
print(f"{failures} failing cells")
sys.exit(1 if failures else 0)
