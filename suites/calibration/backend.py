"""Running on a backend that may not cooperate: how attention reads the
caches' triples, what native code prints instead of raising, and errors
recorded as one line rather than raised."""

import os
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from typing import List

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.suites.l2 import run as l2
from kvparity.suites.core.adapter import patched
from kvparity.suites.core.evidence import OracleFailed
from kvparity.suites.format.levels import L2

# What the backend may print instead of raising.
BACKEND_WARNINGS = ("TMA", "No implementation", "error", "Error")

# How the quantized caches hand their triples to attention. "as-is" is
# mlx-lm's own path (slices of the step-256 buffers). "contiguous" copies the
# slices first: the same values, so the same mathematics, but not mlx-lm's
# code path; it is used only where the backend has no kernel for the slices,
# and every result says which mode produced it.
READS = ("as-is", "contiguous")


@contextmanager
def reads(mode: str, *implementations):
    """``contiguous``: mlx-lm's ``QuantizedKVCache`` and each implementation's
    batch class hand attention contiguous copies of their triples (each class
    patched in its own namespace while the block runs, its bases untouched)."""
    if mode == "as-is":
        yield
        return
    classes = list(dict.fromkeys([QuantizedKVCache] + [i.batch_class for i in implementations]))
    originals = [c.update_and_fetch for c in classes]  # each as it is before any is patched

    def wrap(original):
        def update_and_fetch(self, keys, values):
            return tree_map(mx.contiguous, original(self, keys, values))
        return update_and_fetch

    with ExitStack() as stack:
        for c, original in zip(classes, originals):
            stack.enter_context(patched(c, {"update_and_fetch": wrap(original)}))
        yield


def reading(mode, implementation, run, *args) -> dict:
    """``run(*args)`` with attention reading its keys as ``mode`` says; the
    result records the mode."""
    with reads(mode, implementation):
        result = run(*args)
    return {**result, "reads": mode}


@contextmanager
def captured_stderr():
    """Collect what native code writes to file descriptor 2 (MLX's CUDA
    backend prints some kernel failures instead of raising)."""
    sys.stderr.flush()
    saved = os.dup(2)
    box: List[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode(errors="replace"))


def backend_warnings(text: str) -> List[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [line for line in lines if any(w in line for w in BACKEND_WARNINGS)]


def error_text(error: BaseException) -> str:
    """One line for the record. Where mlx-lm's solo path raised, its own
    error (L2 wraps it to say whose path it was)."""
    if isinstance(error, OracleFailed) and error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def fresh_solo_traces(model, schedule, twice=False):
    """L2's solo traces, never from the oracle cache; with ``twice`` a second
    run must equal the first byte for byte (else ``OracleNondeterministic``)."""
    return l2.solo_traces(schedule, model, use_cache=False, repeat=twice)


def schedule_doc(model, bits, group_size, requests, events, name="calibration") -> dict:
    return {
        "name": name,
        "levels": [L2],
        "kv": {"bits": bits, "group_size": group_size},
        "synthetic": {
            "kv_heads": model.n_kv_heads,
            "head_dim": model.head_dim,
            "dtype": "float32" if model.dtype == mx.float32 else "bfloat16",
        },
        "requests": requests,
        "events": events,
    }
