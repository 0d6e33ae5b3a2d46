"""How far batched logits are from solo logits, beyond bit equality."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from kvparity.oracle.arrays import raw


SERIES = ("max_abs_diff", "max_ulp", "kl_max", "bit_exact")


@dataclass
class LogitStats:
    """Accumulates per-position comparisons of one row's logits."""

    positions: int = 0
    bit_exact: int = 0
    top1_agree: int = 0
    max_abs_diff: float = 0.0
    max_ulp: Optional[int] = None  # None until a comparable position was seen
    comparable: bool = True  # False once a dtype or shape differed
    kl: List[float] = field(default_factory=list)  # KL(solo || batched) per position
    # per step (index = the request's call): how far that call's logits moved
    series: Dict[str, List] = field(default_factory=lambda: {k: [] for k in SERIES})

    def add(self, solo: mx.array, batched: mx.array, step: int):
        if solo.dtype != batched.dtype or tuple(solo.shape) != tuple(batched.shape):
            self.comparable = False  # no distance between them: a layout failure
            self.positions += solo.shape[0]
            return
        s = np.array(solo.astype(mx.float32))
        b = np.array(batched.astype(mx.float32))
        exact = int(sum(np.array_equal(x, y) for x, y in zip(_bits(solo), _bits(batched))))
        abs_diff = float(np.abs(s - b).max(initial=0.0))
        ulp = ulp_distance(solo, batched)
        kl = kl_divergence(s, b)
        self.positions += s.shape[0]
        self.bit_exact += exact
        self.top1_agree += int((s.argmax(-1) == b.argmax(-1)).sum())
        self.max_abs_diff = max(self.max_abs_diff, abs_diff)
        self.max_ulp = ulp if self.max_ulp is None else max(self.max_ulp, ulp)
        self.kl += kl.tolist()
        for name, value in zip(SERIES, (abs_diff, ulp, float(kl.max(initial=0.0)), exact / s.shape[0])):
            column = self.series[name]
            column.extend([None] * (step + 1 - len(column)))
            column[step] = value

    def as_dict(self) -> dict:
        kl = np.array(self.kl) if self.kl else np.zeros(1)
        return {
            "positions": self.positions,
            "bit_exact": self.bit_exact,
            "top1_agree": self.top1_agree,
            "max_abs_diff": self.max_abs_diff,
            "max_ulp": self.max_ulp,
            "comparable": self.comparable,
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "kl_p99": float(np.percentile(kl, 99)),
            "kl_p95": float(np.percentile(kl, 95)),
            "kl_median": float(np.median(kl)),
        }


def _bits(x: mx.array) -> np.ndarray:
    return raw(x).reshape(x.shape[0], -1)


def ulp_distance(a: mx.array, b: mx.array) -> int:
    """Largest distance in units in the last place, through the float's
    ordered integer encoding (sign-magnitude mapped to a monotone line).
    Both arrays have one float dtype and one shape."""
    width = {2: np.int16, 4: np.int32}[a.dtype.size]
    x, y = (raw(v).view(width).astype(np.int64) for v in (a, b))
    sign = np.int64(1) << (8 * a.dtype.size - 1)
    x = np.where(x < 0, -(x & (sign - 1)), x)
    y = np.where(y < 0, -(y & (sign - 1)), y)
    return int(np.abs(x - y).max(initial=0))


def kl_divergence(solo_logits: np.ndarray, batched_logits: np.ndarray) -> np.ndarray:
    """KL(solo || batched) per position, in nats, computed in float64."""
    p = _log_softmax(solo_logits.astype(np.float64))
    q = _log_softmax(batched_logits.astype(np.float64))
    return (np.exp(p) * (p - q)).sum(-1)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
