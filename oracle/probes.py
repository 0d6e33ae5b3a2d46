"""L0 backend probes: is each op batch-invariant on this device?

An op is batch-invariant when row ``i`` of the op run on a batch of ``B`` rows
is byte-identical (dtype, shape and raw bytes) to the op run on row ``i``
alone. Where an op is not, a batched engine cannot be bit-exact against a solo
run however correct its cache is, so these results explain L2 outcomes.

Every op uses the model's own shapes and dtype. Inputs are built per row from
``(seed, row)``, so row ``i`` holds the same data at every batch size, and the
batch is the concatenation of the rows, as an engine's merge would build it.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union
import zlib

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import (
    create_causal_mask,
    quantized_scaled_dot_product_attention,
)

from kvparity.oracle.arrays import raw_many
from kvparity.oracle.mlx_lm_versions import defects_for
from kvparity.oracle.quantization import BITS, GROUP_SIZES

# Quantized Linear layers of a 4-bit mlx-lm model.
WEIGHT_BITS = 4
WEIGHT_GROUP_SIZE = 64

# The vocab projection is probed only below this many weights, so a large
# vocab does not dominate the run (a 128k x 4096 head is 1 GB in bf16).
MAX_VOCAB_WEIGHTS = 1 << 26

# Tokens of a speculative verify window (3 drafts and the bonus token).
WINDOW = 4

# Tokens of a prefill chunk quantized in one call.
CHUNK = 16


class ProbeUnavailable(RuntimeError):
    """The requested device is not available in this MLX build."""


@dataclass(frozen=True)
class ProbeShapes:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: mx.Dtype
    kv_bits: int = 4
    kv_group_size: int = 64

    def __post_init__(self):
        for name in ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) is not a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if not isinstance(self.dtype, mx.Dtype) or not mx.issubdtype(
            self.dtype, mx.floating
        ):
            raise ValueError(f"dtype must be a floating mx.Dtype, got {self.dtype}")
        if self.kv_bits not in BITS:
            raise ValueError(
                f"kv_bits must be one of {BITS}, got {self.kv_bits}"
            )
        if self.kv_group_size not in GROUP_SIZES:
            raise ValueError(
                f"kv_group_size must be one of {GROUP_SIZES}, "
                f"got {self.kv_group_size}"
            )
        if self.head_dim % self.kv_group_size:
            raise ValueError(
                f"kv_group_size ({self.kv_group_size}) does not divide "
                f"head_dim ({self.head_dim})"
            )

    @classmethod
    def from_args(
        cls,
        *,
        hidden_size,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size,
        dtype,
        kv_bits=4,
        kv_group_size=64,
    ) -> "ProbeShapes":
        # Accept "bfloat16" as well as mx.bfloat16 (command lines, JSON configs).
        if isinstance(dtype, str):
            dtype = getattr(mx, dtype.removeprefix("mlx.core."), dtype)
        return cls(
            hidden_size=int(hidden_size),
            n_heads=int(n_heads),
            n_kv_heads=int(n_kv_heads),
            head_dim=int(head_dim),
            vocab_size=int(vocab_size),
            dtype=dtype,
            kv_bits=int(kv_bits),
            kv_group_size=int(kv_group_size),
        )


@dataclass(frozen=True)
class ProbeResult:
    op: str  # a key of OPS
    batch_size: int
    invariant: bool  # every row byte-identical (bytes, dtype, shape) to its solo run
    max_abs_diff: float  # in float32 over differing elements; 0.0 when invariant
    first_row: Optional[int]  # first row that differs
    error: Optional[str]  # the op raised on this device (then invariant is False)
    # Set when mlx-lm's own code, not the backend, makes the op differ: the
    # installed mlx-lm's defect, with what it does and where.
    attribution: Optional[str] = None


# An op maps (shapes, batch_size, seed) to the outputs of the batched run and,
# per row, the outputs of the solo run. Every output has the batch on axis 0.
Outputs = tuple
Op = Callable[[ProbeShapes, int, int], tuple[Outputs, list[Outputs]]]


def _normal(shape, dtype, seed, tag, row=0, scale=1.0) -> mx.array:
    # numpy draws, so inputs do not depend on the device or on MLX's RNG.
    rng = np.random.default_rng((seed, zlib.crc32(tag.encode()), row))
    x = (scale * rng.standard_normal(shape)).astype(np.float32)
    return mx.array(x).astype(dtype)


def _integer(seed, tag, row, high) -> int:
    rng = np.random.default_rng((seed, zlib.crc32(tag.encode()), row))
    return int(rng.integers(0, high))


def _run(kernel, batched_args, solo_args) -> tuple[Outputs, list[Outputs]]:
    return kernel(*batched_args), [kernel(*args) for args in solo_args]


def _stack_rows(rows) -> tuple:
    """Batched arguments from per-row arguments (each with a batch of 1)."""
    return tuple(mx.concatenate(arg, axis=0) for arg in zip(*rows))


def _projections(s: ProbeShapes, seed):
    """Decode-shaped projections: hidden -> hidden and, if cheap, hidden -> vocab."""
    h = s.hidden_size
    ws = [_normal((h, h), s.dtype, seed, "w_hidden", scale=h**-0.5)]
    if s.vocab_size * h <= MAX_VOCAB_WEIGHTS:
        ws.append(_normal((s.vocab_size, h), s.dtype, seed, "w_vocab", scale=h**-0.5))
    return ws


def _decode_rows(s: ProbeShapes, B, seed):
    return [(_normal((1, 1, s.hidden_size), s.dtype, seed, "x", i),) for i in range(B)]


def probe_matmul(s: ProbeShapes, B: int, seed: int):
    ws = _projections(s, seed)

    # Weights are stored (out, in) and applied as nn.Linear does.
    def kernel(x):
        return tuple(x @ w.T for w in ws)

    rows = _decode_rows(s, B, seed)
    return _run(kernel, _stack_rows(rows), rows)


def probe_quantized_matmul(s: ProbeShapes, B: int, seed: int):
    qws = [
        mx.quantize(w, group_size=WEIGHT_GROUP_SIZE, bits=WEIGHT_BITS)
        for w in _projections(s, seed)
    ]

    # As nn.QuantizedLinear calls it.
    def kernel(x):
        return tuple(
            mx.quantized_matmul(
                x, *qw, transpose=True, group_size=WEIGHT_GROUP_SIZE, bits=WEIGHT_BITS
            )
            for qw in qws
        )

    rows = _decode_rows(s, B, seed)
    return _run(kernel, _stack_rows(rows), rows)


def probe_quantize(s: ProbeShapes, B: int, seed: int):
    # A decode token and a prefill chunk, as QuantizedKVCache.update_and_fetch
    # quantizes them: (packed, scales, biases) for each.
    def kernel(*ks):
        return tuple(
            t
            for k in ks
            for t in mx.quantize(k, group_size=s.kv_group_size, bits=s.kv_bits)
        )

    rows = [
        tuple(
            _normal((1, s.n_kv_heads, n, s.head_dim), s.dtype, seed, f"k{n}", i)
            for n in (1, CHUNK)
        )
        for i in range(B)
    ]
    return _run(kernel, _stack_rows(rows), rows)


def probe_rope_per_row_offset(s: ProbeShapes, B: int, seed: int):
    # Batched: an mx.array of per-row offsets (BatchKVCache.offset); solo: the
    # row's own int offset (KVCache.offset). Queries and keys, at decode and
    # over a verify window.
    def kernel(offset, *xs):
        return tuple(
            mx.fast.rope(
                x, s.head_dim, traditional=False, base=10000, scale=1.0, offset=offset
            )
            for x in xs
        )

    def xs(i):
        return [
            _normal((1, heads, n, s.head_dim), s.dtype, seed, f"rope_{name}{n}", i)
            for name, heads in (("q", s.n_heads), ("k", s.n_kv_heads))
            for n in (1, WINDOW)
        ]

    offsets = [_integer(seed, "rope_offset", i, 4096) for i in range(B)]
    solo = [(offsets[i], *xs(i)) for i in range(B)]
    batched = (mx.array(offsets), *_stack_rows([args[1:] for args in solo]))
    return _run(kernel, batched, solo)


def _pad_left(triple, n):
    # Pad columns hold zero packed words, scales and biases.
    return tuple(mx.pad(t, [(0, 0), (0, 0), (n, 0), (0, 0)]) for t in triple)


def _sdpa(s: ProbeShapes, seed: int, n: int, lengths: Sequence[int]):
    """Rows of the given lengths whose last ``n`` tokens are the queries."""

    def kernel(q, keys, values, mask):
        # mlx-lm scales the queries in place: hand it its own array.
        return quantized_scaled_dot_product_attention(
            mx.array(q),
            keys,
            values,
            scale=s.head_dim**-0.5,
            mask=mask,
            group_size=s.kv_group_size,
            bits=s.kv_bits,
        )

    def quantized(tag, i, length):
        x = _normal((1, s.n_kv_heads, length, s.head_dim), s.dtype, seed, tag, i)
        return mx.quantize(x, group_size=s.kv_group_size, bits=s.kv_bits)

    width = max(lengths)
    pads = [width - length for length in lengths]

    solo = []
    for i, length in enumerate(lengths):
        q = _normal((1, s.n_heads, n, s.head_dim), s.dtype, seed, f"q{n}", i)
        # What mlx-lm's solo QuantizedKVCache.make_mask gives.
        mask = None if n == 1 else "causal"
        keys, values = quantized(f"k{n}", i, length), quantized(f"v{n}", i, length)
        solo.append((q, keys, values, mask))

    def stack(j):
        return tuple(
            mx.concatenate(ts, axis=0)
            for ts in zip(*(_pad_left(args[j], p) for args, p in zip(solo, pads)))
        )

    q = mx.concatenate([args[0] for args in solo], axis=0)
    # What BatchKVCache.make_mask gives once the n tokens are in the cache.
    mask = create_causal_mask(n, width - n, left_padding=mx.array(pads))
    return _run(kernel, (q, stack(1), stack(2), mask), solo)


def probe_quantized_sdpa_left_padding(s: ProbeShapes, B: int, seed: int):
    # Row lengths include the n new tokens; pads are uneven by construction.
    def lengths(n):
        return [n + _integer(seed, f"sdpa_len{n}", i, 200) for i in range(B)]

    decode, decode_solo = _sdpa(s, seed, 1, lengths(1))
    verify, verify_solo = _sdpa(s, seed, WINDOW, lengths(WINDOW))
    return (decode, verify), list(zip(decode_solo, verify_solo))


# The ops that run mlx-lm's own code (the rest are MLX's): where one differs,
# an installed mlx-lm defect that reaches the shapes is named as the cause.
MLX_LM_OPS = ("quantized_sdpa_left_padding",)

OPS: dict[str, Op] = {
    "matmul": probe_matmul,
    "quantized_matmul": probe_quantized_matmul,
    "quantize": probe_quantize,
    "rope_per_row_offset": probe_rope_per_row_offset,
    "quantized_sdpa_left_padding": probe_quantized_sdpa_left_padding,
}


def compare_rows(batched: Outputs, solos: list[Outputs]):
    """(invariant, max_abs_diff, first_row) of a batched run against solo runs."""
    max_diff, first_row = 0.0, None
    for i, solo in enumerate(solos):
        for out, ref in zip(batched, solo, strict=True):
            row = out[i : i + 1]
            if row.dtype != ref.dtype or row.shape != ref.shape:
                diff = float("inf")
            else:
                # Raw bits: unlike mx.array_equal, tells -0.0 from 0.0 and
                # NaN payloads apart.
                a, b = raw_many([row, ref])
                differ = a != b
                if not differ.any():
                    continue
                a = np.array(row.astype(mx.float32))
                b = np.array(ref.astype(mx.float32))
                diff = np.abs(a - b)[differ]
                diff = float(np.nan_to_num(diff, nan=np.inf).max())
            max_diff = max(max_diff, diff)
            first_row = i if first_row is None else first_row
    return first_row is None, max_diff, first_row


def _attribution(name: str, shapes: ProbeShapes) -> Optional[str]:
    if name not in MLX_LM_OPS:
        return None
    found = defects_for(shapes.n_heads, shapes.n_kv_heads)
    return "; ".join(d.attribution() for d in found) or None


def _probe(name: str, op: Op, shapes: ProbeShapes, B: int, seed: int) -> ProbeResult:
    try:
        batched, solos = op(shapes, B, seed)
        # MLX is lazy: a kernel that fails does so here.
        mx.eval(batched, solos)
        invariant, diff, first_row = compare_rows(batched, solos)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        return ProbeResult(name, B, False, float("nan"), None, error, _attribution(name, shapes))
    attribution = None if invariant else _attribution(name, shapes)
    return ProbeResult(name, B, invariant, diff, first_row, None, attribution)


def _device(device) -> mx.Device:
    if device is None:
        return mx.default_device()
    if isinstance(device, str):
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
        device = getattr(mx, device)
    if isinstance(device, mx.DeviceType):
        device = mx.Device(device)
    if not mx.is_available(device):
        raise ProbeUnavailable(
            f"{device} is not available in this MLX build (mlx {mx.__version__})"
        )
    return device


def run_probes(
    shapes: ProbeShapes,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    device: Union[None, str, mx.Device] = None,
    seed: int = 0,
) -> list[ProbeResult]:
    """Probe every op in ``OPS`` at every batch size on ``device``."""
    device = _device(device)
    results = []
    with mx.stream(device):
        for name, op in OPS.items():
            for B in batch_sizes:
                results.append(_probe(name, op, shapes, B, seed))
    return results


def _cell(r: ProbeResult) -> str:
    if r.error is not None:
        msg = r.error.splitlines()[0] if r.error else ""
        cell = f"error: {msg[:60]}"
    else:
        cell = "yes" if r.invariant else f"NO ({r.max_abs_diff:.1e})"
    return cell if r.attribution is None else f"{cell} [mlx-lm defect]"


def probe_notes(results: Sequence[ProbeResult]) -> list[str]:
    """Each mlx-lm defect the table marks, said once, with the ops it reached."""
    ops = {}
    for r in results:
        if r.attribution is not None:
            ops.setdefault(r.attribution, []).append(f"{r.op} B={r.batch_size}")
    return [f"[mlx-lm defect] {', '.join(where)}: {text}" for text, where in ops.items()]


def probe_table(results: Sequence[ProbeResult]) -> tuple[list[str], list[list]]:
    """Headers and rows for tabulate: one row per op, one column per batch size."""
    sizes = sorted({r.batch_size for r in results})
    ops = list(dict.fromkeys(r.op for r in results))
    cells = {(r.op, r.batch_size): _cell(r) for r in results}
    headers = ["op"] + [f"B={b}" for b in sizes]
    rows = [[op] + [cells.get((op, b), "") for b in sizes] for op in ops]
    return headers, rows
