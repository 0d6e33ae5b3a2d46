"""mlx-lm's dynamic NTK RoPE raises on a batch's per-row offsets.

A batch cache (BatchKVCache) keeps one offset per row, an mx.array, and the
attention passes it to its RoPE. internlm3's dynamic RoPE
(mlx_lm/models/rope_utils.py, DynamicNTKScalingRoPE.__call__) computes
max(x.shape[-2] + offset, max_position_embeddings) in Python, which converts
the offset to a scalar and raises for two or more rows: mlx-lm cannot batch
this model. Exits 1 while a batch of 2 raises, 0 once it runs.
"""
# kvparity-defect: dense-batch-raises
# kvparity-match: mlx_lm/models/rope_utils.py

import sys

import mlx.core as mx
from mlx_lm.models import internlm3
from mlx_lm.models.cache import BatchKVCache

CONFIG = {
    "model_type": "internlm3", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
    "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 256,
    "max_position_embeddings": 4096, "rope_theta": 50000000.0,
    "rope_scaling": {"factor": 6.0, "rope_type": "dynamic"}, "tie_word_embeddings": False,
}

mx.random.seed(0)
model = internlm3.Model(internlm3.ModelArgs.from_dict(CONFIG))
tokens = mx.array([[3, 1, 4, 1, 5], [0, 0, 6, 5, 3]])  # the second row left-padded by 2
try:
    mx.eval(model(tokens, cache=[BatchKVCache([0, 2]) for _ in model.layers]))
except ValueError as error:
    print(f"DEFECT: internlm3 (dynamic RoPE) on a batch of 2 with per-row offsets raises ValueError: {error}")
    sys.exit(1)
print("fixed: internlm3's dynamic RoPE runs on a batch's per-row offsets")
