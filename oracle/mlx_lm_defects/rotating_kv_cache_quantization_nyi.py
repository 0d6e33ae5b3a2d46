"""mlx-lm cannot quantize a sliding-window layer: RotatingKVCache Quantization NYI.

gemma3_text's make_cache gives its sliding layers a RotatingKVCache, whose
to_quantized raises (mlx_lm/models/cache.py, RotatingKVCache.to_quantized), so
mlx-lm's solo generate_step(kv_bits=4) raises on a Gemma 3 model. Exits 1
while the solo kv_bits run cannot quantize the sliding layers, 0 once it does.
"""
# kvparity-defect: solo-kv-bits-raises
# kvparity-match: RotatingKVCache Quantization NYI

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

CONFIG = {  # Gemma 3 1B's pattern, tiny: five sliding layers, then one global
    "model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 6, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 16, "sliding_window_pattern": 6,
}

mx.random.seed(0)
model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
cache = make_prompt_cache(model)
try:
    for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3, prompt_cache=cache,
                           kv_bits=4, kv_group_size=64, quantized_kv_start=0):
        pass
except NotImplementedError as error:
    print(f"DEFECT: generate_step(kv_bits=4) on gemma3_text raises NotImplementedError: {error}")
    sys.exit(1)
dense = [i for i, c in enumerate(cache) if isinstance(c, RotatingKVCache)]
if dense:
    print(f"DEFECT: generate_step(kv_bits=4) on gemma3_text ran but left sliding layers {dense} dense")
    sys.exit(1)
print(f"fixed: generate_step(kv_bits=4) on gemma3_text quantized every layer: {[type(c).__name__ for c in cache]}")
