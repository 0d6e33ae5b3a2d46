"""Byte-level comparison: the one place that decides whether two arrays are equal.

Equal means same dtype, same shape and same bits, compared through unsigned
integer views so that -0.0 vs 0.0 and NaN payloads count as differences.
"""

import hashlib
from typing import Iterable, List, Optional

import mlx.core as mx
import numpy as np

from kvparity.reports.results import Divergence

TRIPLE = ("packed", "scales", "biases")
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def raw(x: mx.array) -> np.ndarray:
    """The bits of ``x`` as an unsigned numpy array, without a copy."""
    if x.dtype == mx.bool_:
        x = x.astype(mx.uint8)
    elif x.dtype not in _UINT.values():
        x = x.view(_UINT[x.dtype.size])
    mx.eval(x)
    return np.array(memoryview(x), copy=False)


def first_difference(expected: mx.array, actual: mx.array):
    """None when equal; else (flat index or None, expected, actual) describing it."""
    if expected.dtype != actual.dtype:
        return None, str(expected.dtype), str(actual.dtype)
    if tuple(expected.shape) != tuple(actual.shape):
        return None, tuple(expected.shape), tuple(actual.shape)
    e, a = raw(expected), raw(actual)
    differ = np.flatnonzero(e != a)
    if differ.size == 0:
        return None
    i = int(differ[0])
    return i, _value(expected, i), _value(actual, i)


def _value(x: mx.array, flat_index: int):
    return x.reshape(-1)[flat_index].item()


def digest(arrays: Iterable[mx.array]) -> str:
    h = hashlib.sha256()
    for x in arrays:
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(np.ascontiguousarray(raw(x)).tobytes())
    return h.hexdigest()


def shares_memory(a: mx.array, b: mx.array) -> bool:
    return bool(np.shares_memory(raw(a), raw(b)))


def compare_triples(expected, actual, name: str, **where) -> List[Divergence]:
    """Compare two (packed, scales, biases) triples array by array."""
    found = []
    for part, e, a in zip(TRIPLE, expected, actual):
        diff = first_difference(e, a)
        if diff is not None:
            index, want, got = diff
            check = "bytes" if index is not None else "layout"
            found.append(
                Divergence(
                    check, tensor=f"{name}.{part}", index=index, expected=want, actual=got, **where
                )
            )
    return found


def flat(triples) -> List[mx.array]:
    return [x for triple in triples if triple is not None for x in triple]


def owned_arrays(cache) -> List[mx.array]:
    """Every array a cache's state holds (triples flattened)."""
    out = []
    for item in cache.state:
        if isinstance(item, mx.array):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            out.extend(x for x in item if isinstance(x, mx.array))
    return out


def any_shared(a_arrays, b_arrays) -> Optional[str]:
    for x in a_arrays:
        for y in b_arrays:
            if x.size and y.size and shares_memory(x, y):
                return f"{x.dtype}{tuple(x.shape)} shares memory with {y.dtype}{tuple(y.shape)}"
    return None
