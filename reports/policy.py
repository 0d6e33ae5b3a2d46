"""Verdict tiers and the per-backend policy that decides which tier gates.

Logit tiers, strongest first: ``bit-exact`` > ``ulp<=N`` > ``kl<=tau and
top-1 agree`` > ``diverged``, with N and tau named in the policy. A policy
file says which tier L2 logits must reach, whether the cache bytes a model
writes gate (``bit-exact``) or are only reported (``report``), whether
hygiene findings gate (``strict``) or are only reported, and whether a
declared divergence that no longer happens (``unexpected_passes``) fails the
run (``strict``) or is only reported. L1 bytes are pure
data movement: bit-exact on every backend, whatever the policy says; and
``layout`` (a dtype or shape that differs, a missing array) gates always.
"""

import math
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Mapping, Optional

from kvparity.oracle.inputs import read_json
from kvparity.suites.format.checks import BY_HYGIENE_POLICY, BY_TIER, CHECKS, MODEL_WRITTEN
from kvparity.suites.format.levels import L1

POLICIES = Path(files(__package__) / "policies")  # package data
BIT_EXACT, DIVERGED = "bit-exact", "diverged"
GATES = (BIT_EXACT, "ulp", "kl")
TIER_FAMILIES = (*GATES, DIVERGED)
REPORT, GATE = "report", "gate"
# Each choice a policy makes besides the logit tier: its values, the default first.
CHOICES = {"cache_bytes": (BIT_EXACT, REPORT), "hygiene": (REPORT, GATE), "unexpected_passes": (REPORT, GATE)}

FIELDS = {"backend", "description", "logits", "cache_bytes", "hygiene", "unexpected_passes", "calibration"}
LOGIT_FIELDS = {"gate", "max_ulp", "tau"}


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Policy:
    backend: str
    gate: str = BIT_EXACT  # the logit tier that gates: bit-exact, ulp or kl
    max_ulp: int = 0  # N of the ulp tier
    tau: float = 0.0  # KL bound (nats) of the kl tier
    cache_bytes: str = BIT_EXACT  # L2 model-written cache bytes: bit-exact or report
    hygiene: str = REPORT  # report or gate
    unexpected_passes: str = REPORT  # a declared divergence that no longer happens: report or gate
    description: str = ""
    path: str = ""

    @property
    def name(self) -> str:
        return Path(self.path).stem if self.path else self.backend

    def required(self) -> str:
        return {BIT_EXACT: BIT_EXACT, "ulp": self.ulp_tier, "kl": self.kl_tier}[self.gate]

    @property
    def ulp_tier(self) -> str:
        return f"ulp<={self.max_ulp}"

    @property
    def kl_tier(self) -> str:
        return f"kl<={self.tau:g} and top-1 agree"

    def logit_tier(self, metrics: Mapping) -> Optional[str]:
        """The strongest tier a row's logits reached; None with no positions."""
        positions = metrics.get("positions", 0)
        if not positions:
            return None
        if not metrics.get("comparable", True):
            return DIVERGED
        if metrics["bit_exact"] == positions:
            return BIT_EXACT
        if metrics["max_ulp"] is not None and metrics["max_ulp"] <= self.max_ulp:
            return self.ulp_tier
        if metrics["top1_agree"] == positions and math.isfinite(metrics["kl_max"]) and metrics["kl_max"] <= self.tau:
            return self.kl_tier
        return DIVERGED

    def accepts(self, tier: Optional[str]) -> bool:
        """Whether a logit tier is at least as strong as the gate."""
        if tier is None:
            return True  # nothing to judge here; evidence is counted elsewhere
        return TIER_FAMILIES.index(tier_family(tier)) <= TIER_FAMILIES.index(self.gate)

    def gates(self, divergence, level: str) -> bool:
        """Whether a divergence (other than logits, judged by tier) fails its
        row, by how its check gates (``suites/format/checks.py``). A backend that is
        not batch-invariant may differ without a bug in the logits and in the
        cache bytes the model writes from them (L2, with a layer)."""
        check = CHECKS[divergence.check]
        if check.gates == BY_HYGIENE_POLICY:
            return self.hygiene == GATE
        if check.gates == BY_TIER:
            return False  # the logit tier decides
        if level != L1 and check.gates == MODEL_WRITTEN and divergence.layer is not None:
            return self.cache_bytes == "bit-exact"
        return True  # layout, mask, left_padding, raised, ...: never a matter of numerics


def tier_family(tier: Optional[str]) -> Optional[str]:
    """``ulp<=3`` -> ``ulp``: tiers grouped for counting."""
    if tier is None:
        return None
    return next(f for f in TIER_FAMILIES if tier.startswith(f))


def load_policy(spec: Optional[str] = None) -> Policy:
    """A policy by name ("cpu", "gpu", "strict") or file path; default: the
    backend MLX runs on. Unknown fields are refused."""
    if spec is None:
        import mlx.core as mx

        spec = mx.default_device().type.name
    path = Path(spec) if spec.endswith(".json") else POLICIES / f"{spec}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in POLICIES.glob("*.json")))
        raise PolicyError(f"no policy {spec!r} (shipped: {shipped}; or a path to a .json file)")
    doc = read_json(path, PolicyError)
    if not isinstance(doc, dict):
        raise PolicyError(f"{path}: expected an object")
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise PolicyError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    if not isinstance(doc.get("backend"), str):
        raise PolicyError(f"{path}: missing field 'backend' (the backend this policy is for)")
    logits = doc.get("logits", {})
    if not isinstance(logits, dict):
        raise PolicyError(f"{path}: logits: expected an object")
    unknown = sorted(set(logits) - LOGIT_FIELDS)
    if unknown:
        raise PolicyError(f"{path}: logits: unknown field {unknown[0]!r} (known: {', '.join(sorted(LOGIT_FIELDS))})")
    gate = logits.get("gate", BIT_EXACT)
    if gate not in GATES:
        raise PolicyError(f"{path}: logits.gate {gate!r} is not one of {', '.join(GATES)}")
    max_ulp, tau = logits.get("max_ulp", 0), logits.get("tau", 0.0)
    if isinstance(max_ulp, bool) or not isinstance(max_ulp, int) or max_ulp < 0:
        raise PolicyError(f"{path}: logits.max_ulp must be an integer >= 0, got {max_ulp!r}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0:
        raise PolicyError(f"{path}: logits.tau must be a number >= 0, got {tau!r}")
    for key, allowed in CHOICES.items():
        if doc.get(key, allowed[0]) not in allowed:
            raise PolicyError(f"{path}: {key} must be one of {', '.join(allowed)}, got {doc[key]!r}")
    return Policy(
        backend=doc["backend"], gate=gate, max_ulp=max_ulp, tau=float(tau),
        **{key: doc.get(key, allowed[0]) for key, allowed in CHOICES.items()},
        description=str(doc.get("description", "")), path=str(path),
    )


def round_up(x: float, digits: int = 3) -> str:
    """``x`` in ``digits`` significant digits, rounded up so a printed bound
    is still a bound."""
    if x <= 0 or not math.isfinite(x):
        return f"{x:g}"
    text = f"{x:.{digits}g}"
    if float(text) >= x:
        return text
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return f"{float(text) + scale:.{digits}g}"
