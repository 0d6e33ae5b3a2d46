"""gemma2's own attention cannot read a quantized cache.

gemma2 does its own attention (mlx_lm/models/gemma2.py, Attention.__call__)
instead of base.py's scaled_dot_product_attention, and with grouped-query heads
calls mx.expand_dims on the keys the cache returns. A QuantizedKVCache returns
(packed, scales, biases) tuples, so mlx-lm's solo generate_step(kv_bits=4)
raises TypeError on a Gemma 2 model. Exits 1 while it raises, 0 once it runs.
"""
# kvparity-defect: solo-kv-bits-raises
# kvparity-match: mlx_lm/models/gemma2.py
# kvparity-match: TypeError

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma2

CONFIG = {
    "model_type": "gemma2", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "vocab_size": 256, "query_pre_attn_scalar": 256.0, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

mx.random.seed(0)
model = gemma2.Model(gemma2.ModelArgs.from_dict(CONFIG))
try:
    for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3,
                           kv_bits=4, kv_group_size=64, quantized_kv_start=0):
        pass
except TypeError as error:
    print(f"DEFECT: generate_step(kv_bits=4) on gemma2 raises TypeError: {str(error).splitlines()[0]}")
    sys.exit(1)
print("fixed: generate_step(kv_bits=4) on gemma2 runs")
