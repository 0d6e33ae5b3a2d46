"""mlx-lm's quantized attention broadcast a left-padding mask over kv heads instead of rows (fixed in 0.32.0).

quantized_scaled_dot_product_attention (mlx_lm/models/base.py) reshapes the
scores of grouped-query heads to (B, kv_heads, repeats, L, S); before 0.32.0
it added the batch's (B, 1, L, S) mask without 'mask = mx.expand_dims(mask,
-3)', so row i's mask landed on kv head i: wrong logits when B equals the kv
heads, a broadcast error otherwise. Exits 1 while a batch of 3 rows with uneven
left padding raises on 2 kv heads, 0 once it runs (as on 0.32.0 and later).
"""

import sys

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention

B, heads, kv_heads, L, S, dim = 3, 4, 2, 1, 8, 64
queries = mx.zeros((B, heads, L, dim))
keys = values = mx.quantize(mx.zeros((B, kv_heads, S, dim)), group_size=64, bits=4)
mask = create_causal_mask(L, S - L, left_padding=mx.array([0, 2, 5]))  # what BatchKVCache.make_mask gives
try:
    mx.eval(quantized_scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask,
                                                   group_size=64, bits=4))
except ValueError as error:
    print(f"DEFECT: quantized attention with {heads} heads on {kv_heads} kv heads raises on a left-padded "
          f"batch of {B}: {error}")
    sys.exit(1)
print(f"fixed: quantized attention with {heads} heads on {kv_heads} kv heads runs on a left-padded batch of {B}")
