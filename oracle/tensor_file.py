"""Safetensors files written byte for byte the same every time, and read
back without MLX: what the conformance vectors carry (``suites/l1/vectors.py``).

The format is the public one: 8 bytes little-endian header length, a JSON
header (each tensor's dtype, shape and byte range; ``__metadata__``
strings), then the tensors' bytes. Here the header's keys are sorted, it
has no spaces, and it is padded with spaces to a multiple of 8, so the same
tensors give the same file on every machine.
"""

import json
import struct
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

# MLX dtype -> (safetensors dtype, numpy dtype holding the same bits)
DTYPES = {
    mx.uint32: ("U32", np.uint32),
    mx.int32: ("I32", np.int32),
    mx.float32: ("F32", np.float32),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),  # numpy has no bfloat16: its bits as uint16
    mx.bool_: ("BOOL", np.bool_),
    mx.uint8: ("U8", np.uint8),
}
NUMPY_OF = {code: np_type for code, np_type in DTYPES.values()}


def bits_of(x) -> Tuple[str, np.ndarray]:
    """An MLX array (or numpy bool array) as (safetensors dtype, numpy array of its bits)."""
    if isinstance(x, np.ndarray):
        code = {np.dtype(np_type): code for code, np_type in DTYPES.values() if code != "BF16"}[x.dtype]
        return code, np.ascontiguousarray(x)
    code, np_type = DTYPES[x.dtype]
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return code, np.ascontiguousarray(np.array(x, copy=False)).astype(np_type, copy=False)


def write(path, tensors: Dict[str, Tuple[str, np.ndarray]], metadata: Dict[str, str] = None) -> Path:
    """``tensors``: name -> (safetensors dtype, numpy array of its bits), written in name order."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        code, array = tensors[name]
        data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for chunk in chunks:
            out.write(chunk)
    return path


class TensorFileError(ValueError):
    """A file that is not the safetensors this module writes: the message names it and why."""


def read(path) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str]]:
    """(name -> (safetensors dtype, numpy array of its bits), metadata) of a file."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise TensorFileError(f"{path}: {len(data)} bytes, shorter than a safetensors header length")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise TensorFileError(f"{path}: header of {length} bytes runs past the file's {len(data)}")
    try:
        header = json.loads(data[8:8 + length])
    except ValueError as error:
        raise TensorFileError(f"{path}: header is not JSON ({error})")
    body, tensors = data[8 + length:], {}
    metadata = header.pop("__metadata__", {})
    for name, entry in header.items():
        code, shape, (start, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in NUMPY_OF:
            raise TensorFileError(f"{path}: tensor {name!r} has dtype {code}, not one of {', '.join(NUMPY_OF)}")
        array = np.frombuffer(body[start:stop], dtype=np.dtype(NUMPY_OF[code]).newbyteorder("<"))
        if array.size != int(np.prod(shape)):
            raise TensorFileError(f"{path}: tensor {name!r} holds {array.size} elements, its shape {shape} says "
                                  f"{int(np.prod(shape))}")
        tensors[name] = (code, array.reshape(shape))
    return tensors, metadata
