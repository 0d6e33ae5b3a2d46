"""How far a batched run's logits are from the solo ones, per position.

``batched_rows`` runs a schedule through L2's replay core (its model
backend, teacher-forced from the solo traces) and measures each position the
implementation computed against its solo logits: bit equality, ULP
distance, KL(solo || batched) and top-1 agreement. ``summarize`` pools them.
"""

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from kvparity.oracle.arrays import raw
from kvparity.oracle.solo import log_probs
from kvparity.suites.l2.run import ModelBackend
from kvparity.suites.core.metrics import kl_divergence
from kvparity.suites.core.replay import Replay


def ordered(x: mx.array) -> Optional[np.ndarray]:
    """Floats as integers on a monotone line, so |a - b| counts ULPs."""
    width = {2: np.int16, 4: np.int32}.get(x.dtype.size)
    if width is None:
        return None
    v = raw(x).view(width).astype(np.int64)
    sign = np.int64(1) << (8 * x.dtype.size - 1)
    return np.where(v < 0, -(v & (sign - 1)), v)


def compare_positions(solo: mx.array, batched: mx.array) -> List[dict]:
    """Per position of one call: bit equality, max ULP, max abs diff,
    KL(solo || batched) in nats, and greedy (top-1) agreement."""
    s, b = np.array(solo.astype(mx.float32)), np.array(batched.astype(mx.float32))
    rs, rb = raw(solo).reshape(s.shape[0], -1), raw(batched).reshape(b.shape[0], -1)
    os_, ob = ordered(solo), ordered(batched)
    kl = kl_divergence(s, b)
    top_s = np.array(mx.argmax(log_probs(solo), axis=-1)).reshape(-1)
    top_b = np.array(mx.argmax(log_probs(batched), axis=-1)).reshape(-1)
    out = []
    for p in range(s.shape[0]):
        ulp = int(np.abs(os_[p] - ob[p]).max()) if os_ is not None and solo.dtype == batched.dtype else -1
        out.append({
            "exact": bool(np.array_equal(rs[p], rb[p])),
            "ulp": ulp,
            "abs": float(np.abs(s[p] - b[p]).max()),
            "kl": float(max(kl[p], 0.0)),
            "top1": bool(top_s[p] == top_b[p]),
            "token": int(top_b[p]),
        })
    return out


def batched_rows(model, implementation, schedule, traces) -> Dict[str, list]:
    """L2's batched run (the one replay core), teacher-forced from
    ``traces``: per request, a list of (event kind, call index, position
    records, logits); the event kind is "alone" for logits that did not come
    out of the implementation (a joiner's solo prefill, a row waiting for
    mlx-lm's conversion). What raises propagates: the caller records it."""
    backend = ModelBackend(model, implementation, schedule, traces)
    driver = Replay(schedule, backend)
    backend.replay = driver
    rows: Dict[str, list] = {rid: [] for rid in schedule.requests}
    with implementation.watching():
        for event in schedule.events:
            driver.apply(event)
            for out in backend.outputs:
                expected = traces[out.request].calls[out.step].logits
                mx.eval(out.logits)
                kind = event.kind if out.from_implementation else "alone"
                rows[out.request].append((kind, out.step, compare_positions(expected, out.logits), out.logits))
    return rows


def batched_positions(records) -> List[dict]:
    """Positions computed in a batched forward of the implementation."""
    return [p for kind, _, positions, _ in records if kind in ("step", "spec_round") for p in positions]


def summarize(positions: List[dict]) -> dict:
    if not positions:
        return {"positions": 0}
    kl = np.array([p["kl"] for p in positions])
    ulp = np.array([p["ulp"] for p in positions])
    return {
        "positions": len(positions),
        "bit_exact": int(sum(p["exact"] for p in positions)),
        "top1_agree": int(sum(p["top1"] for p in positions)),
        "max_abs_diff": float(max(p["abs"] for p in positions)),
        "max_ulp": int(ulp.max()),
        "ulp_p50": float(np.percentile(ulp, 50)),
        "ulp_p99": float(np.percentile(ulp, 99)),
        "kl_mean": float(kl.mean()),
        "kl_p50": float(np.percentile(kl, 50)),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_p999": float(np.percentile(kl, 99.9)),
        "kl_max": float(kl.max()),
        # log10 histogram of KL, 0 counted apart
        "kl_zero": int((kl == 0).sum()),
        "kl_log10_histogram": histogram(kl),
    }


def histogram(values: np.ndarray) -> Dict[str, int]:
    positive = values[values > 0]
    if not positive.size:
        return {}
    bins = np.floor(np.log10(positive)).astype(int)
    return {f"1e{b}": int((bins == b).sum()) for b in sorted(set(bins.tolist()))}
