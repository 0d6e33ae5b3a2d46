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


def _bits(x: mx.array) -> mx.array:
    if x.dtype == mx.bool_:
        return x.astype(mx.uint8)
    if x.dtype in _UINT.values():
        return x
    return x.view(_UINT[x.dtype.size])


def raw_many(arrays) -> List[np.ndarray]:
    """The bits of each array as unsigned numpy arrays, evaluated together,
    without copies (views keep the strides and buffer of the MLX array)."""
    views = [_bits(x) for x in arrays]
    mx.eval(views)
    return [np.array(memoryview(v), copy=False) for v in views]


def raw(x: mx.array) -> np.ndarray:
    return raw_many([x])[0]


def first_difference(expected: mx.array, actual: mx.array, bits=None):
    """None when equal; else (flat index or None, expected, actual) describing it.
    ``bits`` may carry both arrays' raw views when the caller already has them."""
    if expected.dtype != actual.dtype:
        return None, str(expected.dtype), str(actual.dtype)
    if tuple(expected.shape) != tuple(actual.shape):
        return None, tuple(expected.shape), tuple(actual.shape)
    e, a = bits if bits is not None else raw_many([expected, actual])
    differ = np.flatnonzero(e != a)
    if differ.size == 0:
        return None
    i = int(differ[0])
    return i, _value(expected, i), _value(actual, i)


def _value(x: mx.array, flat_index: int):
    return x.reshape(-1)[flat_index].item()


def digest(arrays: Iterable[mx.array]) -> str:
    arrays = list(arrays)
    h = hashlib.sha256()
    for x, bits in zip(arrays, raw_many(arrays)):
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(np.ascontiguousarray(bits).tobytes())
    return h.hexdigest()


def compare_triples(expected, actual, name: str, **where) -> List[Divergence]:
    """Compare two (packed, scales, biases) triples array by array."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return []
        return [Divergence("layout", tensor=name, expected=_shapes(expected), actual=_shapes(actual), **where)]
    return compare_named(dict(zip(TRIPLE, expected)), dict(zip(TRIPLE, actual)), f"{name}.", **where)


def compare_batch_row(triples, i: int, start: int, stop: int, expected: dict, prefix: str, **where):
    """Row ``i`` of batch triples on columns [start, stop) against solo triples.

    ``triples`` and ``expected`` map "keys"/"values" to (packed, scales, biases).
    """
    found = []
    for name, triple in triples.items():
        row = tuple(x[i : i + 1, :, start:stop] for x in triple)
        found += compare_triples(expected[name], row, f"{prefix}{name}", **where)
    return found


def compare_named(expected: dict, actual: dict, prefix: str = "", **where) -> List[Divergence]:
    """Compare two {name: array} maps, name by name (all evaluated together)."""
    found = []
    present = [name for name in expected if actual.get(name) is not None]
    bits = raw_many([expected[n] for n in present] + [actual[n] for n in present])
    pairs = dict(zip(present, zip(bits[: len(present)], bits[len(present) :])))
    for name, e in expected.items():
        a = actual.get(name)
        if a is None:
            found.append(Divergence("layout", tensor=prefix + name, expected=tuple(e.shape), actual=None, **where))
            continue
        diff = first_difference(e, a, pairs[name])
        if diff is not None:
            index, want, got = diff
            found.append(
                Divergence("bytes" if index is not None else "layout", tensor=prefix + name,
                           index=index, expected=want, actual=got, **where)
            )
    return found


def _shapes(triple):
    return None if triple is None else [tuple(x.shape) for x in triple]


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
    """Describe the first pair of arrays, one from each list, whose memory
    overlaps; None when the two lists own disjoint memory."""
    a_arrays = [x for x in a_arrays if x.size]
    b_arrays = [y for y in b_arrays if y.size]
    b_bits = raw_many(b_arrays)
    for x, x_bits in zip(a_arrays, raw_many(a_arrays)):
        for y, y_bits in zip(b_arrays, b_bits):
            if np.may_share_memory(x_bits, y_bits):
                return f"{x.dtype}{tuple(x.shape)} shares memory with {y.dtype}{tuple(y.shape)}"
    return None
