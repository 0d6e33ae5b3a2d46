"""The bits of MLX arrays: raw unsigned views, hashes and shared memory.

Equality everywhere in kvparity is equality of these bits (dtype and shape
compared first), through unsigned integer views so that -0.0 vs 0.0 and NaN
payloads count as differences.
"""

import hashlib
from typing import Iterable, List, Optional

import mlx.core as mx
import numpy as np

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


def digest(arrays: Iterable[mx.array]) -> str:
    """sha256 over dtype, shape and bits of every array, in order."""
    arrays = list(arrays)
    h = hashlib.sha256()
    for x, bits in zip(arrays, raw_many(arrays)):
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(np.ascontiguousarray(bits).tobytes())
    return h.hexdigest()


def owned_arrays(cache) -> List[mx.array]:
    """Every array a cache's state holds (triples flattened)."""
    out = []
    state = cache.state
    if not isinstance(state, (tuple, list)):
        return out  # nothing owned to inspect; the checks report the layout
    for item in state:
        if isinstance(item, mx.array):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            out.extend(x for x in item if isinstance(x, mx.array))
    return out


def shared_memory(a_arrays, b_arrays):
    """(x, y, bytes of y's buffer) for the first pair, one array from each
    list, whose memory overlaps; None when the lists own disjoint memory."""
    a_arrays = [x for x in a_arrays if x.size]
    b_arrays = [y for y in b_arrays if y.size]
    b_bits = raw_many(b_arrays)
    for x, x_bits in zip(a_arrays, raw_many(a_arrays)):
        for y, y_bits in zip(b_arrays, b_bits):
            if np.may_share_memory(x_bits, y_bits):
                return x, y, _buffer_bytes(y_bits)
    return None


def _buffer_bytes(view: np.ndarray) -> int:
    """Size of the whole buffer a numpy view into MLX memory keeps alive."""
    base = view
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        return base.nbytes
    return int(getattr(base, "nbytes", view.nbytes))


def describe_shared(found) -> Optional[str]:
    if found is None:
        return None
    x, y, _ = found
    return f"{x.dtype}{tuple(x.shape)} shares memory with {y.dtype}{tuple(y.shape)}"
