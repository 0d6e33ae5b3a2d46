"""mlx-lm's kv_bits silently leaves Llama 4's chunked-attention layers dense.

llama4's make_cache (mlx_lm/models/llama4.py) gives three layers in four a
ChunkedKVCache(text_config.attention_chunk_size) and every fourth a KVCache
(llama4_text's model has no make_cache: every layer gets a KVCache).
ChunkedKVCache has no to_quantized, so maybe_quantize_kv_cache
(mlx_lm/generate.py) converts only the fourth layer and generate_step(kv_bits=4)
runs with the chunked layers dense, without a word. Exits 1 while a
ChunkedKVCache stays dense under kv_bits, 0 once every layer is quantized.
"""
# kvparity-defect: kv-bits-leaves-dense
# kvparity-match: ChunkedKVCache

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import llama4
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache

CONFIG = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 16, "head_dim": 128,
        "hidden_size": 128, "interleave_moe_layer_step": 2, "intermediate_size": 128,
        "intermediate_size_mlp": 256, "max_position_embeddings": 4096, "num_attention_heads": 4,
        "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 2,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 500000.0, "use_qk_norm": True,
        "vocab_size": 256,
    },
}

mx.random.seed(0)
model = llama4.Model(llama4.ModelArgs.from_dict(CONFIG))
cache = make_prompt_cache(model)
for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3, prompt_cache=cache,
                       kv_bits=4, kv_group_size=64, quantized_kv_start=0):
    pass
dense = [i for i, c in enumerate(cache) if isinstance(c, ChunkedKVCache)]
if dense:
    print(f"DEFECT: generate_step(kv_bits=4) on llama4 ran and left the ChunkedKVCache layers {dense} dense "
          f"(caches: {[type(c).__name__ for c in cache]})")
    sys.exit(1)
print(f"fixed: generate_step(kv_bits=4) on llama4 quantized every layer: {[type(c).__name__ for c in cache]}")
