"""The frame of the process protocol: how one message crosses a pipe.

Every message, both ways, is ``KVP1``, a uint32 little-endian header length,
a UTF-8 JSON header, then the raw bytes of each tensor the header lists in
``"tensors"`` (``{"name", "dtype", "shape"}``), in that order, C-contiguous,
little-endian (docs/protocol.md, "Caches in other languages"). What belongs
here: encoding and reading frames, and MLX arrays to and from their bytes.
What the messages mean (the ops) is ``suites/core/process_cache.py``'s and
``suites/process_server.py``'s.
"""

import json
import os
import select
import struct
import time
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from kvparity.oracle import tensor_file

MAGIC = b"KVP1"
PROTOCOL = 1
# MLX's dtype names -> (the dtype, numpy's for its bytes, as the vectors' safetensors files
# hold them: bfloat16 travels as its 16 bits).
DTYPES = {name: (dtype, tensor_file.DTYPES[dtype][1]) for name, dtype in (
    ("uint32", mx.uint32), ("int32", mx.int32), ("float16", mx.float16), ("bfloat16", mx.bfloat16),
    ("float32", mx.float32), ("bool", mx.bool_))}
DTYPE_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items()}
HEADER_MAX = 1 << 24  # a header this long is not a header: garbage
SHOWN = 64  # bytes of garbage a failure quotes


class FrameGarbage(Exception):
    """What came down the pipe is no frame; ``seen``: its first bytes."""

    def __init__(self, reason: str, seen: bytes):
        super().__init__(f"{reason}: {bytes(seen[:SHOWN])!r}")
        self.reason, self.seen = reason, bytes(seen[:SHOWN])


class FrameTimeout(Exception):
    """No whole frame before the deadline."""


def tensor_bytes(x: mx.array) -> bytes:
    """The bytes of ``x`` in C order (MLX evaluates it)."""
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"a {x.dtype} array cannot cross the process protocol "
                        f"(dtypes: {', '.join(DTYPES)})")
    return memoryview(x).tobytes()


def encode(header: dict, tensors: Sequence[Tuple[str, mx.array]] = ()) -> bytes:
    """One frame: ``header`` with its ``"tensors"`` entries, then their bytes."""
    header = dict(header)
    data = [tensor_bytes(x) for _, x in tensors]
    header["tensors"] = [{"name": name, "dtype": DTYPE_NAMES[x.dtype], "shape": list(x.shape)} for name, x in tensors]
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(text)), text, *data])


def _entries(header, seen: bytes) -> List[Tuple[str, str, Tuple[int, ...], int]]:
    """The tensor entries of a header: (name, dtype, shape, byte count)."""
    if not isinstance(header, dict):
        raise FrameGarbage("a header that is not a JSON object", seen)
    found = []
    for entry in header.get("tensors") or []:
        ok = (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry.get("dtype") in DTYPES
              and isinstance(entry.get("shape"), list)
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"]))
        if not ok:
            raise FrameGarbage(f"a tensor entry that is not {{name, dtype of {', '.join(DTYPES)}, shape}}: "
                               f"{json.dumps(entry)[:200]}", seen)
        shape = tuple(entry["shape"])
        found.append((entry["name"], entry["dtype"], shape, prod(shape) * np.dtype(DTYPES[entry["dtype"]][1]).itemsize))
    return found


def array_of(dtype: str, shape: Tuple[int, ...], data: bytes) -> mx.array:
    """The MLX array of ``data``, the bytes of a ``dtype`` tensor of ``shape``."""
    kind, raw = DTYPES[dtype]
    x = mx.array(np.frombuffer(data, dtype=raw).reshape(shape))
    return x.view(kind) if dtype == "bfloat16" else x


class FrameReader:
    """Reads frames from a file descriptor, each whole by a deadline."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = bytearray()
        self.seen = bytearray()  # the bytes of the frame being read, for a garbage report

    def _fill(self, want: int, deadline: Optional[float]):
        while len(self.buffer) < want:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    raise FrameTimeout()
            chunk = os.read(self.fd, max(1 << 16, want - len(self.buffer)))
            if not chunk:
                raise EOFError()
            self.buffer += chunk
            if len(self.seen) < SHOWN:
                self.seen += chunk[:SHOWN]

    def extra(self) -> bytes:
        """What came after the last whole frame, and what more is there to
        read now without waiting: an answer is alone on the pipe."""
        try:
            while select.select([self.fd], [], [], 0)[0]:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    break
                self.buffer += chunk
        except OSError:
            pass
        return bytes(self.buffer[:SHOWN])

    def _take(self, n: int, deadline) -> bytes:
        self._fill(n, deadline)
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out

    def read(self, deadline: Optional[float] = None) -> Tuple[dict, Dict[str, mx.array]]:
        """The next frame: its header and its tensors by name. EOFError where
        the pipe ends before a frame starts or inside one; FrameTimeout at
        ``deadline`` (``time.monotonic()``); FrameGarbage for anything that
        is not a frame."""
        self.seen = bytearray(self.buffer[:SHOWN])
        magic = self._take(len(MAGIC), deadline)
        if magic != MAGIC:
            # Say what stands there: the rest of what already came with it.
            raise FrameGarbage("no frame (it does not start with KVP1)", bytes(magic) + bytes(self.buffer))
        (length,) = struct.unpack("<I", self._take(4, deadline))
        if length > HEADER_MAX:
            raise FrameGarbage(f"a header of {length} bytes", self.seen)
        try:
            header = json.loads(self._take(length, deadline).decode())
        except (UnicodeDecodeError, ValueError):
            raise FrameGarbage("a header that is not UTF-8 JSON", self.seen)
        tensors = {}
        for name, dtype, shape, size in _entries(header, self.seen):
            tensors[name] = array_of(dtype, shape, self._take(size, deadline))
        return header, tensors


def write_all(fd: int, data: bytes, deadline: Optional[float] = None):
    """Write every byte of ``data`` to ``fd`` by ``deadline`` (FrameTimeout
    after it; a pipe takes a large frame in parts). With a deadline, ``fd``
    must be non-blocking: a reader that stops reading must not block us."""
    view = memoryview(data)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise FrameTimeout()
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
