"""A zoo of mlx-lm's own architectures: tiny seeded configs, built by mlx-lm's classes.

One `Architecture` per entry of `ZOO`, named by mlx-lm's module name (the config's
`model_type`; a variant adds a suffix, `gemma4_text-kv_shared`). Its config is a
config.json of that architecture (a nested `text_config` where the family's real
config has one), with the family's real head dims and layer pattern, the fewest
layers that show the pattern once, and otherwise tiny (hidden 64-256, vocab
`VOCAB_SIZE`, few heads and experts, sliding windows of 16 tokens).
`build_zoo_model` builds it through mlx-lm's `Model`/`ModelArgs` for its model_type
and draws its weights with `_init_parameters` (same seed and scales as the random
models).

Each entry also records what mlx-lm does with it, so a test can hold mlx-lm to it:
`layout`, the class of each cache `make_prompt_cache(model)` returns (KV-shared
and MLP-only layers have none, so it can be shorter than the model); `dims`, per
KV cache class, (kv heads, key dim, value dim) as the model writes them; and
`kv_bits`, what mlx-lm's solo `generate_step(..., kv_bits=4,
kv_group_size=KV_GROUP_SIZE, quantized_kv_start=0, max_tokens=8)` does: `RUNS`,
or the exception it raises with mlx-lm's innermost line (`solo_kv_bits` measures it).
"""

import dataclasses
import importlib
import math
import sys
import traceback
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

from .weights import DTYPES, SEED, VOCAB_SIZE, _init_parameters

__all__ = [
    "KV_GROUP_SIZE",
    "RECORDED_ON",
    "RUNS",
    "ZOO",
    "Architecture",
    "build_zoo_model",
    "cache_layout",
    "config_field_errors",
    "quantized_layout",
    "solo_kv_bits",
    "written_dims",
    "zoo_config",
]

RUNS = "runs"
KV_BITS, KV_GROUP_SIZE = 4, 32  # 32 divides every key and value dim in the zoo
WINDOW = 16  # every sliding window: a schedule of a few dozen tokens crosses it

# What mlx-lm's solo kv_bits run raises, where it does not run (first line), as
# RECORDED_ON raises it; another release may raise it from another line.
RECORDED_ON = "0.32.2"
ROTATING_NYI = "NotImplementedError: RotatingKVCache Quantization NYI @ mlx_lm/models/cache.py:554"
GEMMA2_GQA = ("TypeError: expand_dims(): incompatible function arguments. The following "
              "argument types are supported: @ mlx_lm/models/gemma2.py:89")
KV_SHARED_SDPA = ("TypeError: scaled_dot_product_attention(): incompatible function arguments. The "
                  "following argument types are supported: @ mlx_lm/models/base.py:132")
MLA_K_PE = ("AttributeError: 'list' object has no attribute 'swapaxes' @ "
            "mlx_lm/models/deepseek_v3.py:146")


@dataclass(frozen=True)
class Architecture:
    name: str  # mlx-lm's model_type, plus a variant suffix
    note: str  # what it stands for
    config: dict  # mlx-lm config.json fields
    layout: Tuple[str, ...]  # make_prompt_cache's class per cache (see cache_layout)
    dims: Dict[str, Tuple[int, int, int]]  # KV cache class -> (kv heads, key dim, value dim)
    kv_bits: str  # RUNS, or "Error: message @ mlx_lm/file.py:line"


def _arch(name, note, config, layout, dims, kv_bits=RUNS):
    return Architecture(name, note, config, tuple(layout), dims, kv_bits)


# Granite divides its logits by logits_scaling (8-16 in real checkpoints), Cohere
# multiplies them by logit_scale (0.0625): right for a trained head, against a
# random one they make every next-token distribution near uniform.
UNSCALED = 1.0

KV, ROT, ARR, CHUNK = "KVCache", "RotatingKVCache", "ArraysCache", "ChunkedKVCache"
FALCON = "CacheList(ArraysCache,KVCache)"

_ENTRIES = [
    _arch("llama", "Llama 3.2 1B: GQA, head_dim 64", {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE,
        "rope_theta": 500000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 64, 64)}),
    _arch("qwen2", "Qwen2.5 0.5B: GQA, qkv bias, head_dim 64 (hidden / heads)", {
        "model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 64, 64)}),
    _arch("qwen3", "Qwen3: q/k norms, explicit head_dim 128", {
        "model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("qwen3_moe", "Qwen3-30B-A3B: sparse MoE in every layer, head_dim 128", {
        "model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("qwen3_next", "Qwen3-Next: gated DeltaNet, full attention every 4th, head_dim 256", {
        "model_type": "qwen3_next", "hidden_size": 128, "num_hidden_layers": 4,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 256, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
        "full_attention_interval": 4, "tie_word_embeddings": False,
    }, [ARR, ARR, ARR, KV], {KV: (1, 256, 256)}),
    _arch("qwen3_5", "Qwen3.5 dense: qwen3_next's layers in a text_config, head_dim 256", {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 128, "num_hidden_layers": 4,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 256, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]},
        },
    }, [ARR, ARR, ARR, KV], {KV: (1, 256, 256)}),
    _arch("qwen3_5_moe", "Qwen3.5 MoE: qwen3_5 with sparse experts and a shared expert", {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 128, "num_hidden_layers": 4,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 256, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 64, "moe_intermediate_size": 64,
            "norm_topk_prob": True, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]},
        },
    }, [ARR, ARR, ARR, KV], {KV: (1, 256, 256)}),
    _arch("gemma", "Gemma 2B: one kv head (MQA), head_dim 256, tied head", {
        "model_type": "gemma", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
    }, [KV, KV], {KV: (1, 256, 256)}),
    _arch("gemma2", "Gemma 2 2B: GQA, head_dim 256, soft-capping, its own attention", {
        "model_type": "gemma2", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "query_pre_attn_scalar": 256.0, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }, [KV, KV], {KV: (2, 256, 256)}, GEMMA2_GQA),
    _arch("gemma3_text", "Gemma 3 1B: five sliding layers, then one global; MQA, head_dim 256", {
        "model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 6,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": WINDOW,
        "sliding_window_pattern": 6, "max_position_embeddings": 4096,
    }, [ROT] * 5 + [KV], {ROT: (1, 256, 256), KV: (1, 256, 256)}, ROTATING_NYI),
    _arch("gemma4_text", "Gemma 4 E2B: four sliding (head_dim 256), one global (512), per-layer inputs", {
        "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 5,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "sliding_window": WINDOW,
        "sliding_window_pattern": 5, "max_position_embeddings": 4096,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
    }, [ROT] * 4 + [KV], {ROT: (1, 256, 256), KV: (1, 512, 512)}, ROTATING_NYI),
    _arch("gemma4_text-kv_shared", "Gemma 4 E2B with KV sharing: the last five layers read "
          "the KV of the last earlier layer of their kind (no cache of their own)", {
        "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 10,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 5,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "sliding_window": WINDOW,
        "sliding_window_pattern": 5, "max_position_embeddings": 4096,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
    }, [ROT] * 4 + [KV], {ROT: (1, 256, 256), KV: (1, 512, 512)}, ROTATING_NYI),
    _arch("gemma4_text-kv_shared_full", "Gemma 4 with KV sharing and every layer full attention: the "
          "last two layers read the second's KV (no sliding layer, so kv_bits reaches the shared ones)", {
        "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 4,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 256, "global_head_dim": 256, "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB_SIZE,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "sliding_window": WINDOW,
        "layer_types": ["full_attention"] * 4, "max_position_embeddings": 4096,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
    }, [KV] * 2, {KV: (1, 256, 256)}, KV_SHARED_SDPA),
    _arch("mistral3", "Mistral Small 3.1: a llama text_config (model_type mistral), head_dim 128", {
        "model_type": "mistral3",
        "text_config": {
            "model_type": "mistral", "hidden_size": 128, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE,
            "rope_theta": 1000000000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("mixtral", "Mixtral 8x7B: sparse MoE, GQA, head_dim 128 (hidden / heads)", {
        "model_type": "mixtral", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }, [KV, KV], {KV: (1, 128, 128)}),
    _arch("phi3", "Phi-3 mini: fused qkv, no GQA, head_dim 96", {
        "model_type": "phi3", "hidden_size": 192, "num_hidden_layers": 2,
        "intermediate_size": 384, "num_attention_heads": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 96, 96)}),
    _arch("phimoe", "Phi-3.5-MoE: sparse MoE, GQA, head_dim 128", {
        "model_type": "phimoe", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        # Phi-3.5-MoE's LongRoPE block (one factor per rotated pair); mlx-lm 0.31 requires it.
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64,
                         "short_mscale": 1.0, "long_mscale": 1.0},
    }, [KV, KV], {KV: (1, 128, 128)}),
    _arch("gpt_oss", "gpt-oss: sliding and full layers alternating, attention sinks, MoE", {
        "model_type": "gpt_oss", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "rope_theta": 150000,
        "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
    }, [ROT, KV], {ROT: (2, 64, 64), KV: (2, 64, 64)}, ROTATING_NYI),
    _arch("deepseek_v2", "DeepSeek-V2-Lite: MLA expanded per head, keys 192 (nope 128 + rope 64), "
          "values 128; first layer dense, then MoE", {
        "model_type": "deepseek_v2", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "topk_method": "greedy", "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
    }, [KV, KV], {KV: (2, 192, 128)}),
    _arch("deepseek_v3", "DeepSeek-V3: MLA caching the latent (512) as keys and k_pe (64) as "
          "values, one head; first layer dense, then MoE", {
        "model_type": "deepseek_v3", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 512,
        "q_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    }, [KV, KV], {KV: (1, 512, 64)}, MLA_K_PE),
    _arch("minicpm3", "MiniCPM3 4B: MLA expanded per head, keys 96 (nope 64 + rope 32), values 64", {
        "model_type": "minicpm3", "hidden_size": 128, "dim_model_base": 256,
        "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 2, "q_lora_rank": 64, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "kv_lora_rank": 64, "scale_depth": 1.4, "scale_emb": 12,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
        "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 4096,
                         "short_factor": [1.0] * 16, "long_factor": [1.0] * 16},
    }, [KV, KV], {KV: (2, 96, 64)}),
    _arch("glm4", "GLM-4-0414: GQA, half rotary, qkv bias, head_dim 128", {
        "model_type": "glm4", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "attention_bias": True, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("glm4_moe", "GLM-4.5: first layer dense, then MoE with a shared expert, q/k norms", {
        "model_type": "glm4_moe", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 128, "n_group": 1, "topk_group": 1,
        "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("granite", "Granite 3: llama with embedding, attention, residual and logit multipliers", {
        "model_type": "granite", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "logits_scaling": UNSCALED,
        "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "max_position_embeddings": 4096,
        "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 64, 64)}),
    _arch("granitemoehybrid", "Granite 4.0-H: Mamba-2 and attention 9:1 (first attention at "
          "layer 5), MoE with a shared expert, head_dim 128 (hidden / heads)", {
        "model_type": "granitemoehybrid", "hidden_size": 256, "num_hidden_layers": 6,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "attention_bias": False,
        "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "logits_scaling": UNSCALED, "residual_multiplier": 0.22,
        "layer_types": ["mamba"] * 5 + ["attention"], "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 128, "mamba_n_heads": 8, "mamba_d_head": 32,
        "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_n_groups": 1, "mamba_conv_bias": True, "position_embedding_type": "nope",
        "rope_theta": 10000.0,  # unused without RoPE; mlx-lm 0.31's ModelArgs requires it
        "tie_word_embeddings": False,
    }, [ARR] * 5 + [KV], {KV: (1, 128, 128)}),
    _arch("lfm2", "LFM2: short-convolution layers with attention in between", {
        "model_type": "lfm2", "vocab_size": VOCAB_SIZE, "hidden_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "norm_eps": 1e-5, "conv_bias": False,
        "conv_L_cache": 3, "block_dim": 256, "block_ff_dim": 512,
        "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True, "rope_theta": 1000000.0,
        "layer_types": ["conv", "conv", "full_attention"],
    }, [ARR, ARR, KV], {KV: (2, 64, 64)}),
    _arch("nemotron_h", "Nemotron-H: Mamba-2, MLP-only and attention blocks (M-*-: the MLP "
          "blocks have no cache), head_dim 128", {
        "model_type": "nemotron_h", "vocab_size": VOCAB_SIZE, "hidden_size": 128,
        "num_hidden_layers": 4,  # the pattern's length; mlx-lm 0.31's ModelArgs requires it
        "intermediate_size": 256, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 32,
        "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
        "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
        "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": "M-*-",
        "time_step_limit": [0.0, float("inf")],
    }, [ARR, KV], {KV: (2, 128, 128)}),
    _arch("falcon_h1", "Falcon-H1: attention and Mamba-2 side by side in every layer "
          "(one CacheList each)", {
        "model_type": "falcon_h1", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_head": 32,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
        "mamba_chunk_size": 16, "mamba_rms_norm": True, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [FALCON, FALCON], {KV: (2, 64, 64)}),
    _arch("olmo2", "OLMo 2 1B: q/k norms over all heads, no GQA, head_dim 128", {
        "model_type": "olmo2", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "rope_theta": 500000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (2, 128, 128)}),
    _arch("olmo3", "OLMo 3: three sliding layers, then one full, head_dim 128", {
        "model_type": "olmo3", "hidden_size": 256, "num_hidden_layers": 4,
        "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096, "sliding_window": WINDOW, "rope_theta": 500000.0,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "tie_word_embeddings": False,
    }, [ROT] * 3 + [KV], {ROT: (2, 128, 128), KV: (2, 128, 128)}, ROTATING_NYI),
    _arch("cohere2", "Command R7B: three sliding layers, then one global; tied head", {
        "model_type": "cohere2", "hidden_size": 256, "head_dim": 128,
        "num_hidden_layers": 4, "intermediate_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rope_theta": 50000.0, "vocab_size": VOCAB_SIZE,
        "layer_norm_eps": 1e-5, "logit_scale": UNSCALED, "sliding_window": WINDOW,
        "sliding_window_pattern": 4,
    }, [ROT] * 3 + [KV], {ROT: (1, 128, 128), KV: (1, 128, 128)}, ROTATING_NYI),
    _arch("llama4_text", "Llama 4 text: q/k norms, no RoPE on every 4th layer, head_dim 128", {
        "model_type": "llama4_text", "hidden_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 4, "vocab_size": VOCAB_SIZE, "intermediate_size": 128,
        "intermediate_size_mlp": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "head_dim": 128, "tie_word_embeddings": False,
        "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True,
    }, [KV] * 4, {KV: (2, 128, 128)}),
    _arch("llama4", "Llama 4 Scout's text: chunked attention (ChunkedKVCache) on three layers in four, MoE", {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": WINDOW,
            "head_dim": 128, "hidden_size": 128, "interleave_moe_layer_step": 2, "intermediate_size": 128,
            "intermediate_size_mlp": 256, "max_position_embeddings": 4096, "num_attention_heads": 4,
            "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
            "num_local_experts": 2, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 500000.0,
            "use_qk_norm": True,
            "vocab_size": VOCAB_SIZE,
        },
    }, [CHUNK] * 3 + [KV], {KV: (2, 128, 128)}),
    _arch("smollm3", "SmolLM3 3B: llama with no RoPE on every 4th layer, head_dim 128", {
        "model_type": "smollm3", "hidden_size": 256, "num_hidden_layers": 4,
        "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 5000000.0,
        "max_position_embeddings": 4096, "no_rope_layer_interval": 4,
        "tie_word_embeddings": False,
    }, [KV] * 4, {KV: (1, 128, 128)}),
    _arch("starcoder2", "StarCoder2 3B: layer norms with bias, GQA, head_dim 128", {
        "model_type": "starcoder2", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
        "norm_epsilon": 1e-5, "vocab_size": VOCAB_SIZE, "rope_theta": 100000.0,
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (1, 128, 128)}),
    _arch("exaone4", "EXAONE 4.0 32B: three local (sliding) layers, then one global (no RoPE)", {
        "model_type": "exaone4", "hidden_size": 128, "num_hidden_layers": 4,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rope_scaling": None, "sliding_window": WINDOW, "sliding_window_pattern": "LLLG",
        "tie_word_embeddings": False,
    }, [ROT] * 3 + [KV], {ROT: (2, 128, 128), KV: (2, 128, 128)}, ROTATING_NYI),
    _arch("hunyuan", "Hunyuan-A13B: MoE with a shared expert, q/k norms, NTK-alpha RoPE", {
        "model_type": "hunyuan", "vocab_size": VOCAB_SIZE, "hidden_size": 256,
        "num_hidden_layers": 2, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "attention_bias": False,
        "moe_topk": 2, "num_experts": 4, "num_shared_expert": 1,
        "use_mixed_mlp_moe": True, "use_qk_norm": True, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "use_cla": False, "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (1, 128, 128)}),
    _arch("internlm3", "InternLM3 8B: GQA, dynamic RoPE scaling, head_dim 128", {
        "model_type": "internlm3", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
        "rope_theta": 50000000.0, "rope_scaling": {"factor": 6.0, "rope_type": "dynamic"},
        "tie_word_embeddings": False,
    }, [KV, KV], {KV: (1, 128, 128)}),
]

ZOO: Dict[str, Architecture] = {a.name: a for a in _ENTRIES}


def _architecture(name: str) -> Architecture:
    if name not in ZOO:
        raise ValueError(f"unknown zoo architecture {name!r}; available: {', '.join(ZOO)}")
    return ZOO[name]


def _dtype_name(dtype: mx.Dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def zoo_config(name: str, dtype: mx.Dtype = mx.float32) -> dict:
    """The entry's config.json fields, with the seed and dtype (as RandomModel.config)."""
    return {**_architecture(name).config, "seed": SEED, "dtype": _dtype_name(dtype)}


def _text_args_class(config: dict) -> Optional[type]:
    """The ModelArgs class mlx-lm reads a `text_config` with: the TextModelArgs of
    the Model's module (or of a module it inherits from), else the ModelArgs of
    the text_config's own model_type (mistral3's llama or ministral3)."""
    if "text_config" not in config:
        return None
    for cls in _get_classes(config)[0].__mro__:
        module = sys.modules[cls.__module__]
        text_args = getattr(module, "TextModelArgs", None) or getattr(module, "TextArgs", None)
        if text_args is not None:
            return text_args
    return _get_classes(config["text_config"])[1]


def config_field_errors(config: dict) -> list:
    """Keys that ModelArgs.from_dict would silently drop: each config key (and
    each text_config key) that is not a field of the architecture's ModelArgs."""
    config = {k: v for k, v in config.items() if k not in ("seed", "dtype")}
    checks = [("", config, _get_classes(config)[1])]
    if "text_config" in config:
        checks.append(("text_config.", config["text_config"], _text_args_class(config)))
    errors = []
    for prefix, fields, args_class in checks:
        known = {f.name for f in dataclasses.fields(args_class)}
        errors += [f"{prefix}{k} is not a field of {args_class.__module__}."
                   f"{args_class.__name__}" for k in fields if k not in known]
    return errors


def _fix_parameters(model: nn.Module, config: dict):
    """The one place where `_init_parameters`'s draws are not what a model needs.

    - SSM decays (Mamba-2 and gated DeltaNet's `A_log`, `dt_bias`, `D`): drawn as
      1-D weights (1 + N(0, 0.1^2)), every head would forget its state within a step or
      two (A = -e, dt = softplus(1)); give them real checkpoints' spread, A in
      [-16, -1] and dt in [0.001, 0.1] across heads, D = 1, so state carries over
      many tokens (and a pad token taken into it shows).
    - A head not named `lm_head` (llama4_text's `output`) gets lm_head's 3x scale.
    - A tied head (no head of its own): with the final norm's weight about 1, the
      logits are about the input embedding times itself and every token predicts
      itself; draw that weight zero-mean at the head's scale instead, for the
      norm as the model computes it (Gemma's norms scale by 1 + weight).
    """
    params = dict(tree_flatten(model.parameters()))
    updates = []
    for path, p in params.items():
        leaf, n = path.rsplit(".", 1)[-1], p.shape[-1]
        ramp = mx.linspace(0.0, 1.0, n)
        if leaf == "A_log":
            updates.append((path, mx.log(1.0 + 15.0 * ramp)))
        elif leaf == "dt_bias":
            dt = mx.exp(math.log(1e-3) + ramp * (math.log(1e-1) - math.log(1e-3)))
            updates.append((path, dt + mx.log(-mx.expm1(-dt))))  # softplus(x) = dt
        elif leaf == "D" and p.ndim == 1:
            updates.append((path, mx.ones((n,))))
    vocab = config.get("text_config", config)["vocab_size"]
    heads = [k for k, p in params.items() if p.ndim == 2 and p.shape[0] == vocab
             and "layers." not in k and "embed" not in k]
    for path in heads:
        if not path.endswith("lm_head.weight"):
            updates.append((path, params[path].astype(mx.float32) * 3.0))
    if not heads:
        path, norm = _final_norm(model)
        hidden = norm.weight.shape[0]
        with mx.stream(mx.cpu):  # as _init_parameters: the device does not change the draw
            key = mx.random.key(config["seed"] + 1)
            weight = mx.random.normal((hidden,), key=key) * 3.0 * hidden ** -0.5
        updates.append((path + ".weight", weight - _norm_offset(norm)))
    if updates:
        dtype = next(iter(params.values())).dtype
        model.load_weights([(k, v.astype(dtype)) for k, v in updates], strict=False)


def _final_norm(model: nn.Module):
    """The norm just before a tied head: the one top-level (not per-layer) norm."""
    norms = [(k, m) for k, m in model.named_modules()
             if "layers" not in k and "norm" in k.rsplit(".", 1)[-1] and hasattr(m, "weight")]
    if len(norms) != 1:
        raise ValueError(f"a tied head's final norm is not one module: {[k for k, _ in norms]}")
    return norms[0]


def _norm_offset(norm: nn.Module) -> int:
    """What a norm adds to its weight (1.0 for Gemma's 1 + weight, else 0)."""
    weight = norm.weight
    norm.weight = mx.zeros_like(weight)
    out = norm(mx.ones((1, weight.shape[0]), dtype=weight.dtype))
    norm.weight = weight
    return round(out.abs().max().item())


def build_zoo_model(name: str, dtype: mx.Dtype = mx.float32):
    """The entry's model through mlx-lm's own classes for its model_type, with
    seeded random weights, eval'd; and the config used (JSON-serialisable).
    MoE entries run in float32 only on MLX's CPU backend (its gather_mm is
    float32-only there), hence the float32 default."""
    config = zoo_config(name, dtype)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _init_parameters(model, config["seed"], dtype)
    _fix_parameters(model, config)
    model.eval()
    mx.eval(model.parameters())
    return model, config


def cache_layout(cache) -> Tuple[str, ...]:
    """The class of each cache, a CacheList as `CacheList(member,...)`."""
    def name(c):
        if isinstance(c, CacheList):
            return f"CacheList({','.join(type(m).__name__ for m in c.caches)})"
        return type(c).__name__
    return tuple(name(c) for c in cache)


def written_dims(cache) -> Dict[str, set]:
    """Per KV cache class, the set of (kv heads, key dim, value dim) of the keys
    and values its caches (CacheList members too) hold, after a forward of one
    sequence shorter than every sliding window."""
    dims: Dict[str, set] = {}
    for c in cache:
        for m in c.caches if isinstance(c, CacheList) else [c]:
            if isinstance(m, (KVCache, RotatingKVCache)) and m.keys is not None:
                keys, values = m.keys[..., : m.offset, :], m.values[..., : m.offset, :]
                dims.setdefault(type(m).__name__, set()).add(
                    (keys.shape[1], keys.shape[-1], values.shape[-1]))
    return dims


def _mlx_lm_frame(tb) -> str:
    """The innermost traceback line inside mlx_lm, as `mlx_lm/path.py:line`."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if "/mlx_lm/" in frame.filename:
            where = f"mlx_lm/{frame.filename.rsplit('/mlx_lm/', 1)[1]}:{frame.lineno}"
    return where


def solo_kv_bits(model: nn.Module, prompt: mx.array, max_tokens: int = 8):
    """What mlx-lm's solo `generate_step` with kv_bits does on `model`: (RUNS, the
    cache layout it leaves), or (`Error: first line of message @ mlx_lm/file.py:line`,
    None)."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    cache = make_prompt_cache(model)
    try:
        for _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=cache,
                               kv_bits=KV_BITS, kv_group_size=KV_GROUP_SIZE,
                               quantized_kv_start=0):
            pass
    except Exception as e:  # mlx-lm's own outcome, recorded, never ours
        message = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {message} @ {_mlx_lm_frame(e.__traceback__)}", None
    return RUNS, cache_layout(cache)


def quantized_layout(layout) -> Tuple[str, ...]:
    """The layout mlx-lm's `maybe_quantize_kv_cache` leaves: it converts a cache
    with `to_quantized` (a plain KVCache) and leaves the rest, CacheList included."""
    return tuple("QuantizedKVCache" if kind == KV else kind for kind in layout)
