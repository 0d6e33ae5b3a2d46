"""mlx-lm's quantized attention refuses attention sinks.

gpt_oss's attention passes its learned sinks to scaled_dot_product_attention
(mlx_lm/models/base.py), which raises "Quantized SDPA does not support attention
sinks." for any quantized cache. gpt-oss needs a sliding layer (its model looks
one up), and mlx-lm's solo generate_step(kv_bits=4) raises there first
(RotatingKVCache Quantization NYI), so this script quantizes only the full
layer, as kv_bits would have, and runs the model on it. Exits 1 while the
quantized full layer refuses the sinks, 0 once it attends.
"""
# kvparity-defect: solo-kv-bits-raises
# kvparity-match: does not support attention sinks

import sys

import mlx.core as mx
from mlx_lm.models import gpt_oss
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

CONFIG = {
    "model_type": "gpt_oss", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
}

mx.random.seed(0)
model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(CONFIG))
cache = make_prompt_cache(model)
cache[1] = QuantizedKVCache(group_size=64, bits=4)  # the full-attention layer, as kv_bits converts it
try:
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
except ValueError as error:
    print(f"DEFECT: gpt_oss's full-attention layer on a QuantizedKVCache raises ValueError: {error}")
    sys.exit(1)
print("fixed: gpt_oss's full-attention layer attends with its sinks over a QuantizedKVCache")
