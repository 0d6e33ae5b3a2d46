"""Seeded random weights, shared by the random models (``oracle/models.py``)
and mlx-lm's zoo and config twins (``oracle/zoo.py``, ``oracle/twin.py``): each
parameter drawn from its own key, and ``fix_parameters``, where a model needs
another draw."""

import math

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


def fix_parameters(model: nn.Module, config: dict):
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
        leaf, n = path.rsplit(".", 1)[-1], p.size
        ramp = mx.linspace(0.0, 1.0, n).reshape(p.shape)  # across heads, in the parameter's own shape
        if leaf == "A_log":
            updates.append((path, mx.log(1.0 + 15.0 * ramp)))
        elif leaf == "dt_bias":
            dt = mx.exp(math.log(1e-3) + ramp * (math.log(1e-1) - math.log(1e-3)))
            updates.append((path, dt + mx.log(-mx.expm1(-dt))))  # softplus(x) = dt
        elif leaf == "D" and p.ndim == 1:
            updates.append((path, mx.ones(p.shape)))
    text = config.get("text_config", config)
    vocab = text.get("vocab_size", text.get("num_vocab"))  # Phixtral names it num_vocab
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
    """The norm just before a tied head: the one top-level (not per-layer) norm,
    or among several (Gemma 3n's per-layer input norm beside it) the one named norm."""
    norms = [(k, m) for k, m in model.named_modules()
             if "layers" not in k and "norm" in k.rsplit(".", 1)[-1] and hasattr(m, "weight")]
    if len(norms) > 1:
        norms = [(k, m) for k, m in norms if k.rsplit(".", 1)[-1] == "norm"]
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
