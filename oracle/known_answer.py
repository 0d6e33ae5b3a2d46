"""Does this device compute? A known-answer check run before a device is trusted.

A batch and its solo run that agree prove nothing on a device whose kernels
return wrong numbers (zeros, stale memory): both can agree on them. So the
gate first runs the operations a quantized KV cache and mlx-lm's attention
use on fixed inputs whose answers are known exactly, and compares bytes.

The inputs are built on the quantization grid: each group of 64 holds
integer codes times a power of two, its smallest and largest code included.
Affine quantization of such a group is exact on any correct device (the
scale is that power of two, the codes are the integers), and every product
and sum the attention checks form is a small multiple of a power of two, so
the answers are exact in float16 and float32 whatever order a kernel adds
in. The answers come from the CPU: the packed bytes from ``mx.quantize`` on
the CPU stream, the rest from numpy in float64. No tolerance is needed.

An operation the device cannot run (it raises) is noted, not failed: that is
no wrong number, and the schedules that need it say "cannot run" themselves.
"""

from dataclasses import dataclass, field
from typing import Callable, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from kvparity.oracle.machine import device_name

GROUP_SIZE = 64
HEAD_DIM = 64  # 1/sqrt(64) is exact: the attention scale adds no rounding
BATCH, HEADS, KEYS = 2, 2, 16
# Row 1 of the batch is left-padded to half its keys: 8 and 16 visible keys
# keep softmax's uniform weights (1/8, 1/16) exact.
LEFT_PADDING = (0, KEYS // 2)
SEED = 20261202
PARTS = ("packed words", "scales", "biases")


@dataclass
class KnownAnswer:
    """The check on one device: comparisons made, those that failed, and the
    operations the device raised on (not compared)."""

    device: str
    comparisons: int = 0
    failures: List[str] = field(default_factory=list)
    unavailable: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.comparisons > 0 and not self.failures

    @property
    def summary(self) -> str:
        raised = f"; the device raised on {len(self.unavailable)}: {'; '.join(self.unavailable)}" \
            if self.unavailable else ""
        if self.passed:
            return f"{self.device}: known-answer check passed ({self.comparisons} byte comparisons{raised})"
        return (f"{self.device} failed its known-answer check ({len(self.failures)} of {self.comparisons} "
                f"comparisons): {'; '.join(self.failures)}{raised}")

    def compare(self, what: str, compute: Callable[[], mx.array], expected: mx.array):
        """``compute()`` runs the operation on the device; its result is compared with ``expected``."""
        try:
            got = compute()
            mx.eval(got)
        except Exception as error:  # noqa: BLE001 - whatever the backend raises, it did not compute
            self.unavailable.append(f"{what}: {type(error).__name__}: {error}")
            return
        self.comparisons += 1
        same = got.dtype == expected.dtype and got.shape == expected.shape and mx.array_equal(
            got, expected, stream=mx.cpu).item()
        if not same:
            self.failures.append(f"{what}: {_difference(got, expected)}")

    def to_json(self) -> dict:
        return {"device": self.device, "passed": self.passed, "comparisons": self.comparisons,
                "failures": list(self.failures), "unavailable": list(self.unavailable)}


def _difference(got: mx.array, expected: mx.array) -> str:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"got {got.dtype}{tuple(got.shape)}, expected {expected.dtype}{tuple(expected.shape)}"
    a = np.asarray(got.astype(mx.float32) if got.dtype in (mx.bfloat16, mx.float16) else got)
    b = np.asarray(expected.astype(mx.float32) if expected.dtype in (mx.bfloat16, mx.float16) else expected)
    wrong = np.flatnonzero(a.ravel() != b.ravel())
    first = int(wrong[0])
    return (f"{wrong.size} of {a.size} elements differ, the first at flat index {first}: "
            f"got {float(a.ravel()[first])!r}, expected {float(b.ravel()[first])!r}")


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def on_grid(rng, shape, bits: int, step: float) -> np.ndarray:
    """Values ``(code - 2**(bits-1)) * step``, each group of GROUP_SIZE along
    the last axis holding the smallest and the largest code."""
    top = 2 ** bits - 1
    codes = rng.integers(0, top + 1, size=shape)
    codes[..., ::GROUP_SIZE] = 0
    codes[..., 1::GROUP_SIZE] = top
    return (codes - 2 ** (bits - 1)) * step


def _mask() -> np.ndarray:
    visible = np.arange(KEYS)[None, :] >= np.array(LEFT_PADDING)[:, None]
    return visible[:, None, None, :]  # (batch, heads, queries, keys)


def _check_quantize(answer: KnownAnswer, rng, device, bits: int, dtype):
    x = mx.array(on_grid(rng, (BATCH, HEADS, KEYS, HEAD_DIM), bits, 2.0 ** -4)).astype(dtype)
    on_cpu = mx.quantize(x, group_size=GROUP_SIZE, bits=bits, stream=mx.cpu)
    for part, expected in enumerate(on_cpu):
        answer.compare(f"quantize {bits}-bit {_name(dtype)} {PARTS[part]}",
                       lambda: mx.quantize(x, group_size=GROUP_SIZE, bits=bits, stream=device)[part], expected)
    answer.compare(f"dequantize {bits}-bit {_name(dtype)}",
                   lambda: mx.dequantize(*on_cpu, group_size=GROUP_SIZE, bits=bits, stream=device), x)


def _check_attention(answer: KnownAnswer, rng, device, bits: int, dtype):
    """mlx-lm's quantized attention and MLX's fused attention, decoding one
    token over left-padded rows: identical keys make every score equal, so
    the output is the mean of the visible values; the scores themselves are
    checked with distinct keys through ``quantized_matmul``."""
    step = 2.0 ** -2
    queries = mx.array(rng.integers(-1, 2, size=(BATCH, HEADS, 1, HEAD_DIM)) * 0.5).astype(dtype)
    keys = on_grid(rng, (BATCH, HEADS, KEYS, HEAD_DIM), bits, step)
    q_keys = mx.quantize(mx.array(keys).astype(dtype), group_size=GROUP_SIZE, bits=bits, stream=mx.cpu)
    exact = np.asarray(queries.astype(mx.float32)).astype(np.float64) @ np.swapaxes(keys, -1, -2)
    answer.compare(f"quantized_matmul {bits}-bit {_name(dtype)} (attention scores)",
                   lambda: mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=GROUP_SIZE, bits=bits,
                                               stream=device),
                   mx.array(exact.astype(np.float32)).astype(dtype))

    same_keys = np.broadcast_to(keys[:, :, :1, :], keys.shape)
    values = on_grid(rng, (BATCH, HEADS, KEYS, HEAD_DIM), bits, step)
    visible = _mask()
    mean = (values * visible[..., 0, :, None]).sum(axis=-2, keepdims=True) / visible.sum(axis=-1, keepdims=True)
    expected = mx.array(mean.astype(np.float32)).astype(dtype)
    dense_keys, dense_values = (mx.array(a).astype(dtype) for a in (same_keys, values))
    quantized = [tuple(mx.quantize(a, group_size=GROUP_SIZE, bits=bits, stream=mx.cpu))
                 for a in (dense_keys, dense_values)]
    scale, mask = HEAD_DIM ** -0.5, mx.array(visible)

    def fused():
        with mx.stream(device):
            return mx.fast.scaled_dot_product_attention(queries, dense_keys, dense_values, scale=scale, mask=mask)

    def mlx_lm_attention():
        with mx.stream(device):
            return quantized_scaled_dot_product_attention(queries, *quantized, scale=scale, mask=mask,
                                                          group_size=GROUP_SIZE, bits=bits)

    grid = f"{_name(dtype)} over left padding, {bits}-bit grid"
    answer.compare(f"scaled_dot_product_attention {grid}", fused, expected)
    answer.compare(f"mlx-lm quantized attention {grid}", mlx_lm_attention, expected)


def _device(device) -> mx.Device:
    if device is None:
        return mx.default_device()
    return mx.Device(device) if isinstance(device, mx.DeviceType) else device


def known_answer(device=None) -> KnownAnswer:
    """Run the check on ``device`` (a Device or a DeviceType such as
    ``mx.gpu``; default: MLX's default device)."""
    device = _device(device)
    answer = KnownAnswer(device_name(device))
    rng = np.random.default_rng(SEED)
    for bits in (4, 8):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            _check_quantize(answer, rng, device, bits, dtype)
        for dtype in (mx.float16, mx.float32):
            _check_attention(answer, rng, device, bits, dtype)
    return answer


_CHECKED: dict = {}


def checked(device=None) -> KnownAnswer:
    """``known_answer(device)``, run once per device in a process."""
    device = _device(device)
    if str(device) not in _CHECKED:
        _CHECKED[str(device)] = known_answer(device)
    return _CHECKED[str(device)]
