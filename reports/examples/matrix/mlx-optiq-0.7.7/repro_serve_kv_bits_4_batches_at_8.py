"""mlx-optiq 0.7.7: `optiq serve --kv-bits 4` batches prompts in 8-bit caches.

The same defect as repro_merge_ignores_row_bits.py, reached through optiq's
own server path: ``install_batch_kv_quant(default=(4, 64))`` is what
``optiq serve --kv-bits 4`` calls (optiq/serve.py:123), and it teaches
mlx-lm's ``BatchGenerator`` to give each new request empty 4-bit rows
(optiq/runtime/kv/batch.py:427). The generator merges those rows to prefill
the prompts, and the merge keeps 8 bits, group 64 (batch.py:229-231). A
small random Llama, two prompts, greedy. Runs with plain mlx, mlx-lm and
mlx-optiq; exits 1 while the defect is there, 0 once it is gone.
"""

import sys

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from optiq.runtime.kv.batch import install_batch_kv_quant

BITS, GROUP_SIZE = 4, 64  # optiq serve --kv-bits 4 (its default --kv-group-size is 64)

mx.random.seed(0)
model = llama.Model(llama.ModelArgs(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    head_dim=64, tie_word_embeddings=True))
mx.eval(model.parameters())

assert install_batch_kv_quant(default=(BITS, GROUP_SIZE)), "optiq's hook found no place to install"
generator = BatchGenerator(model, max_tokens=4)
generator.insert([[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=[4, 4])
held = set()
for _ in range(3):
    generator.next()
    for batch in (generator._prompt_batch, generator._generation_batch):  # what the engine holds
        held.update((type(c).__name__, c.bits, c.group_size) for c in batch.prompt_cache if hasattr(c, "bits"))
generator.close()

print(f"asked for bits {BITS}, group_size {GROUP_SIZE}; the engine's batch caches held: {sorted(held)}")
if not held:
    print("no quantized batch cache was seen: cannot judge")
    sys.exit(125)
wrong = {h for h in held if h[1:] != (BITS, GROUP_SIZE)}
print("holds" if not wrong else f"DEFECT: the server batches KV at {sorted({h[1:] for h in wrong})}")
sys.exit(1 if wrong else 0)
