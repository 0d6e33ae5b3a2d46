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


def raw_many(arrays) -> List[np.ndarray]:
    """The bits of each array as unsigned numpy arrays, evaluated together,
    without copies (views keep the strides and buffer of the MLX array)."""
    reading = Reading()
    ticket = reading.take(arrays)
    reading.evaluate()
    return reading[ticket]


_POINT = np.zeros((), dtype=np.uint8)


def handles(arrays) -> List[mx.array]:
    """New handles on the arrays' current graph nodes (free): what the arrays
    hold now, whatever is later written into the originals in place
    (``x[...] = y`` rebinds ``x`` itself to a new node)."""
    return [x.view(x.dtype) for x in arrays]


def _snapshot(x: mx.array) -> mx.array:
    """The bits of ``x`` as it is now: a new handle on its current graph node
    viewed as unsigned integers (free, strides kept), so that an in-place
    update of ``x`` afterwards does not change what is read. Booleans are
    converted to uint8 (a copy)."""
    if x.dtype == mx.bool_:
        return x.astype(mx.uint8)
    return x.view(_UINT[x.dtype.size])


class Reading:
    """The bits of many arrays, read in one evaluation.

    ``take`` fixes what the arrays hold now and returns a ticket; ``parts``
    does the same for slices of arrays, sliced by numpy once read (basic
    slices: numpy slices as MLX does). ``evaluate`` runs one ``mx.eval``
    for everything taken since the last one; ``reading[ticket]`` is then the
    raw views, as ``raw_many`` gives them. One evaluation per event instead
    of one per comparison, and no graph node per slice, is most of what a
    generated schedule costs.
    """

    def __init__(self):
        self._views: List[mx.array] = []
        self._bits: List[np.ndarray] = []

    def take(self, arrays, known=None) -> List[int]:
        """Indices of the arrays' bits; ``known``: {id(array): (array, index)}
        of arrays taken at this same moment (no call in between), read once;
        it learns the arrays taken here."""
        if known is None:
            start = len(self._views)
            self._views += [_snapshot(x) for x in arrays]
            return list(range(start, len(self._views)))
        ticket = []
        for x in arrays:
            hit = known.get(id(x))
            if hit is not None and hit[0] is x:
                ticket.append(hit[1])
            else:
                self._views.append(_snapshot(x))
                ticket.append(len(self._views) - 1)
                known[id(x)] = (x, ticket[-1])
        return ticket

    def parts(self, arrays, index, known=None) -> list:
        """``x[index]`` for each array, as a ``Part``; anything that is not an
        MLX array is sliced as it is. ``known`` as for ``take``, and it
        learns the arrays taken here."""
        out = []
        for x in arrays:
            if not isinstance(x, mx.array):
                out.append(x[index])
                continue
            hit = known.get(id(x)) if known else None
            if hit is not None and hit[0] is x:
                k = hit[1]
            else:
                self._views.append(_snapshot(x))
                k = len(self._views) - 1
                if known is not None:
                    known[id(x)] = (x, k)
            out.append(Part(self, k, index, x.dtype))
        return out

    def evaluate(self):
        done = len(self._bits)
        new = self._views[done:]
        if not new:
            return
        mx.eval(new)
        self._bits += [np.array(memoryview(v), copy=False) for v in new]

    def __getitem__(self, ticket: List[int]) -> List[np.ndarray]:
        return [self._bits[k] for k in ticket]


class Part:
    """A basic slice of an array taken into a ``Reading``: dtype and shape
    at once, bits (and values) once the reading was evaluated."""

    __slots__ = ("reading", "k", "index", "dtype", "_bits")

    def __init__(self, reading: Reading, k: int, index, dtype):
        self.reading, self.k, self.index, self.dtype = reading, k, index, dtype
        self._bits = None

    @property
    def bits(self) -> np.ndarray:
        if self._bits is None:
            self._bits = self.reading._bits[self.k][self.index]
        return self._bits

    @property
    def evaluated(self) -> bool:
        return self._bits is not None or self.k < len(self.reading._bits)

    @property
    def shape(self) -> tuple:
        if self.evaluated:
            return self.bits.shape
        return np.broadcast_to(_POINT, self.reading._views[self.k].shape)[self.index].shape

    def kept(self) -> "Part":
        """This part, evaluated, no longer holding the rest of its reading."""
        self.bits
        self.reading = None
        return self

    def value(self, flat_index: int):
        """The element as ``.item()`` gives it."""
        u = np.ascontiguousarray(self.bits.reshape(-1)[flat_index : flat_index + 1])
        if self.dtype == mx.bool_:
            return bool(u[0])
        return mx.array(u).view(self.dtype).item()


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
    """Every array a cache's state holds (triples flattened). A batch under
    test is read through ``state``, its protocol member, whatever else it
    holds; one of mlx-lm's own caches never written holds none (0.31's
    QuantizedKVCache.state raises on one)."""
    if type(cache).__module__.startswith("mlx_lm.") and getattr(cache, "keys", ()) is None:
        return []
    return arrays_in(cache.state)


def arrays_in(value) -> List[mx.array]:
    """The arrays of a state-like value: its items that are arrays, and the
    arrays of items that are tuples or lists (triples flattened). Anything
    else holds none: the checks report a malformed layout."""
    out = []
    if not isinstance(value, (tuple, list)):
        return out
    for item in value:
        if isinstance(item, mx.array):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            out.extend(x for x in item if isinstance(x, mx.array))
    return out


def start_evaluating(arrays: Iterable[mx.array]) -> None:
    """Begin evaluating ``arrays`` without waiting. MLX runs CPU kernels on a
    thread of its own, so they compute while Python goes on building the
    next graph; whatever reads them later waits for them."""
    mx.async_eval(list(arrays))


def shared_memory_later(reading: Reading, a_arrays, b_arrays, known=None, b_known=None):
    """Whether the two lists of arrays share memory, with the arrays taken
    into ``reading`` now (``known`` and ``b_known``: as for ``Reading.take``,
    for ``a_arrays`` and ``b_arrays``). The returned function answers once
    ``reading`` was evaluated: (x, y, bytes of y's buffer) for the first pair,
    one array from each list, whose memory overlaps, or None."""
    a_arrays = [x for x in a_arrays if x.size]
    a_ticket = reading.take(a_arrays, known)
    b_arrays = [y for y in b_arrays if y.size]
    b_ticket = reading.take(b_arrays, b_known)

    def answer():
        reading.evaluate()
        b_bits = reading[b_ticket]
        for x, x_bits in zip(a_arrays, reading[a_ticket]):
            for y, y_bits in zip(b_arrays, b_bits):
                if np.may_share_memory(x_bits, y_bits):
                    return x, y, _buffer_bytes(y_bits)
        return None

    return answer


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
