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

A model's geometry is read here, off the built model, never off its config
(whose head fields only some architectures have): each cache's key and value
dims and kv heads as the model writes them, the query and kv heads mlx-lm's
quantized attention receives, and the width of the logits. Where the model
itself leaves nothing to judge (every layer keeps recurrent state, no keys
and values; or no MLX group size divides a dim kv_bits would pack),
``nothing_to_judge`` says so.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from kvparity.oracle.mlx_lm_versions import (
    MlxLmDefect, dense_batch_differs, kv_bits_leaves_dense, mlx_lm_frame, no_batched_class, solo_kv_bits_raises,
    with_script,
)
from kvparity.oracle.quantization import GROUP_SIZES

# The kv settings a plan is probed with: 4 bits, the first of MLX's group sizes
# (mlx-lm's default 64 first) that divides every quantized dim (a probe, not a
# schedule's settings).
PROBE_BITS, PROBE_GROUP_SIZES = 4, tuple(sorted(GROUP_SIZES, key=lambda g: (g != 64, g)))
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
    recurrent: bool = False  # mlx-lm's ArraysCache: recurrent state (SSM, linear attention), no keys and values

    def short(self) -> str:
        """``Q(2x64)``, ``Q(2x192/128)`` (kv heads x key/value dims) for a
        quantized layer, mlx-lm's class name for any other."""
        if not self.quantized:
            return self.cache
        if self.key_dim is None:  # a KVCache its block never writes (no attention there)
            return "Q(no keys)"
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
    # (query heads, kv heads) of each call of mlx-lm's quantized attention on one
    # decode step of the converted caches; empty where that step could not run.
    attention_heads: Tuple[Tuple[int, int], ...] = ()
    vocab_size: int = 0  # the width of the logits the model returns
    # That decode step raised in mlx-lm (its solo kv_bits run raises there too), or None.
    decode: Optional[MlxLmDefect] = None

    def query_heads(self, kv_heads: Optional[int]) -> Optional[int]:
        """The query heads mlx-lm's quantized attention pairs with ``kv_heads``
        (``kv_heads`` itself where it never ran: no grouping seen)."""
        return next((q for q, kv in self.attention_heads if kv == kv_heads), kv_heads)

    def nothing_to_judge(self) -> Optional[str]:
        """Why the model itself leaves no quantized cache to judge, in one
        sentence, or None: every layer keeps recurrent state (an SSM), or no MLX
        group size divides a dim that kv_bits packs."""
        if all(layer.recurrent for layer in self.layers):
            return (f"nothing to quantize: every layer keeps recurrent state, no attention keys and values "
                    f"(its caches: {self.summary()}), so mlx-lm's kv_bits has no KV cache to quantize on it")
        if self.quantized and probe_group_size(self.dims) is None:
            unfit = [d for d in self.dims if not any(d % g == 0 for g in GROUP_SIZES)]
            return (f"head dim {', '.join(map(str, unfit))} is divisible by none of MLX's quantization group "
                    f"sizes ({', '.join(map(str, GROUP_SIZES))}), so mlx-lm's kv_bits cannot run on it at all")
        return None

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
        """Every dim the quantized layers pack along (keys and values), sorted
        (a layer that keeps none, one mlx-lm's make_cache gives a block with no
        attention, packs none)."""
        return sorted({d for layer in self.quantized for d in (layer.key_dim, layer.value_dim) if d is not None})

    def group_sizes_fit(self, group_size: int) -> Optional[str]:
        """None when ``group_size`` divides every quantized layer's key and value dims, else why not."""
        for layer in self.quantized:
            for name, dim in (("key", layer.key_dim), ("value", layer.value_dim)):
                if dim is not None and dim % group_size:
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


def probe_group_size(dims) -> Optional[int]:
    """The first of PROBE_GROUP_SIZES that divides every dim, or None: kv_bits cannot pack them."""
    return next((g for g in PROBE_GROUP_SIZES if all(d % g == 0 for d in dims)), None)


@contextmanager
def _attention_heads_seen(seen: set):
    """Record (query heads, kv heads) of each call of mlx-lm's quantized attention."""
    attention = mlx_lm_base.quantized_scaled_dot_product_attention

    def recorded(queries, q_keys, *args, **kwargs):
        seen.add((queries.shape[1], q_keys[0].shape[-3]))
        return attention(queries, q_keys, *args, **kwargs)

    mlx_lm_base.quantized_scaled_dot_product_attention = recorded
    try:
        yield
    finally:
        mlx_lm_base.quantized_scaled_dot_product_attention = attention


def _quantized_heads(model, caches) -> Tuple[Tuple[Tuple[int, int], ...], Optional[MlxLmDefect]]:
    """One decode step on ``caches`` (converted as kv_bits converts them): the
    heads mlx-lm's quantized attention receives, and what the step raised
    (mlx-lm's limit: generate_step with kv_bits makes the same step), or None."""
    seen: set = set()
    try:
        with _attention_heads_seen(seen):
            mx.eval(model(mx.array([PROBE_PROMPT[:1]]), cache=caches))
    except Exception as error:
        return (), solo_kv_bits_raises(error, f"a decode step on the caches kv_bits converts (bits {PROBE_BITS})")
    return tuple(sorted(seen)), None


def plan_for(model) -> CachePlan:
    """The model's per-layer plan, from a short forward through mlx-lm's own
    prompt cache, each cache's own ``to_quantized``, and one decode step on
    the converted caches."""
    caches = make_prompt_cache(model)
    logits = model(mx.array([PROBE_PROMPT]), cache=caches)
    mx.eval(logits, [c.state for c in caches])
    dims = [kv_dims(c) for c in caches]
    group_size = probe_group_size([d for k, v, _ in dims if k is not None for d in (k, v)])
    layers, conversion, converted_caches = [], None, []
    for index, (cache, (key_dim, value_dim, kv_heads)) in enumerate(zip(caches, dims)):
        quantizable, kept = hasattr(cache, "to_quantized"), cache
        if quantizable and group_size is not None:  # none divides: nothing_to_judge says so
            try:
                kept = cache.to_quantized(group_size=group_size, bits=PROBE_BITS)
            except Exception as error:  # mlx-lm's solo kv_bits run raises here too
                quantizable = False
                conversion = conversion or solo_kv_bits_raises(
                    error, f"converting layer {index}'s {type(cache).__name__}")
        converted_caches.append(kept)
        batched = "" if quantizable or not hasattr(cache, "merge") else type(
            cache.merge([make_prompt_cache(model)[index], make_prompt_cache(model)[index]])).__name__
        layers.append(LayerPlan(index, type(cache).__name__, quantizable, key_dim, value_dim, kv_heads,
                                bool(cache.is_trimmable()), batched, isinstance(cache, ArraysCache)))
    heads, decode = _quantized_heads(model, converted_caches) if group_size is not None and conversion is None \
        else ((), None)
    return CachePlan(tuple(layers), conversion, heads, logits.shape[-1], decode)


def limit_for(model, plan: CachePlan) -> Optional[MlxLmDefect]:
    """The first limit of mlx-lm's that keeps a batch of ``model`` from being
    judged against its solo kv_bits run, found by running mlx-lm, or None;
    it names its reproduction script where one matches it."""
    return with_script(_first_limit(model, plan))


def _first_limit(model, plan: CachePlan) -> Optional[MlxLmDefect]:
    if plan.nothing_to_judge() is not None:  # the model's own, not mlx-lm's: no limit of mlx-lm's to find
        return None
    if plan.conversion is not None:
        return plan.conversion
    caches = make_prompt_cache(model)
    for layer, cache in zip(plan.layers, caches):
        if not hasattr(cache, "merge"):
            return no_batched_class(layer.cache, layer.index)
    if not plan.quantized:
        return kv_bits_leaves_dense(sorted({layer.cache for layer in plan.layers}))
    # Where the plan's decode step raised, that is mlx-lm's limit: generate_step with kv_bits makes the same step.
    return plan.decode or _solo_kv_bits_limit(model, probe_group_size(plan.dims)) or dense_batch_differs(model)


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
    return with_script(plan.conversion or plan.decode or _solo_kv_bits_limit(model, group_size, bits))


__all__ = ["CachePlan", "LayerPlan", "converted", "fresh_rows", "kv_dims", "limit_for", "mlx_lm_frame",
           "offset_of", "plan_for", "solo_kv_bits_limit"]
