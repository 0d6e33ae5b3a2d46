"""rapid-mlx: QuantizedBatchKVCache sizes its packed buffer wrongly at 5 and 6
bits for head_dim 96 and 128, so the first write raises.

``_init_storage`` allocates ``head_dim // (32 // bits)`` uint32 words per
token (rapid_mlx/quantized_batch_cache.py:225 and :228 in rapid-mlx 0.16.10);
mx.quantize packs ``head_dim * bits // 32``. For bits 5 and 6, 32 // bits
rounds down, and for head_dim 96 and 128 the two differ (128 at 6 bits: 25
words allocated, 24 packed); the write at :311 then raises. rapid-mlx's
server only asks for 4 or 8 bits (cli.py:5449), so this is reached through
the class only.

The batch is built as rapid-mlx's continuous batching builds it: fresh
``_QuantizableKVCache`` rows merged by their class (quantized_batch_cache.py:599).
Plain mlx + mlx-lm + rapid-mlx; exits 1 while the defect is there, 0 once
every cell writes and returns the triples mx.quantize gives.
Run: python packed_width_5_6_bits.py
"""

import sys

import mlx.core as mx
from rapid_mlx.quantized_batch_cache import _QuantizableKVCache

GROUP_SIZE = 32  # divides every head_dim below


def first_write(head_dim, bits):
    """Write one token of keys and values into a fresh one-row batch; the
    problem with what it returns, or None."""
    rows = [_QuantizableKVCache(GROUP_SIZE, bits)]
    batch = type(rows[0]).merge(rows)
    mx.random.seed(0)
    keys = mx.random.normal((1, 2, 1, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((1, 2, 1, head_dim)).astype(mx.bfloat16)
    expected = mx.quantize(keys, group_size=GROUP_SIZE, bits=bits)
    try:
        got, _ = batch.update_and_fetch(keys, values)
    except ValueError as error:
        return f"raised ValueError: {error}"
    if all(mx.array_equal(g, e).item() and g.dtype == e.dtype for g, e in zip(got, expected)):
        return None
    return f"returned packed keys of shape {got[0].shape}, mx.quantize gives {expected[0].shape}"


failures = 0
for bits in (4, 5, 6, 8):
    for head_dim in (64, 96, 128):
        problem = first_write(head_dim, bits)
        print(f"QuantizedBatchKVCache bits={bits} head_dim={head_dim:3d} (packs {head_dim * bits // 32:2d} words): "
              + ("ok" if problem is None else "FAIL " + problem))
        failures += problem is not None
print(f"{failures} failing cells")
sys.exit(1 if failures else 0)
