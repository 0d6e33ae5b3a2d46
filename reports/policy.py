"""Verdict tiers and the per-backend policy that decides which tier gates.

Tiers, strongest first: ``bit-exact`` > ``ulp<=N`` > ``kl<=tau`` (with top-1
agreement) > ``diverged``. A policy file names the tier L2 logits must reach
and whether L2 cache bytes gate (``bit-exact``) or are only reported
(``report``). L1 bytes are pure data movement: bit-exact on every backend,
whatever the policy says.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

POLICIES = Path(__file__).parent / "policies"
TIERS = ("bit-exact", "ulp", "kl")
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


def tier_reached(metrics: dict, divergences) -> str:
    """The strongest tier a row's logits reached, with its measured bound."""
    positions = metrics.get("positions", 0)
    if not positions:
        return "bit-exact" if not divergences else "diverged"
    if metrics["bit_exact"] == positions:
        return "bit-exact"
    if metrics["max_ulp"] >= 0 and metrics["top1_agree"] == positions:
        return f"ulp<={metrics['max_ulp']}"
    if metrics["top1_agree"] == positions:
        return f"kl<={metrics['kl_max']:.3g}"
    return "diverged"


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
