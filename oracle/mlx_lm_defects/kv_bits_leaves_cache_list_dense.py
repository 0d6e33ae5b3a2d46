"""mlx-lm's kv_bits silently leaves a CacheList's attention cache dense.

falcon_h1 runs attention and Mamba-2 side by side in every layer, each layer one
CacheList(ArraysCache, KVCache). maybe_quantize_kv_cache (mlx_lm/generate.py)
converts only caches that have to_quantized, and CacheList has none, so
generate_step(kv_bits=4) runs to the end with every KVCache dense: the
request for quantized KV is ignored without a word. Exits 1 while a KVCache
inside a CacheList stays dense under kv_bits, 0 once it is quantized.
"""
# kvparity-defect: kv-bits-leaves-dense
# kvparity-match: CacheList

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import falcon_h1
from mlx_lm.models.cache import KVCache, make_prompt_cache

CONFIG = {
    "model_type": "falcon_h1", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_d_ssm": 128,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
    "mamba_chunk_size": 16, "mamba_rms_norm": True, "vocab_size": 256, "tie_word_embeddings": False,
}

mx.random.seed(0)
model = falcon_h1.Model(falcon_h1.ModelArgs.from_dict(CONFIG))
cache = make_prompt_cache(model)
for _ in generate_step(mx.array([1, 2, 3, 4, 5]), model, max_tokens=3, prompt_cache=cache,
                       kv_bits=4, kv_group_size=64, quantized_kv_start=0):
    pass
dense = [i for i, c in enumerate(cache) for inner in getattr(c, "caches", ()) if type(inner) is KVCache]
if dense:
    print(f"DEFECT: generate_step(kv_bits=4) on falcon_h1 ran and left the KVCache of layers {dense} dense "
          f"(caches: {[type(c).__name__ for c in cache]})")
    sys.exit(1)
print("fixed: generate_step(kv_bits=4) on falcon_h1 quantized every layer's attention cache")
