"""Serve a Python batch cache class over the process protocol.

``python -m kvparity.suites.process_server package.module:Class`` says its
hello on stdout, then answers each request on stdin by calling the class's
member, until stdin ends. It is the process side of the protocol written in
Python: the reference through it must be judged exactly as in process
(``kvparity check --impl 'exec:python -m kvparity.suites.process_server
kvparity.impl.batch_quantized:BatchQuantizedKVCache'``), and it shows a
cache author in another language what each op does. The class runs here
unwatched: kvparity watches the proxy on its side of the pipe. Whatever the
class prints goes to stderr; stdout carries frames only.
"""

import copy
import os
import sys
import traceback
from typing import Dict, List, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvparity.oracle.quantization import BITS, DTYPES, GROUP_SIZES
from kvparity.suites.core.raised import ImplementationError
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.process_cache import TRIPLE, triple_tensors
from kvparity.suites.core.process_frame import PROTOCOL, FrameReader, encode, write_all


class Server:
    """The batches of one served class, by handle, and the answer to each op."""

    def __init__(self, batch_class: type, capabilities: Dict[str, bool]):
        self.batch_class, self.capabilities = batch_class, capabilities
        self.batches: Dict[int, object] = {}
        self.next_handle = 1

    def hello(self) -> dict:
        """Its name and capabilities; the settings are mx.quantize's (the class says the rest by raising)."""
        return {"protocol": PROTOCOL, "name": f"{self.batch_class.__module__}.{self.batch_class.__qualname__}",
                "language": "python", "version": "",
                "capabilities": [name for name, offered in self.capabilities.items() if offered],
                "bits": list(BITS), "group_sizes": list(GROUP_SIZES), "dtypes": list(DTYPES)}

    def batch(self, args):
        handle = args.get("batch")
        if handle not in self.batches:
            raise ValueError(f"no batch {handle!r} (the process holds {sorted(self.batches)})")
        return self.batches[handle]

    def keep(self, batch) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.batches[handle] = batch
        return handle

    def answer(self, op: str, args: dict, tensors: Dict[str, mx.array]) -> Tuple[dict, List[Tuple[str, mx.array]]]:
        """One request's result and tensors; what the member raises, raised."""
        if op == "merge":
            return {"batch": self.keep(self.batch_class.merge([row_of(i, row, tensors)
                                                               for i, row in enumerate(args["rows"])]))}, []
        if op == "free":
            for handle in args["batches"]:
                self.batches.pop(handle, None)
            return {}, []
        batch = self.batch(args)
        if op == "copy":
            return {"batch": self.keep(copy.deepcopy(batch))}, []
        if op == "extend":
            batch.extend(self.batch({"batch": args["other"]}))
        elif op == "filter":
            batch.filter(args["indices"])
        elif op == "extract":
            row = batch.extract(args["index"])
            fields = {"offset": row.offset, "bits": row.bits, "group_size": row.group_size,
                      "filled": row.keys is not None}
            return fields, triples(row.keys, row.values) if row.keys is not None else []
        elif op == "update_and_fetch":
            keys, values = batch.update_and_fetch(tensors["keys"], tensors["values"])
            return {}, triples(keys, values)
        elif op == "make_mask":
            mask = batch.make_mask(args["N"], return_array=args["return_array"], window_size=args["window_size"])
            if isinstance(mask, mx.array):
                return {"mask": "array"}, [("mask", mask)]
            if mask is None or mask == "causal":
                return {"mask": mask}, []
            raise TypeError(f"make_mask returned {type(mask).__name__}, which the protocol cannot carry")
        elif op == "trim":
            return {"trimmed": batch.trim(args["n"])}, []
        elif op == "rollback":
            if not self.capabilities.get("per_row_rollback"):
                raise NotImplementedError("rollback: per-row rollback is not supported")
            batch.rollback(args["amounts"])
        elif op == "prepare":
            batch.prepare(**{k: args.get(k) for k in ("left_padding", "lengths", "right_padding")
                             if args.get(k) is not None})
        elif op == "finalize":
            batch.finalize()
        elif op in ("offset", "left_padding"):
            value = getattr(batch, op)
            return ({}, [(op, value)]) if isinstance(value, mx.array) else ({op: value}, [])
        elif op == "state":
            state = batch.state
            keys, values = state[0], state[1]
            if keys is None:
                return {"filled": False}, []
            return {"filled": True}, triples(*(columns(x, width(batch)) for x in (keys, values)))
        elif op in ("size", "empty"):
            return {op: getattr(batch, op)()}, []
        elif op in ("nbytes", "bits", "group_size"):
            return {op: getattr(batch, op)}, []
        else:
            raise ValueError(f"unknown op {op!r}")
        return {}, []


def width(batch):
    """The columns of ``state`` kvparity reads (``size()``), or all where size() fails."""
    try:
        return int(batch.size())
    except Exception:
        return None


def columns(triple, width):
    """``triple`` cut to its first ``width`` token columns: the protocol
    sends ``state`` from column 0 to at least ``size()``, and a buffer past
    it is bytes that cross for nothing."""
    if width is None or not all(isinstance(x, mx.array) and x.ndim == 4 and x.shape[2] > width for x in triple):
        return triple
    return tuple(x[..., :width, :] for x in triple)


def triples(keys, values) -> List[Tuple[str, mx.array]]:
    return triple_tensors("keys", keys) + triple_tensors("values", values)


def row_of(i: int, fields: dict, tensors: Dict[str, mx.array]):
    """Row ``i`` of a merge, rebuilt as mlx-lm's solo cache."""
    if fields["bits"] is None:
        row = KVCache()
        if fields["filled"]:
            row.keys, row.values = tensors[f"rows.{i}.keys"], tensors[f"rows.{i}.values"]
    else:
        row = QuantizedKVCache(group_size=fields["group_size"], bits=fields["bits"])
        if fields["filled"]:
            row.keys = tuple(tensors[f"rows.{i}.keys.{part}"] for part in TRIPLE)
            row.values = tuple(tensors[f"rows.{i}.values.{part}"] for part in TRIPLE)
    row.offset = fields["offset"]
    return row


def serve(spec: str, stdin: int, stdout: int):
    """Answer requests on ``stdin`` until it ends."""
    implementation = load_implementation(spec)
    server = Server(implementation.batch_class, implementation.capabilities)
    write_all(stdout, encode({"id": 0, "ok": True, "op": "hello", "result": server.hello()}))
    reader = FrameReader(stdin)
    while True:
        try:
            header, tensors = reader.read()
        except EOFError:
            return
        try:
            result, out = server.answer(header["op"], header.get("args") or {}, tensors)
            frame = encode({"id": header["id"], "ok": True, "result": result}, out)
        except Exception as error:  # the member raised: its answer, and its traceback on stderr
            traceback.print_exc()
            frame = encode({"id": header.get("id"), "ok": False,
                            "error": {"type": type(error).__name__, "message": str(error)}})
        write_all(stdout, frame)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kvparity.suites.process_server package.module:Class", file=sys.stderr)
        return 2
    stdout = os.dup(1)
    os.dup2(2, 1)  # what the class prints must not reach the pipe
    sys.stdout = sys.stderr
    try:
        serve(argv[0], 0, stdout)
    except ImplementationError as error:
        print(f"process_server: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
