"""A tiny random twin of any architecture mlx-lm ships, from its config.json.

``shrink(config)`` keeps what decides the KV cache and shrinks the rest:

* kept: each attention layer's key and value head dims (an explicit
  ``head_dim`` where the architecture's ModelArgs takes one, else as many
  heads as keep ``hidden / heads`` what it was), query heads per kv head
  (every attention head count divided by one factor), windows, attention
  sinks, MLA ranks, RoPE settings, and weight quantization;
* shrunk: hidden size (to ``HIDDEN`` or heads x head_dim), every
  intermediate size, experts (``EXPERTS``, ``ACTIVE_EXPERTS`` per token, one
  shared) and vocabularies (``VOCAB_SIZE``);
* depth: the fewest layers (``MIN_LAYERS`` at least) whose per-layer
  caches show every kind the full depth has (cache class, key and value
  dims, kv heads, and whether some layers keep no cache of their own: KV
  sharing, MLP-only blocks), found by building the twin at each depth
  through mlx-lm and comparing, and that hold every value of each per-layer
  list or pattern string (``layer_types``, ``no_rope_layers``, ``M-*-``);
  those are cut to that depth, layer index lists keep the layers it has,
  and counts of layers (``num_kv_shared_layers``) scale with it.

The rules read field names, never an architecture's name: what a config
must hold is its architecture's ModelArgs (mlx-lm's own class for its
model_type, found as ``mlx_lm.utils`` finds it), and a required field it
lacks is refused by name. ``build_twin`` builds the shrunk config through
mlx-lm's Model and ModelArgs with seeded random weights (``oracle/weights.py``),
then quantizes it with mlx-lm's own ``quantize_model`` where the config is
weight-quantized.
"""

import contextlib
import dataclasses
import io
import math
import re
import sys
import types
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, make_prompt_cache
from mlx_lm.utils import _get_classes

from .gguf import ModelUnavailable, sha256_file
from .inputs import read_json
from .model_path import ModelPathError
from .plan import kv_dims
from .weights import DTYPES, SEED, VOCAB_SIZE, _init_parameters, fix_parameters

HIDDEN = 128  # a twin's hidden size where its head_dim is explicit
KV_HEADS = 2  # at most, where the heads divide down to it
EXPERTS, ACTIVE_EXPERTS, SHARED_EXPERTS = 4, 2, 1
INTERMEDIATE = 512  # every intermediate (MLP, expert, shared expert) size at most
PROBE = [[1, 2, 3]]
MIN_LAYERS = 2  # a cache that mixes up its layers shows only where there are two
QUANTIZATION = ("quantization", "quantization_config")

# The names architectures give one quantity (GPT-2's n_embd is Llama's hidden_size), first the usual one.
WIDTH = ("hidden_size", "n_embd", "d_model", "model_dim", "hidden_dim")
DEPTH = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers")
QUERY_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads")
KV_HEADS_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "num_attention_groups")
HEAD_DIM = ("head_dim", "hidden_size_per_head", "kv_channels")
OTHER_MODELS = ("text_config", "vision_config", "audio_config")  # their own twins, or none (not the text's)
GROUP = ("n_heads_in_group", "n_shared_head")  # query heads per kv head, kept: the heads divide down to a multiple


def named(fields: dict, names: tuple) -> Optional[str]:
    """The first of ``names`` that ``fields`` has, or None."""
    return next((name for name in names if name in fields), None)


class TwinError(ModelPathError):
    """A config that cannot be twinned: the field and the reason."""


# -- the classes mlx-lm reads a config with ---------------------------------------------


def classes(config: dict):
    """(Model, ModelArgs) of the config's model_type, as ``mlx_lm.utils`` finds them."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            return _get_classes(config)
    except ValueError as error:
        raise TwinError(f"model_type {config.get('model_type')!r}: {error}")
    except SystemExit:  # a module that needs a package not installed says so and exits (olmo's hf_olmo)
        raise ModelUnavailable(f"model_type {config.get('model_type')!r}: mlx-lm's module for it cannot be "
                               f"imported here: {' '.join(said.getvalue().split()) or 'it exited on import'}")


def text_args_class(config: dict) -> Optional[type]:
    """The ModelArgs class mlx-lm reads a `text_config` with: the TextModelArgs of
    the Model's module (or of a module it inherits from), else the ModelArgs of
    the text_config's own model_type (mistral3's llama or ministral3)."""
    if "text_config" not in config:
        return None
    for cls in classes(config)[0].__mro__:
        module = sys.modules[cls.__module__]
        for name in ("TextModelArgs", "TextArgs", "TextConfig"):
            if getattr(module, name, None) is not None:
                return getattr(module, name)
    try:
        return classes(config["text_config"])[1]
    except TwinError:  # a text model_type that is no module (qwen3_vl_text): the one model module it imports
        module = sys.modules[classes(config)[0].__module__]
        imported = [m for m in vars(module).values() if isinstance(m, types.ModuleType)
                    and m.__name__.startswith("mlx_lm.models.") and hasattr(m, "ModelArgs") and hasattr(m, "Model")]
        if len(imported) != 1:
            raise
        return imported[0].ModelArgs


def levels(config: dict):
    """(where, fields, ModelArgs class) of the config and of its text_config."""
    out = [("", config, classes(config)[1])]
    if isinstance(config.get("text_config"), dict):
        out.append(("text_config.", config["text_config"], text_args_class(config)))
    return out


def required_missing(config: dict) -> list:
    """Fields the architecture's ModelArgs requires (no default) that the config lacks."""
    missing = []
    for where, fields, args_class in levels(config):
        for f in dataclasses.fields(args_class):
            if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    and f.name not in fields and f.name != "model_type"):
                missing.append(f"{where}{f.name}")
    return missing


# -- widths ------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_fields(fields: dict) -> Dict[str, int]:
    """The attention head counts: query heads and kv heads, of every kind of attention layer."""
    return {k: v for k, v in fields.items() if _is_int(v) and v > 0
            and ("attention_heads" in k or "key_value_heads" in k or k.endswith("kv_heads")
                 or k in QUERY_HEADS or k in KV_HEADS_NAMES)}


def _divisor(heads: Dict[str, int], kv: int, groups=()) -> int:
    """The factor every head count is divided by: the smallest that leaves at
    most KV_HEADS kv heads, among those dividing every count and leaving each
    head count a multiple of every group (query heads per kv head) kept."""
    common = 0
    for v in heads.values():
        common = math.gcd(common, v)
    return next((d for d in range(1, common + 1) if common % d == 0 and kv // d <= KV_HEADS
                 and all(v // d % g == 0 for v in heads.values() for g in groups)), common)


def groups_of(fields: dict) -> list:
    """The query-heads-per-kv-head counts a config keeps (GROUP), in it or in its per-layer objects."""
    found = [fields[name] for name in GROUP if _is_int(fields.get(name))]
    for value in fields.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                found += groups_of(item)
    return found


def _shrink_value(key: str, value, hidden: Tuple[int, int]):
    """One field's twin value by what its name says it is, or the value as it is."""
    published_hidden, twin_hidden = hidden
    if isinstance(value, list) and value and all(_is_int(v) for v in value) and "intermediate" in key:
        return [min(v, INTERMEDIATE) for v in value]
    if not _is_int(value):
        return value
    if "vocab_size" in key or key == "num_vocab":
        return min(value, VOCAB_SIZE)
    if "intermediate" in key or key.endswith(("ff_dim", "ffn_dim", "ffn_hidden_size")) or key == "n_inner":
        return min(value, INTERMEDIATE)
    if "experts" in key or key in ("moe_topk", "top_k", "moe_top_k", "moe_k"):
        if any(word in key for word in ("per_tok", "topk", "top_k")) or key == "moe_k":
            return min(value, ACTIVE_EXPERTS)
        return min(value, SHARED_EXPERTS if "shared" in key else EXPERTS)
    if key in ("n_group", "topk_group", "num_expert_group"):
        return min(value, 1)
    if value == published_hidden and key not in WIDTH and ("dim" in key or "size" in key) and not any(
            word in key for word in ("head", "rank", "window", "position", "vocab", "layer")):
        return twin_hidden  # a width that is the hidden size (lfm2's block_dim)
    return value


def shrink_widths(fields: dict, args_class, explicit_head_dim: bool = True) -> dict:
    """``fields`` with every width shrunk and the attention head dims kept."""
    out = dict(fields)
    heads = head_fields(fields)
    nested = {k: v for k, v in fields.items() if isinstance(v, dict) and k not in QUANTIZATION + OTHER_MODELS
              and not k.startswith("rope")}  # the model's own settings in an object: DBRX's attn_config
    nested_heads = [(k, n, v) for k, sub in nested.items() for n, v in head_fields(sub).items()]
    width = named(fields, WIDTH) or "hidden_size"
    query = fields.get(named(fields, QUERY_HEADS))
    hidden = fields.get(width)
    d, twin_hidden = 1, None
    if heads and _is_int(query) and _is_int(hidden):
        groups = groups_of(fields)
        kv = fields.get(named(fields, KV_HEADS_NAMES)) or next(
            (v for _, n, v in nested_heads if n in KV_HEADS_NAMES),  # DBRX's attn_config.kv_n_heads
            query // min(groups) if groups else query)
        d = _divisor({**heads, **{f"{k}.{n}": v for k, n, v in nested_heads}}, kv, groups)
        out.update({k: v // d for k, v in heads.items()})
        head_dim = fields.get("head_dim") or hidden // query
        known = {f.name for f in dataclasses.fields(args_class)}
        if explicit_head_dim and "head_dim" in known:
            out["head_dim"] = head_dim
            twin_hidden = min(hidden, HIDDEN)
        else:
            twin_hidden = query // d * head_dim
        out[width] = twin_hidden
    elif _is_int(hidden):
        twin_hidden = out[width] = min(hidden, HIDDEN)
    for key, value in fields.items():
        if key in nested:  # settings nested in an object (DBRX's attn_config, ffn_config)
            out[key] = {k: v // d if k in head_fields(value) else _shrink_value(k, v, (hidden, twin_hidden))
                        for k, v in value.items()}
        elif key not in heads and key not in (width, "head_dim"):
            out[key] = _shrink_value(key, value, (hidden, twin_hidden))
    return out


# -- depth -------------------------------------------------------------------------------


def cut_to_depth(fields: dict, depth: int, published: int) -> dict:
    """``fields`` at ``depth`` layers of ``published``: per-layer lists and
    pattern strings cut, layer index lists (0- or 1-based) keep what is
    there, counts of layers scaled; nested objects alike."""
    out = {}
    for key, value in fields.items():
        if key in DEPTH:
            value = depth
        elif isinstance(value, (list, str)) and len(value) == published and published > 1:
            value = value[:depth]
        elif isinstance(value, list) and "layer" in key and all(_is_int(v) for v in value):
            value = [v for v in value if v <= depth]
        elif _is_int(value) and key.endswith("layers") and 0 < value < published:
            value = max(1, round(value * depth / published))
        elif isinstance(value, dict) and key not in QUANTIZATION:
            value = cut_to_depth(value, depth, published)
        out[key] = value
    return out


def layer_kinds(model) -> Tuple:
    """What decides the cache, per kind of layer: each cache's class with the
    key dim, value dim and kv heads it holds (a CacheList's members too), and
    whether some layers keep no cache of their own."""
    caches = make_prompt_cache(model)
    model(mx.array(PROBE), cache=caches)
    kinds = set()
    for c in caches:
        for m in (c.caches if isinstance(c, CacheList) else [c]):
            kinds.add((type(m).__name__, *kv_dims(m)))
    return tuple(sorted(kinds, key=str)), len(caches) < len(model.layers)


def _build(config: dict):
    model_class, args_class = classes(config)
    return model_class(args_class.from_dict(config))


def _depth_config(config: dict, depth: int, published: int) -> dict:
    out = cut_to_depth(config, depth, published) if "text_config" not in config else dict(config)
    if "text_config" in config:
        out["text_config"] = cut_to_depth(config["text_config"], depth, published)
    return out


def pattern_depth(fields: dict, published: int) -> int:
    """The shortest prefix holding every value of each per-layer list (of names,
    flags or ints, not per-layer floats) and pattern string."""
    depth = 1
    for value in fields.values():
        if isinstance(value, (list, str)) and len(value) == published and all(
                isinstance(v, (str, bool, int)) for v in value):
            depth = max(depth, max(list(value).index(v) for v in set(value)) + 1)
    return depth


def fewest_layers(config: dict) -> dict:
    """``config`` at the fewest layers that show every kind of layer its full depth has."""
    text = config.get("text_config", config)
    published = text.get(named(text, DEPTH))
    if not _is_int(published) or published <= MIN_LAYERS:
        return config
    full = layer_kinds(_build(config))
    for depth in range(max(MIN_LAYERS, pattern_depth(text, published)), published):
        candidate = _depth_config(config, depth, published)
        try:
            if layer_kinds(_build(candidate)) == full:
                return candidate
        except Exception:  # a depth mlx-lm's classes refuse (a pattern cut mid-way): a deeper one
            continue
    return config


# -- the twin ----------------------------------------------------------------------------


def _shrunk(config: dict, explicit_head_dim: bool) -> dict:
    out = {}
    for where, fields, args_class in levels(config):
        shrunk = shrink_widths(fields, args_class, explicit_head_dim)
        if where:
            out["text_config"] = shrunk
        else:
            out.update(shrunk)
    return fewest_layers(out)


def expected_head_dim(config: dict) -> Optional[int]:
    """The published attention head dim where the config states it (or hidden / heads);
    None for latent attention (MLA), whose dims are its ranks."""
    text = config.get("text_config", config)
    query, hidden = text.get(named(text, QUERY_HEADS)), text.get(named(text, WIDTH))
    if "kv_lora_rank" in text or not _is_int(query):
        return None
    return text.get(named(text, HEAD_DIM)) or (hidden // query if _is_int(hidden) else None)


def backend_missing(error: BaseException) -> bool:
    """MLX raised for want of a backend this build lacks (a model whose
    kernels are Metal's, on CPU): "[metal_kernel] No Metal back-end."."""
    return isinstance(error, RuntimeError) and re.search(r"\bNo \w+ back-end\b", str(error)) is not None


def shrink(config: dict) -> dict:
    """The tiny twin's config of a published ``config`` (see the module's words)."""
    if not isinstance(config.get("model_type"), str):
        raise TwinError("model_type: missing (mlx-lm picks the architecture by it)")
    missing = required_missing(config)
    if missing:
        model_class, args_class = classes(config)
        raise TwinError(f"{missing[0]}: missing; {args_class.__module__}.{args_class.__name__} requires it "
                        f"(required and missing: {', '.join(missing)})")
    want = expected_head_dim(config)
    tried = []
    for explicit in (True, False):
        try:
            twin = _shrunk(config, explicit)
            kinds, _ = layer_kinds(_build(twin))
        except Exception as error:
            if backend_missing(error):  # not the config's fault: no build runs here
                raise
            tried.append(f"{type(error).__name__}: {error}")
            continue
        key_dims = {kind[1] for kind in kinds if kind[1] is not None}
        if want is None or not key_dims or want in key_dims:
            return twin
        tried.append(f"its attention layers hold keys of {sorted(key_dims)}, not the published head_dim {want}")
    raise TwinError(f"model_type {config['model_type']!r}: no twin keeps its cache: {'; '.join(tried)}")


def quantize(model: nn.Module, config: dict) -> dict:
    """Quantize ``model``'s weights as the config says, with mlx-lm's own
    ``quantize_model`` (per-layer settings kept); the config it records."""
    from mlx_lm.utils import quantize_model

    quantization = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quantization, dict) or "bits" not in quantization:
        return config
    per_layer = {k: v for k, v in quantization.items() if isinstance(v, dict)}

    def predicate(path, module):
        return per_layer.get(path, True)

    plain = {k: v for k, v in config.items() if k not in QUANTIZATION}
    with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
        _, quantized = quantize_model(model, plain, quantization.get("group_size"), quantization["bits"],
                                      mode=quantization.get("mode", "affine"), quant_predicate=predicate)
    return quantized


def build_twin(config: dict, dtype: mx.Dtype = mx.float32, seed: int = SEED, fix=None):
    """The model of an already shrunk ``config`` through mlx-lm's own classes
    with seeded random weights (``fix`` adjusts them: the zoo's), quantized as
    the config says, eval'd; and the config used, with its seed and dtype."""
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    config = {**config, "seed": seed, "dtype": dtype_name}
    model = _build(config)
    _init_parameters(model, seed, dtype)
    if fix is not None:
        fix(model, config)
    config = quantize(model, config)
    model.eval()
    mx.eval(model.parameters())
    return model, config


def read_twin(path: Path):
    """(model, config, source) of a config.json given by path: its architecture's twin."""
    config = read_json(path, TwinError)
    if not isinstance(config, dict):
        raise TwinError(f"{path}: expected a config.json object")
    try:
        twin = shrink(config)
    except TwinError as error:
        raise TwinError(f"{path}: {error}")
    model, args = build_twin(twin, fix=fix_parameters)
    return model, args, {"path": path, "config_sha256": sha256_file(path)}


__all__ = ["TwinError", "backend_missing", "build_twin", "cut_to_depth", "fewest_layers", "layer_kinds", "read_twin",
           "required_missing", "shrink", "shrink_widths", "text_args_class"]
