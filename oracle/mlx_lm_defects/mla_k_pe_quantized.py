"""mlx-lm's MLA attention reads k_pe as an array where a quantized cache returns a tuple.

deepseek_v3 caches the latent as keys and k_pe as values, then computes
``q_pe @ k_pe.swapaxes(-1, -2)`` on what the cache returns
(mlx_lm/models/deepseek_v3.py, DeepseekV3Attention.__call__). A QuantizedKVCache
returns (packed, scales, biases) lists, so mlx-lm's solo generate_step(kv_bits=4)
raises AttributeError on the first step after conversion. Exits 1 while it
raises, 0 once it runs.
"""
# kvparity-defect: solo-kv-bits-raises
# kvparity-match: mlx_lm/models/deepseek_v3.py
# kvparity-match: swapaxes

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import deepseek_v3

CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 512,
    "q_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 256,
}

mx.random.seed(0)
model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(CONFIG))
try:
    for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3,
                           kv_bits=4, kv_group_size=64, quantized_kv_start=0):
        pass
except AttributeError as error:
    print(f"DEFECT: generate_step(kv_bits=4) on deepseek_v3 raises AttributeError: {error}")
    sys.exit(1)
print("fixed: generate_step(kv_bits=4) on deepseek_v3 runs")
