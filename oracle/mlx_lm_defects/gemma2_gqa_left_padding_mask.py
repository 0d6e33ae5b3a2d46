"""gemma2's own attention repeats mlx-lm's GQA left-padding mask bug, on its dense path.

gemma2 does its own attention (soft-capped scores, mlx_lm/models/gemma2.py,
Attention.__call__): with grouped-query heads it reshapes the scores to
(B, kv_heads, repeats, L, S) and adds the batch's (B, 1, L, S) mask without
expanding it, so row i's left-padding mask lands on kv head i. The same bug was
fixed in base.py's quantized attention in 0.32.0 ('mask = mx.expand_dims(mask,
-3)'); gemma2's copy still has it. With 2 kv heads, a batch of 2 rows gets
wrong logits and a batch of 3 raises a broadcast error. Exits 1 while a
left-padded batch differs from each prompt alone (or raises), 0 once it equals.
"""

import sys

import mlx.core as mx
from mlx_lm.models import gemma2
from mlx_lm.models.cache import BatchKVCache, KVCache

CONFIG = {
    "model_type": "gemma2", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "vocab_size": 256, "query_pre_attn_scalar": 256.0, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 6, 5, 3], [5, 8]]

mx.random.seed(0)
model = gemma2.Model(gemma2.ModelArgs.from_dict(CONFIG))


def alone(prompt):
    return model(mx.array([prompt]), cache=[KVCache() for _ in model.layers])[0, -1]


def batched(prompts):
    """Last-token logits of ``prompts`` left-padded into one batch, as BatchGenerator pads them."""
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    return model(tokens, cache=[BatchKVCache(padding) for _ in model.layers])[:, -1]


try:
    mx.eval(batched(PROMPTS))
except ValueError as error:
    three = f"a batch of 3 raises ValueError: {str(error).splitlines()[0]}"
else:
    three = ""
together = batched(PROMPTS[:2])
diff = max(mx.abs(together[row] - alone(p)).max().item() for row, p in enumerate(PROMPTS[:2]))
if three or diff > 1e-3:
    print(f"DEFECT: gemma2 (4 heads, 2 kv heads) left-padded batch: a batch of 2 differs from each prompt "
          f"alone by {diff:.3g} in logits; {three or 'a batch of 3 runs'}")
    sys.exit(1)
print(f"fixed: gemma2's left-padded batches of 2 and 3 equal each prompt alone (max logit diff {diff:.3g})")
