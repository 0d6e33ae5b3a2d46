"""Seeded random weights, shared by the random models (``oracle/models.py``)
and mlx-lm's zoo (``oracle/zoo.py``): each parameter drawn from its own key."""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

# A random model's name ends in its dtype (weights and activations).
DTYPES = {"bf16": mx.bfloat16, "f32": mx.float32}
SEED = 0
VOCAB_SIZE = 512


def _init_parameters(model: nn.Module, seed: int, dtype: mx.Dtype):
    """Replace every parameter with a draw from its own key (sorted names).

    Scales keep activations O(1) through the blocks so attention and the MLP
    matter: embeddings N(0, 1), matrices N(0, 1/fan_in), norm weights
    1 + N(0, 0.1^2). The head is 3x larger so next-token distributions are
    peaked like a trained model's (entropy about 3 nats, top-1 about 0.3)
    rather than nearly uniform, which would make every argmax a near tie.
    A scalar parameter (Apertus's xIELU coefficients) keeps the value mlx-lm
    gives it: it is a setting of the function, not a weight.
    """
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    new = []
    # On the CPU whatever the default device, so a GPU does not change the draws.
    with mx.stream(mx.cpu):
        keys = mx.random.split(mx.random.key(seed), len(params))
        for (name, p), key in zip(params, keys):
            if p.ndim == 0:
                new.append((name, p.astype(dtype)))
                continue
            x = mx.random.normal(p.shape, dtype=mx.float32, key=key)
            if p.ndim == 1:
                x = 1.0 + 0.1 * x
            elif name.endswith("lm_head.weight"):
                x = x * 3.0 * p.shape[-1] ** -0.5
            elif not name.endswith("embed_tokens.weight"):
                x = x * p.shape[-1] ** -0.5
            new.append((name, x.astype(dtype)))
        mx.eval(new)
    model.update(tree_unflatten(new))
