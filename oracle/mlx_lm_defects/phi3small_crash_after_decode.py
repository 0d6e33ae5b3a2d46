"""phi3small (mlx-lm 0.32.2, MLX 0.32.4's CPU backend): a prefill of 5 tokens and
one decode step, then the same for the next request, end the process (glibc's "double free or
corruption" and SIGABRT, or SIGSEGV), with or without mx.disable_compile(): memory
is corrupted on the way. The calls run in a child, so this process can say so."""

import subprocess
import sys

import mlx.core as mx
from mlx_lm.models import phi3small
from mlx_lm.models.cache import make_prompt_cache

CONFIG = {"model_type": "phi3small", "hidden_size": 1024, "dense_attention_every_n_layers": 1,
          "ff_intermediate_size": 512, "gegelu_limit": 20.0, "num_hidden_layers": 2, "num_attention_heads": 8,
          "layer_norm_epsilon": 1e-05, "vocab_size": 512, "num_key_value_heads": 2, "mup_attn_multiplier": 1.0,
          "mup_use_scaling": True, "mup_embedding_multiplier": 10.0, "mup_width_multiplier": 8.0,
          "rope_embedding_base": 1000000, "rope_position_scale": 1.0, "blocksparse_block_size": 64,
          "blocksparse_num_local_blocks": 16, "blocksparse_vert_stride": 8}


def calls():
    mx.random.seed(0)
    model = phi3small.Model(phi3small.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    for _ in range(4):  # the corruption ends the process at once only most times: a few requests
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))  # a prefill
        mx.eval(model(mx.array([[6]]), cache=cache))  # one decode step


if __name__ == "__main__":
    if sys.argv[1:] == ["--calls"]:
        calls()
        sys.exit(0)
    child = subprocess.run([sys.executable, __file__, "--calls"], capture_output=True, text=True, timeout=300)
    if child.returncode < 0:
        print(f"DEFECT: requests of a prefill and a decode step on phi3small ended the process with signal {-child.returncode}")
        sys.exit(1)
    print(f"fixed: requests of a prefill and a decode step on phi3small finished (exit {child.returncode})")
    sys.exit(0 if child.returncode == 0 else 1)
