"""The mlx-lm versions kvparity runs on, and mlx-lm's own defects it reports.

The oracle and the batched path are always the installed mlx-lm's own code.
This is the one place that knows how mlx-lm versions differ: a compatibility
shim goes here, with the version and the API difference it bridges, and so
does each defect of mlx-lm's own batched path that no cache can avoid.

A defect is found by running the installed mlx-lm's code, never by reading
its version number: a patched or backported mlx-lm is judged by what it does.
"""

from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention

# The oldest mlx-lm whose oracle path kvparity uses unchanged (pyproject.toml
# requires it); every minor from it to the newest is gated in CI (noxfile.py).
OLDEST_SUPPORTED = "0.30"


def mlx_lm_version() -> str:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class MlxLmDefect:
    """A defect of mlx-lm's own batched path: wrong whatever the cache holds."""

    name: str
    what: str  # what goes wrong, in one sentence
    source: str  # mlx-lm's source that does it
    fixed_in: str  # the first mlx-lm release without it

    def attribution(self) -> str:
        """What a report says where the defect decides an outcome."""
        return (f"mlx-lm {mlx_lm_version()} defect ({self.name}): {self.what} [{self.source}; "
                f"fixed in mlx-lm {self.fixed_in}]: the cache's bytes are not at issue, the logits diverge "
                "through mlx-lm's attention, so parity cannot be judged on this model here")


GQA_LEFT_PADDING_MASK = MlxLmDefect(
    name="gqa-left-padding-mask",
    what=("quantized attention with grouped-query heads broadcasts a batch's (B, 1, L, S) left-padding mask "
          "against its (B, kv_heads, repeats, L, S) scores without expanding it, so row i's mask lands on kv "
          "head i (wrong logits when B equals kv_heads, a broadcast error otherwise)"),
    source="mlx_lm/models/base.py quantized_scaled_dot_product_attention, before 'mask = mx.expand_dims(mask, -3)'",
    fixed_in="0.32.0",
)


def _mask_broadcast_breaks(attention: Callable, n_heads: int, n_kv_heads: int) -> bool:
    """True when ``attention`` raises on a batch of 3 rows with uneven left
    padding (3 is neither 1 nor the 2 kv heads, so a mask broadcast over kv
    heads instead of rows cannot go unnoticed)."""
    B, L, S, head_dim, bits, group_size = 3, 1, 8, 64, 4, 64
    queries = mx.zeros((B, n_heads, L, head_dim), dtype=mx.float32)
    keys = mx.quantize(mx.zeros((B, n_kv_heads, S, head_dim)), group_size=group_size, bits=bits)
    values = mx.quantize(mx.zeros((B, n_kv_heads, S, head_dim)), group_size=group_size, bits=bits)
    # What BatchKVCache.make_mask gives for rows padded by 0, 2 and 5 columns.
    mask = create_causal_mask(L, S - L, left_padding=mx.array([0, 2, 5]))
    try:
        mx.eval(attention(queries, keys, values, scale=1.0, mask=mask, group_size=group_size, bits=bits))
    except ValueError:
        return True
    return False


def has_gqa_left_padding_mask_defect(attention: Optional[Callable] = None) -> bool:
    """The installed (or given) quantized attention breaks on a grouped-query
    batch with a left-padding mask while the same batch with a kv head per
    query head runs: the defect is in the grouped-query path alone."""
    attention = attention or quantized_scaled_dot_product_attention
    return _mask_broadcast_breaks(attention, 4, 2) and not _mask_broadcast_breaks(attention, 4, 4)


@lru_cache(maxsize=None)
def _installed_has_gqa_defect() -> bool:
    return has_gqa_left_padding_mask_defect()


def defects_for(n_heads: int, n_kv_heads: int) -> List[MlxLmDefect]:
    """The installed mlx-lm's defects that reach a model with these heads."""
    if n_kv_heads < n_heads and _installed_has_gqa_defect():
        return [GQA_LEFT_PADDING_MASK]
    return []


def defect_for_model(loaded) -> Optional[MlxLmDefect]:
    """The first installed mlx-lm defect that reaches ``loaded`` (a LoadedModel), or None."""
    found = defects_for(loaded.n_heads, loaded.n_kv_heads)
    return found[0] if found else None
