"""nemotron_h's Mamba-2 mixer ignores a right-padded batch's lengths: a short row's SSM state takes in the pads.

BatchGenerator right-pads a batch's prompts and calls each cache's
prepare(lengths=..., right_padding=...) (mlx_lm/generate.py). nemotron_h's
_conv reads cache.lengths, but its _ssm calls ssm_update without them
(mlx_lm/models/nemotron_h.py, 'y, state = ssm_update(' passes no lengths;
mamba2.py passes them), so the state of a row shorter than the batch keeps
updating through its pad tokens. Dense batching is wrong with it, whatever the
KV cache. Exits 1 while the short row's SSM state after the batched prompt
differs from the same prompt's state alone, 0 once they are equal.
"""

import sys

import mlx.core as mx
from mlx_lm.models import nemotron_h
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

CONFIG = {  # Mamba-2, MLP, attention, MLP: the MLP blocks have no cache
    "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 32, "mamba_proj_bias": False,
    "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
    "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": "M-*-",
    "time_step_limit": [0.0, float("inf")],
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]

mx.random.seed(0)
model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(CONFIG))

# One prompt alone: mlx-lm's own prompt cache.
short = make_prompt_cache(model)
model(mx.array([PROMPTS[1]]), cache=short)

# Both together, as BatchGenerator prefills them: right-padded, each cache told the lengths.
lengths = [len(p) for p in PROMPTS]
padding = [max(lengths) - n for n in lengths]
batch = [ArraysCache(len(c.cache)) if isinstance(c, ArraysCache) else BatchKVCache([0, 0])
         for c in make_prompt_cache(model)]
for c in batch:
    c.prepare(lengths=lengths, right_padding=padding)
model(mx.array([p + [0] * pad for p, pad in zip(PROMPTS, padding)]), cache=batch)
for c in batch:
    c.finalize()

ssm = next(i for i, c in enumerate(batch) if isinstance(c, ArraysCache))
conv_diff, state_diff = (mx.abs(batch[ssm][k][1] - short[ssm][k][0]).max().item() for k in (0, 1))
if state_diff > 1e-5:
    print(f"DEFECT: nemotron_h's SSM state for a {lengths[1]}-token row padded by {padding[1]} differs from "
          f"the prompt alone by {state_diff:.3g} (its conv state, which reads lengths, by {conv_diff:.3g})")
    sys.exit(1)
print(f"fixed: nemotron_h's SSM state of a padded row equals the prompt alone (diff {state_diff:.3g})")
