"""mlx-vlm: a BatchGenerator whose completion_batch_size is below its
prefill_batch_size never admits a request: next() returns nothing, forever.

BatchGenerator._next (mlx_vlm/generate/ar.py:3119 in 0.7.10, :3055 in
0.7.2) takes waiting prompts only when ``completion_batch_size - active >=
prefill_batch_size``. With ``completion_batch_size=4`` and the default
``prefill_batch_size`` (8, generate/common.py:30) that never holds, even
with nothing active. The constructor keeps both as given (ar.py:2569-2570);
mlx-lm's BatchGenerator raises the completion batch to the prefill batch
(``max(completion_batch_size, prefill_batch_size)``, mlx_lm/generate.py:1573
in 0.32.2), so the same arguments serve there.

mlx-vlm's server builds its BatchGenerator with neither argument
(server/generation.py:1792), 32 and 8: it is not affected. Code that builds
the class with a completion batch below 8 (and no prefill batch) is.

Plain mlx, mlx-lm (a tiny random llama) and mlx-vlm; exits 1 while the
defect is there, 0 once such a generator produces the request's tokens.
The same request with prefill_batch_size=2 is served (the control).
Run: python completion_below_prefill_admits_nothing.py
"""

import sys

import mlx.core as mx
from mlx_lm.models import llama
from mlx_vlm.generate.ar import BatchGenerator
from mlx_vlm.utils import StoppingCriteria

STEPS, MAX_TOKENS = 50, 3


class TextModel:
    """An mlx-lm model as mlx-vlm's engine calls one: prompts as inputs_embeds."""

    def __init__(self, model):
        self.model, self.layers, self.language_model = model, model.layers, self

    def __call__(self, inputs, cache=None, inputs_embeds=None, **kwargs):
        return self.model(inputs, cache=cache, input_embeddings=inputs_embeds)


class Processor:
    def __init__(self):
        self.stopping_criteria = StoppingCriteria([], None)


mx.random.seed(0)
model = llama.Model(llama.ModelArgs.from_dict({
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
mx.eval(model.parameters())


def tokens_out(**batch_sizes):
    """Tokens one 3-token request got within STEPS calls of next()."""
    generator = BatchGenerator(TextModel(model), Processor(), kv_bits=4, kv_group_size=32, **batch_sizes)
    prompt = [1, 2, 3]
    embeds = model.model.embed_tokens(mx.array(prompt)[None])
    generator.insert([prompt], max_tokens=[MAX_TOKENS], prompt_kwargs=[{"inputs_embeds": embeds}])
    got = 0
    for _ in range(STEPS):
        _, generated = generator.next()
        got += len(generated)
    generator.close()
    return got


control = tokens_out(completion_batch_size=4, prefill_batch_size=2)
got = tokens_out(completion_batch_size=4)
print(f"completion_batch_size=4, prefill_batch_size=2: {control} of {MAX_TOKENS} tokens in {STEPS} steps")
print(f"completion_batch_size=4, default prefill_batch_size: {got} of {MAX_TOKENS} tokens in {STEPS} steps")
if control != MAX_TOKENS:
    print("the control did not run: cannot judge here")
    sys.exit(125)
if got < MAX_TOKENS:
    print("DEFECT: the request is never admitted (completion_batch_size below prefill_batch_size)")
    sys.exit(1)
print("fixed: the request was served")
