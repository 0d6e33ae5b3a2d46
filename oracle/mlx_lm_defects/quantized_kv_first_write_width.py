"""mlx-lm's empty QuantizedKVCache allocates the wrong packed width at 3, 5 and 6 bits.

QuantizedKVCache.update_and_fetch (mlx_lm/models/cache.py) sizes a new buffer's
packed words per token as dim // (32 // bits), but mx.quantize packs
dim * bits / 32 words; when 32 is no multiple of bits these differ at some dims
(5 bits, 128: 21 vs 20), and the first write into an empty cache raises a
broadcast error. A cache converted from a KVCache (to_quantized) never takes
this path, so the solo run quantized after its prompt works where one quantized
from its first token raises. Exits 1 while any (bits, dim) below raises, 0 once
none does.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

GROUP_SIZE = 32
broken = []
for bits in (2, 3, 4, 5, 6, 8):
    for dim in (64, 96, 128, 192, 256, 512):
        x = mx.zeros((1, 1, 1, dim))
        try:
            mx.eval(QuantizedKVCache(group_size=GROUP_SIZE, bits=bits).update_and_fetch(x, x))
        except ValueError:
            broken.append(f"{bits} bits x {dim} ({dim // (32 // bits)} words, mx.quantize packs {dim * bits // 32})")
if broken:
    print(f"DEFECT: an empty QuantizedKVCache's first write raises at {len(broken)} (bits, dim): {'; '.join(broken)}")
    sys.exit(1)
print("fixed: an empty QuantizedKVCache's first write runs at every bits and dim tried")
