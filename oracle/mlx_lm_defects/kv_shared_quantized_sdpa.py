"""mlx-lm hands a KV-shared layer quantized tuples, then calls mx.fast's dense SDPA on them.

gemma4_text's last num_kv_shared_layers layers have no cache of their own: they
reuse the keys and values an earlier layer returned (mlx_lm/models/gemma4_text.py,
Attention.__call__'s shared_kv). Under kv_bits those are the earlier layer's
QuantizedKVCache tuples, and the shared layer, whose cache is None, calls
scaled_dot_product_attention (mlx_lm/models/base.py), which reads cache.bits to
choose the quantized path and so hands the tuples to
mx.fast.scaled_dot_product_attention, a TypeError. Gemma 4's sliding layers
raise first (RotatingKVCache Quantization NYI); this config has only
full-attention layers, so the shared layers are what mlx-lm meets. Exits 1 while
generate_step(kv_bits=4) raises there, 0 once it runs.
"""
# kvparity-defect: solo-kv-bits-raises
# kvparity-match: TypeError
# kvparity-match: (scaled_dot_product_attention)

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma4_text

CONFIG = {  # four layers, the last two reading the KV of the second
    "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 256,
    "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "vocab_size": 256, "sliding_window": 16, "layer_types": ["full_attention"] * 4,
    "tie_word_embeddings": False,
}

mx.random.seed(0)
model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(CONFIG))
try:
    for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3,
                           kv_bits=4, kv_group_size=64, quantized_kv_start=0):
        pass
except TypeError as error:
    first_line = str(error).splitlines()[0]
    print(f"DEFECT: generate_step(kv_bits=4) on gemma4_text with KV-shared layers raises TypeError: {first_line}")
    sys.exit(1)
print("fixed: generate_step(kv_bits=4) on gemma4_text with KV-shared layers runs")
