"""Per-layer cache plans: what each layer of a model holds, as mlx-lm lays it out.

mlx-lm decides what a layer holds: ``make_prompt_cache(model)`` (the model's
``make_cache``), then ``maybe_quantize_kv_cache`` converts every cache that has
``to_quantized``. The solo ``kv_bits`` run is exactly that, so the contract is
per layer:

* a layer mlx-lm's solo run quantizes (a ``KVCache``) is batched by the class
  under test and holds the solo run's quantized bytes, at its own key dim,
  value dim and kv heads, read here off what the model writes;
* every other layer (``ArraysCache`` for linear attention or SSM state, and
  whatever else mlx-lm leaves dense) is batched by mlx-lm's own class for it
  (its ``merge``) and holds what that class holds for the solo run.

Where mlx-lm's solo ``kv_bits`` run cannot exist, or mlx-lm cannot batch a
layer, the plan carries the limit (``oracle/mlx_lm_versions.py``), found by
running mlx-lm's code on the model: kvparity never substitutes a layout mlx-lm
does not build.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from kvparity.oracle.mlx_lm_versions import (
    MlxLmDefect, dense_batch_differs, kv_bits_leaves_dense, mlx_lm_frame, no_batched_class, solo_kv_bits_raises,
    with_script,
)

# The kv settings a plan is probed with: 4 bits, the largest of these group
# sizes that divides every quantized dim (a probe, not a schedule's settings).
PROBE_BITS, PROBE_GROUP_SIZES = 4, (64, 32, 16)
PROBE_PROMPT = [1, 2, 3, 4, 5]


@dataclass(frozen=True)
class LayerPlan:
    """One entry of the model's prompt cache."""

    index: int  # in make_prompt_cache(model)
    cache: str  # mlx-lm's class there
    quantized: bool  # mlx-lm's solo kv_bits run converts it: the class under test batches it
    key_dim: Optional[int] = None  # as the model writes keys and values (None: no keys of its own)
    value_dim: Optional[int] = None
    kv_heads: Optional[int] = None
    trimmable: bool = True
    batched: str = ""  # a layer mlx-lm batches itself: the class its merge makes ("": the class under test)

    def short(self) -> str:
        """``Q(2x64)``, ``Q(2x192/128)`` (kv heads x key/value dims) for a
        quantized layer, mlx-lm's class name for any other."""
        if not self.quantized:
            return self.cache
        dims = str(self.key_dim) if self.key_dim == self.value_dim else f"{self.key_dim}/{self.value_dim}"
        return f"Q({self.kv_heads}x{dims})"

    def describe(self) -> str:
        dims = ""
        if self.key_dim is not None:
            dims = (f"{self.kv_heads} kv heads, head_dim {self.key_dim}" if self.key_dim == self.value_dim else
                    f"{self.kv_heads} kv heads, keys {self.key_dim}, values {self.value_dim}")
        kind = "quantized (the class under test)" if self.quantized else f"{self.cache} (mlx-lm's own)"
        return f"layer {self.index}: {kind}" + (f", {dims}" if dims else "")


@dataclass(frozen=True)
class CachePlan:
    layers: Tuple[LayerPlan, ...]
    # Converting a layer raised in mlx-lm (its solo kv_bits run raises there too), or None.
    conversion: Optional[MlxLmDefect] = None

    @property
    def quantized(self) -> List[LayerPlan]:
        return [layer for layer in self.layers if layer.quantized]

    @property
    def attention(self) -> int:
        """The layer whose offset is the request's position: the first quantized one."""
        return next((layer.index for layer in self.layers if layer.quantized), 0)

    @property
    def trimmable(self) -> bool:
        return all(layer.trimmable for layer in self.layers)

    def untrimmable(self) -> List[LayerPlan]:
        return [layer for layer in self.layers if not layer.trimmable]

    @property
    def dims(self) -> List[int]:
        """Every dim the quantized layers pack along (keys and values), sorted."""
        return sorted({d for layer in self.quantized for d in (layer.key_dim, layer.value_dim)})

    def group_sizes_fit(self, group_size: int) -> Optional[str]:
        """None when ``group_size`` divides every quantized layer's key and value dims, else why not."""
        for layer in self.quantized:
            for name, dim in (("key", layer.key_dim), ("value", layer.value_dim)):
                if dim % group_size:
                    return (f"kv.group_size={group_size} does not divide head_dim={dim} "
                            f"(layer {layer.index}'s {name}s)")
        return None

    def describe(self) -> List[str]:
        return [layer.describe() for layer in self.layers]

    def summary(self) -> str:
        """The layers in one line, runs of equal layers counted: ``ArraysCache*3, Q(1x256)``."""
        runs: List[List] = []
        for layer in self.layers:
            if runs and runs[-1][0] == layer.short():
                runs[-1][1] += 1
            else:
                runs.append([layer.short(), 1])
        return ", ".join(name if n == 1 else f"{name}*{n}" for name, n in runs)


def offset_of(caches) -> int:
    """A request's position: the offset of its first cache that keeps one
    (an attention layer's; linear-attention and SSM state keep none)."""
    return next(c.offset for c in caches if hasattr(c, "offset"))


def converted(caches) -> bool:
    """Whether mlx-lm's conversion rule has converted every layer it converts
    (``maybe_quantize_kv_cache`` converts what has ``to_quantized``)."""
    return not any(hasattr(c, "to_quantized") for c in caches)


def fresh_rows(model, bits: int, group_size: int, quantized_class) -> list:
    """A request's empty caches, quantized from its first token: mlx-lm's own
    prompt cache with every layer that kv_bits converts a ``quantized_class``."""
    return [quantized_class(group_size=group_size, bits=bits) if hasattr(c, "to_quantized") else c
            for c in make_prompt_cache(model)]


def kv_dims(cache) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(key dim, value dim, kv heads) of the keys and values a cache holds, or Nones."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if isinstance(keys, mx.array) and isinstance(values, mx.array):
        return keys.shape[-1], values.shape[-1], keys.shape[1]
    for inner in getattr(cache, "caches", ()):  # a CacheList: its attention member's
        found = kv_dims(inner)
        if found[0] is not None:
            return found
    return None, None, None


def probe_group_size(dims) -> int:
    return next((g for g in PROBE_GROUP_SIZES if all(d % g == 0 for d in dims)), PROBE_GROUP_SIZES[-1])


def plan_for(model) -> CachePlan:
    """The model's per-layer plan, from a short forward through mlx-lm's own
    prompt cache and each cache's own ``to_quantized``."""
    caches = make_prompt_cache(model)
    model(mx.array([PROBE_PROMPT]), cache=caches)
    mx.eval([c.state for c in caches])
    dims = [kv_dims(c) for c in caches]
    group_size = probe_group_size([d for k, v, _ in dims if k is not None for d in (k, v)])
    layers, conversion = [], None
    for index, (cache, (key_dim, value_dim, kv_heads)) in enumerate(zip(caches, dims)):
        quantizable = hasattr(cache, "to_quantized")
        if quantizable:
            try:
                cache.to_quantized(group_size=group_size, bits=PROBE_BITS)
            except Exception as error:  # mlx-lm's solo kv_bits run raises here too
                quantizable = False
                conversion = conversion or solo_kv_bits_raises(
                    error, f"converting layer {index}'s {type(cache).__name__}")
        batched = "" if quantizable or not hasattr(cache, "merge") else type(
            cache.merge([make_prompt_cache(model)[index], make_prompt_cache(model)[index]])).__name__
        layers.append(LayerPlan(index, type(cache).__name__, quantizable, key_dim, value_dim, kv_heads,
                                bool(cache.is_trimmable()), batched))
    return CachePlan(tuple(layers), conversion)


def limit_for(model, plan: CachePlan) -> Optional[MlxLmDefect]:
    """The first limit of mlx-lm's that keeps a batch of ``model`` from being
    judged against its solo kv_bits run, found by running mlx-lm, or None;
    it names its reproduction script where one matches it."""
    return with_script(_first_limit(model, plan))


def _first_limit(model, plan: CachePlan) -> Optional[MlxLmDefect]:
    if plan.conversion is not None:
        return plan.conversion
    caches = make_prompt_cache(model)
    for layer, cache in zip(plan.layers, caches):
        if not hasattr(cache, "merge"):
            return no_batched_class(layer.cache, layer.index)
    if not plan.quantized:
        return kv_bits_leaves_dense(sorted({layer.cache for layer in plan.layers}))
    return _solo_kv_bits_limit(model, probe_group_size(plan.dims)) or dense_batch_differs(model)


def _solo_kv_bits_limit(model, group_size: int, bits: int = PROBE_BITS) -> Optional[MlxLmDefect]:
    """mlx-lm's solo generate_step with kv_bits, a few tokens: the limit it raises, or None."""
    try:
        for _ in generate_step(mx.array(PROBE_PROMPT), model, max_tokens=3, kv_bits=bits,
                               kv_group_size=group_size, quantized_kv_start=0):
            pass
    except Exception as error:
        return solo_kv_bits_raises(error, f"generate_step(kv_bits={bits}, kv_group_size={group_size})")
    return None


def solo_kv_bits_limit(model, plan: CachePlan, bits: int, group_size: int) -> Optional[MlxLmDefect]:
    """Why mlx-lm's own solo run with these kv settings cannot exist on
    ``model`` (a layer its conversion raises on, or its generate_step
    raising), or None: where a server is judged against that run (L4)."""
    return with_script(plan.conversion or _solo_kv_bits_limit(model, group_size, bits))


__all__ = ["CachePlan", "LayerPlan", "converted", "fresh_rows", "kv_dims", "limit_for", "mlx_lm_frame",
           "offset_of", "plan_for", "solo_kv_bits_limit"]
