"""A zoo of mlx-lm's own architectures: data, one config per family, built by mlx-lm's classes.

One `Architecture` per file of `oracle/zoo/` (`ZOO`), named by mlx-lm's module name
(the config's `model_type`; a variant adds a suffix, `gemma4_text-kv_shared`). Its
config is a config.json of that architecture (a nested `text_config` where the
family's real config has one), with the family's real head dims and layer pattern,
small already (sliding windows of 16 tokens, so a schedule of a few dozen tokens
crosses them), and shrunk by the same function as any config a user passes
(`oracle/twin.py`: hidden, intermediate sizes, experts and vocabulary, the fewest
layers that show the pattern once). `build_zoo_model` builds it through mlx-lm's
`Model`/`ModelArgs` for its model_type and draws its weights with `_init_parameters`
(same seed and scales as the random models), with `fix_parameters`'s exceptions (oracle/weights.py).

Each entry also records what mlx-lm does with it, so a test can hold mlx-lm to it:
`layout`, the class of each cache `make_prompt_cache(model)` returns (KV-shared
and MLP-only layers have none, so it can be shorter than the model); `dims`, per
KV cache class, (kv heads, key dim, value dim) as the model writes them; and
`kv_bits`, what mlx-lm's solo `generate_step(..., kv_bits=4,
kv_group_size=KV_GROUP_SIZE, quantized_kv_start=0, max_tokens=8)` does: `RUNS`,
or the exception it raises with mlx-lm's innermost line (`solo_kv_bits` measures it).
"""

import contextlib
import dataclasses
import importlib
import io
import json
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

from .twin import build_twin, levels, shrink
from .weights import DTYPES, SEED, fix_parameters

__all__ = [
    "KV_GROUP_SIZE",
    "RECORDED_ON",
    "RUNS",
    "ZOO",
    "Architecture",
    "build_zoo_model",
    "cache_layout",
    "config_field_errors",
    "quantized_layout",
    "solo_kv_bits",
    "written_dims",
    "zoo_config",
]

RUNS = "runs"
KV_BITS, KV_GROUP_SIZE = 4, 32  # 32 divides every key and value dim in the zoo

# What mlx-lm's solo kv_bits run raises (an entry's kv_bits), where it does not run
# (first line), as RECORDED_ON raises it; another release may raise it from another line.
RECORDED_ON = "0.32.2"


@dataclass(frozen=True)
class Architecture:
    name: str  # mlx-lm's model_type, plus a variant suffix
    note: str  # what it stands for
    config: dict  # mlx-lm config.json fields, before ``twin.shrink``
    layout: Tuple[str, ...]  # make_prompt_cache's class per cache (see cache_layout)
    dims: Dict[str, Tuple[int, int, int]]  # KV cache class -> (kv heads, key dim, value dim)
    kv_bits: str  # RUNS, or "Error: message @ mlx_lm/file.py:line"

    @classmethod
    def read(cls, path: Path) -> "Architecture":
        doc = json.loads(path.read_text())
        return cls(doc["name"], doc["note"], doc["config"], tuple(doc["layout"]),
                   {k: tuple(v) for k, v in doc["dims"].items()}, doc["kv_bits"])


ZOO_DIR = Path(__file__).parent / "zoo"  # one JSON file per architecture (and variant)
ZOO: Dict[str, Architecture] = {a.name: a for a in map(Architecture.read, sorted(ZOO_DIR.glob("*.json")))}


def _architecture(name: str) -> Architecture:
    if name not in ZOO:
        raise ValueError(f"unknown zoo architecture {name!r}; available: {', '.join(ZOO)}")
    return ZOO[name]


@lru_cache(maxsize=None)
def _shrunk(name: str) -> str:
    return json.dumps(shrink(_architecture(name).config))


def zoo_config(name: str, dtype: mx.Dtype = mx.float32) -> dict:
    """The entry's config.json fields as ``twin.shrink`` leaves them, with the seed and dtype."""
    return {**json.loads(_shrunk(name)), "seed": SEED, "dtype": next(k for k, v in DTYPES.items() if v == dtype)}


def config_field_errors(config: dict) -> list:
    """Keys that ModelArgs.from_dict would silently drop: each config key (and
    each text_config key) that is not a field of the architecture's ModelArgs,
    nor of the published config format (transformers' config class for its
    model_type, which a server's tokenizer loader reads and validates: a
    field mlx-lm does not read may be one that format needs to be consistent)."""
    config = {k: v for k, v in config.items() if k not in ("seed", "dtype")}
    errors = []
    for prefix, fields, args_class in levels(config):
        known = {f.name for f in dataclasses.fields(args_class)} | published_fields(fields.get("model_type"))
        errors += [f"{prefix}{k} is not a field of {args_class.__module__}."
                   f"{args_class.__name__}" for k in fields if k not in known]
    return errors


def published_fields(model_type: Optional[str]) -> set:
    """The fields of transformers' config class for ``model_type`` (none where it has none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return set()
    return {f.name for f in dataclasses.fields(CONFIG_MAPPING[model_type])}


def build_zoo_model(name: str, dtype: mx.Dtype = mx.float32):
    """The entry's model through mlx-lm's own classes for its model_type, with
    seeded random weights, eval'd; and the config used (JSON-serialisable).
    MoE entries run in float32 only on MLX's CPU backend (its gather_mm is
    float32-only there), hence the float32 default."""
    config = zoo_config(name, dtype)
    config = {k: v for k, v in config.items() if k not in ("seed", "dtype")}
    return build_twin(config, dtype, SEED, fix=fix_parameters)


def cache_layout(cache) -> Tuple[str, ...]:
    """The class of each cache, a CacheList as `CacheList(member,...)`."""
    def name(c):
        if isinstance(c, CacheList):
            return f"CacheList({','.join(type(m).__name__ for m in c.caches)})"
        return type(c).__name__
    return tuple(name(c) for c in cache)


def written_dims(cache) -> Dict[str, set]:
    """Per KV cache class, the set of (kv heads, key dim, value dim) of the keys
    and values its caches (CacheList members too) hold, after a forward of one
    sequence shorter than every sliding window."""
    dims: Dict[str, set] = {}
    for c in cache:
        for m in c.caches if isinstance(c, CacheList) else [c]:
            if isinstance(m, (KVCache, RotatingKVCache)) and m.keys is not None:
                keys, values = m.keys[..., : m.offset, :], m.values[..., : m.offset, :]
                dims.setdefault(type(m).__name__, set()).add(
                    (keys.shape[1], keys.shape[-1], values.shape[-1]))
    return dims


def _mlx_lm_frame(tb) -> str:
    """The innermost traceback line inside mlx_lm, as `mlx_lm/path.py:line`."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if "/mlx_lm/" in frame.filename:
            where = f"mlx_lm/{frame.filename.rsplit('/mlx_lm/', 1)[1]}:{frame.lineno}"
    return where


def solo_kv_bits(model: nn.Module, prompt: mx.array, max_tokens: int = 8):
    """What mlx-lm's solo `generate_step` with kv_bits does on `model`: (RUNS, the
    cache layout it leaves), or (`Error: first line of message @ mlx_lm/file.py:line`,
    None)."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    cache = make_prompt_cache(model)
    try:
        for _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=cache,
                               kv_bits=KV_BITS, kv_group_size=KV_GROUP_SIZE,
                               quantized_kv_start=0):
            pass
    except Exception as e:  # mlx-lm's own outcome, recorded, never ours
        message = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {message} @ {_mlx_lm_frame(e.__traceback__)}", None
    return RUNS, cache_layout(cache)


def quantized_layout(layout) -> Tuple[str, ...]:
    """The layout mlx-lm's `maybe_quantize_kv_cache` leaves: it converts a cache
    with `to_quantized` (a plain KVCache) and leaves the rest, CacheList included."""
    return tuple("QuantizedKVCache" if kind == KVCache.__name__ else kind for kind in layout)


# -- every architecture the installed mlx-lm ships ------------------------------------------

PUBLISHED_DIR = ZOO_DIR / "published"  # published config.json files, at their published sizes


def mlx_lm_modules() -> list:
    """Every module of the installed mlx-lm's models package, by name."""
    import pkgutil

    import mlx_lm.models

    return sorted(info.name for info in pkgutil.iter_modules(mlx_lm.models.__path__))


def architecture_modules() -> list:
    """The model modules of the installed mlx-lm (each defines Model and ModelArgs), by name."""
    names = []
    for name in mlx_lm_modules():
        try:  # a module that needs a package not installed here says so and exits (olmo's)
            with contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(f"mlx_lm.models.{name}")
        except (Exception, SystemExit):
            names.append(name)  # an architecture all the same: its config says so where it is built
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            names.append(name)
    return names


def module_of(config: dict) -> str:
    """The mlx-lm module a config is built by: the module of mlx-lm's own class lookup
    (its remapping by model_type and by model_type and architecture alike)."""
    from mlx_lm import utils

    by_architecture = getattr(utils, "MODEL_ARCHITECTURE_REMAPPING", {})  # 0.32 on; 0.31 remaps by model_type only
    model_type, architectures = config["model_type"], config.get("architectures") or ()
    for architecture in [architectures] if isinstance(architectures, str) else architectures:
        if (model_type, architecture) in by_architecture:
            return by_architecture[(model_type, architecture)]
    return utils.MODEL_REMAPPING.get(model_type, model_type)


PUBLISHED_INDEX = PUBLISHED_DIR / "index.json"  # where each published file's values come from; modules without one


@dataclass(frozen=True)
class PublishedIndex:
    """What ``oracle/zoo/published/index.json`` says: per published file (by name),
    the public checkpoint its values are from, or why there is none; per module
    kvparity has no config for, the reason in words (no twin can be built, it is
    not a language model)."""
    checkpoints: Dict[str, str]  # file name -> "org/name", or "no public checkpoint: why"
    without_config: Dict[str, str]  # mlx-lm module -> the reason it has no config

    @classmethod
    def read(cls, path: Path = None) -> "PublishedIndex":
        doc = json.loads((path or PUBLISHED_INDEX).read_text())
        return cls(doc["checkpoints"], {**doc["no_twin"], **doc["not_language_models"]})


def published_configs() -> list:
    """The published config.json files, by path (the index is not one)."""
    return [path for path in sorted(PUBLISHED_DIR.glob("*.json")) if path != PUBLISHED_INDEX]


def module_reasons() -> Dict[str, str]:
    """mlx-lm module -> why kvparity has no config for it (published/index.json)."""
    return PublishedIndex.read().without_config


def known_configs() -> Dict[str, str]:
    """module -> the model kvparity has a config for: a zoo entry (its first,
    by name), else a published config.json (its path)."""
    known = {}
    for path in published_configs():
        known[module_of(json.loads(path.read_text()))] = str(path)
    for name in sorted(ZOO, reverse=True):
        known[module_of(ZOO[name].config)] = name
    return known
