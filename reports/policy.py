"""Verdict tiers and the per-backend policy that decides which tier gates.

Tiers, strongest first: ``bit-exact`` > ``ulp<=N`` > ``kl<=tau`` (with top-1
agreement) > ``diverged``. A policy file names the tier L2 logits must reach
and whether L2 cache bytes gate (``bit-exact``) or are only reported
(``report``). L1 bytes are pure data movement: bit-exact on every backend,
whatever the policy says.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import mlx.core as mx

from kvparity.reports.results import NOT_SUPPORTED, SKIPPED

POLICIES = Path(__file__).parent / "policies"
TIERS = ("bit-exact", "ulp", "kl")
BIT_EXACT, DIVERGED = "bit-exact", "diverged"
TIER_FAMILIES = (BIT_EXACT, "ulp", "kl", DIVERGED)
# Checks a backend that is not batch-invariant may fail without a bug: logits,
# and the cache bytes the model writes from them. Any other check (raised,
# mask, alias, ...) is structural and puts a row at `diverged` whatever its logits.
LOGIT_CHECKS = ("logits", "tokens")
CACHE_CHECKS = ("bytes", "layout", "offset")


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Policy:
    backend: str
    logits_tier: str = "bit-exact"
    max_ulp: int = 0
    tau: float = 0.0
    cache_bytes: str = "bit-exact"
    path: str = ""

    def required(self) -> str:
        return {"bit-exact": "bit-exact", "ulp": f"ulp<={self.max_ulp}", "kl": f"kl<={self.tau} and top-1 agree"}[
            self.logits_tier
        ]

    def logits_ok(self, metrics: dict) -> bool:
        positions = metrics.get("positions", 0)
        if metrics.get("bit_exact", 0) == positions:
            return True
        if self.logits_tier == "ulp":
            return 0 <= metrics["max_ulp"] <= self.max_ulp
        if self.logits_tier == "kl":
            return metrics["kl_max"] <= self.tau and metrics["top1_agree"] == positions
        return False

    def gates(self, divergence, metrics: dict) -> bool:
        """Whether a divergence of an L2 row fails it under this policy."""
        if divergence.check in LOGIT_CHECKS:
            return not self.logits_ok(metrics)
        if divergence.check in CACHE_CHECKS and divergence.layer is not None:
            return self.cache_bytes == "bit-exact"
        return True  # raised, alias, ...: never a matter of numerics




def tier_of(row_metrics: Mapping, bytes_ok: bool) -> str:
    """The strongest tier a row reached: ``bit-exact`` > ``ulp<=N`` >
    ``kl<=tau and top-1 agree`` > ``diverged``, with N and tau as measured.

    ``row_metrics`` are a row's L2 logit statistics (empty for L1, where
    bytes are the whole story); ``bytes_ok`` says every cache check held.
    """
    positions = row_metrics.get("positions", 0)
    if not positions:
        return BIT_EXACT if bytes_ok else DIVERGED
    if bytes_ok and row_metrics["bit_exact"] == positions:
        return BIT_EXACT
    if row_metrics["top1_agree"] != positions:
        return DIVERGED  # a flipped greedy token is past every tolerance tier
    if row_metrics["max_ulp"] >= 0:  # -1: dtypes or shapes differ, no ULP distance
        return f"ulp<={row_metrics['max_ulp']}"
    if math.isfinite(row_metrics["kl_max"]):
        return f"kl<={_round_up(row_metrics['kl_max'])} and top-1 agree"
    return DIVERGED


def tier_family(tier: Optional[str]) -> Optional[str]:
    """``ulp<=3`` -> ``ulp``: tiers grouped for counting."""
    if tier is None:
        return None
    return next(f for f in TIER_FAMILIES if tier.startswith(f))


def bytes_ok(row) -> bool:
    """Every check other than logits held for the row (cache bytes, offsets, ...)."""
    return not any(d.check not in LOGIT_CHECKS for d in row.divergences)


def row_tier(row) -> Optional[str]:
    """A row's tier; None where nothing was compared (not supported, skipped)."""
    if row.verdict in (NOT_SUPPORTED, SKIPPED):
        return None
    if any(d.check not in LOGIT_CHECKS + CACHE_CHECKS for d in row.divergences):
        return DIVERGED
    return tier_of(row.metrics, bytes_ok(row))


def _round_up(x: float, digits: int = 3) -> str:
    """``x`` in ``digits`` significant digits, rounded up so a printed bound
    is still a bound."""
    text = f"{x:.{digits}g}"
    if float(text) >= x:
        return text
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return f"{float(text) + scale:.{digits}g}"


def load_policy(spec: Optional[str] = None) -> Policy:
    """A policy by backend name ("cpu", "gpu") or file path; default: the
    backend MLX runs on."""
    spec = spec or mx.default_device().type.name
    path = Path(spec) if spec.endswith(".json") else POLICIES / f"{spec}.json"
    try:
        doc = json.loads(path.read_text())
    except OSError:
        raise PolicyError(f"no policy {spec!r} (shipped: {', '.join(p.stem for p in POLICIES.glob('*.json'))})")
    except json.JSONDecodeError as error:
        raise PolicyError(f"{path}: not JSON: {error}")
    logits = doc.get("logits", {})
    tier = logits.get("tier", "bit-exact")
    if tier not in TIERS:
        raise PolicyError(f"{path}: logits.tier {tier!r} is not one of {', '.join(TIERS)}")
    if doc.get("cache_bytes", "bit-exact") not in ("bit-exact", "report"):
        raise PolicyError(f"{path}: cache_bytes must be 'bit-exact' or 'report'")
    return Policy(
        backend=doc.get("backend", path.stem),
        logits_tier=tier,
        max_ulp=int(logits.get("max_ulp", 0)),
        tau=float(logits.get("tau", 0.0)),
        cache_bytes=doc.get("cache_bytes", "bit-exact"),
        path=str(path),
    )
