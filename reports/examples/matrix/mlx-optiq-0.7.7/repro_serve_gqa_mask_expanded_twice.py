"""optiq 0.7.7: batched quantized KV + GQA dies in quantized SDPA's reshape.

`optiq serve --kv-bits N` installs optiq's fused quantized SDPA (cli.py serve_cmd)
and only then calls patch_rotating_to_quantized() (serve.install_quantized_kv,
install_batch_kv_quant). Its _patch_quantized_sdpa_mask_for_gqa() inspects the
*fused* wrapper's source, misses upstream's own `mx.expand_dims(mask, -3)`, and adds a
second repeat axis to the mask. With batch size B > 1 the scores broadcast to
(B, B, n_kv, n_rep, L, S) and `mx.reshape(out, (B, n_q_heads, L, D))` fails.
"""
import sys
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.llama import Model, ModelArgs
from optiq.runtime.fused_quant_sdpa import install as install_fused_sdpa
from optiq.runtime.kv import patch_rotating_to_quantized
from optiq.runtime.kv.batch import install_batch_kv_quant

# The order `optiq serve --kv-bits 4` uses (cli.py serve_cmd).
install_fused_sdpa()
patch_rotating_to_quantized()  # serve.install_quantized_kv
install_batch_kv_quant(default=(4, 64))

mx.random.seed(0)
args = ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2,
                 intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0)
model = Model(args)  # GQA: 4 query heads over 2 KV heads
mx.eval(model.parameters())

gen = BatchGenerator(model, max_tokens=4)
gen.insert([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], max_tokens=[4, 4])  # 2 requests
try:
    done = 0
    for _ in range(50):
        _, responses = gen.next()
        done += sum(r.finish_reason is not None for r in responses)
        if done == 2:
            break
except ValueError as e:
    print(f"FAIL: {e}")
    sys.exit(1)
print(f"OK: {done}/2 sequences finished")
sys.exit(0 if done == 2 else 1)
