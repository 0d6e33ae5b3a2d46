"""The proposal: a ``kl`` tier with ``tau`` = the largest KL observed times a
margin, rounded up to one significant digit, taken only from settings where
mlx-lm's own path ran and the reference drifted numerically; and how many
control rows and batches each candidate tau would let pass."""

import math
from typing import Dict, List, Optional


def round_up_1sig(x: float) -> float:
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x))
    m = math.ceil(x / 10 ** e - 1e-9)
    return float(f"{m}e{e}") if m < 10 else float(f"1e{e + 1}")


# A reference (correct cache) whose greedy tokens flip on more than this share
# of positions is not drifting numerically: the backend computes something
# else, and no tolerance may be taken from it.
MAX_FLIP_RATE = 0.01
CANDIDATE_TAUS = (1e-4, 1e-3, 1e-2, 1e-1)


def eligible(entry) -> Optional[str]:
    """Why a sweep or composition set cannot calibrate a tolerance, or None."""
    if entry.get("reads", "as-is") != "as-is":
        return "mlx-lm's own read path has no kernel here (contiguous-read mode)"
    positions = entry.get("positions", 0)
    if positions and (positions - entry["top1_agree"]) / positions > MAX_FLIP_RATE:
        return f"top-1 flips on {positions - entry['top1_agree']}/{positions} positions: a backend defect, not drift"
    return None


def control_escapes(data: dict, taus=CANDIDATE_TAUS) -> dict:
    """Per candidate tau: padded rows of the controls that a ``kl`` tier would
    pass (KL max <= tau and every greedy token agreeing), and batches in
    which no padded row fails (the schedule itself would pass)."""
    out = {}
    for tau in taus:
        rows = batches = escaped_rows = escaped_batches = 0
        for group in data.get("controls", []):
            for c in group.values():
                by_batch: Dict[int, List[bool]] = {}
                for r in c["rows"]:
                    if r["padded"]:
                        passes = r["kl_max"] <= tau and r["top1_agree"] == r["positions"]
                        by_batch.setdefault(r["B"], []).append(passes)
                        rows += 1
                        escaped_rows += passes
                batches += len(by_batch)
                escaped_batches += sum(all(v) for v in by_batch.values())
        out[f"{tau:g}"] = {"padded_rows": rows, "rows_passing": escaped_rows,
                           "batches": batches, "batches_passing": escaped_batches}
    return out


def propose(data: dict, margin: float = 10.0) -> dict:
    """A ``kl`` tier from the reference's sweeps and compositions where they
    can calibrate one (mlx-lm's own path, no backend defect), and how the
    controls fare under it and under the candidate taus."""
    used, excluded, kl_max = [], [], []
    for kind in ("sweep", "compositions"):
        for entry in data.get(kind, []):
            stats = entry["pooled"] if kind == "sweep" else {
                "positions": sum(t["positions"] for t in entry["trials"]),
                "top1_agree": sum(t["top1_agree"] for t in entry["trials"]),
                "kl_max": entry.get("kl_max") or 0.0}
            label = f"{kind} {entry['model']} bits={entry['bits']} group={entry['group_size']}"
            why = eligible({**stats, "reads": entry.get("reads", "as-is")})
            if not stats.get("positions"):
                continue
            if why:
                excluded.append({"what": label, "why": why, "kl_max": stats["kl_max"],
                                 "top1_agree": f"{stats['top1_agree']}/{stats['positions']}"})
            else:
                used.append(label)
                kl_max.append(stats["kl_max"])
    proposal = {"margin": margin, "calibrated_from": used, "excluded": excluded,
                "control_escapes": control_escapes(data)}
    if not kl_max:
        proposal.update(tier=None, tau=None,
                        reason="no setting where mlx-lm's own solo path and the batched path both ran "
                               "without a backend defect: no tolerance can be calibrated here")
        return proposal
    observed = max(kl_max)
    tau = round_up_1sig(max(observed, 1e-12) * margin)
    proposal.update(tier="kl", tau=tau, observed_kl_max=observed,
                    control_escapes=control_escapes(data, CANDIDATE_TAUS + (tau,)))
    return proposal
