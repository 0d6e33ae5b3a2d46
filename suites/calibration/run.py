"""Calibration of a backend policy: how far batched logits move from solo ones.

On a backend whose kernels change with the batch size (MLX's CUDA backend,
Metal), a correct batched cache is not bit-exact against mlx-lm's solo run,
so the policy's tolerance tiers need thresholds taken from measurement. This
module measures, on the device MLX runs on, what a threshold must tolerate and
what it must still catch, and writes it all to one JSON file:

``survey``
    Can mlx-lm's solo path (the oracle) run here at all, and is it
    deterministic? For every random model and every kv setting (bits 2-8,
    group sizes 32-128), one request is replayed alone twice and compared byte
    for byte; then a small batch (three rows, uneven padding) runs through the
    reference cache. Each setting is ``ok``, ``oracle raised`` (the error),
    ``oracle nondeterministic`` (the first tensor that differs) or
    ``batched raised``. Whatever the backend writes to stderr meanwhile
    (CUDA's "Failed to initialize the TMA descriptor") is counted.
``catalog``
    The same for the L2 catalog schedules on their own models, with the
    verdict and tiers ``run_l2`` gives under the policy.
``sweep``
    For the settings where both paths run: B requests (B over the batch
    sizes) with uneven prompts join one batch, decode, verify a window with
    uneven per-row acceptance and decode again. Per batched position: bit
    equality, ULP distance, KL(solo || batched) and top-1 agreement, summed
    up per batch size and pooled.
``compositions``
    One target request in N batch compositions (vLLM/SGLang-style): alone,
    with 1-15 co-runners, at different row positions, joining first, last or
    in between, with co-runners leaving. Counted: unique greedy token
    sequences and unique logits hashes across compositions, and how many
    equal the solo run bit for bit.
``controls``
    The RoPE and mask negative controls through the sweep's schedules: the KL
    and top-1 agreement of their padded rows, which a threshold must not
    tolerate.

``propose`` turns the result into a policy (``kl`` tier, ``tau`` = the largest
KL observed times a margin, rounded up to one significant digit), using only
settings where mlx-lm's own path ran and the reference drifted numerically
(top-1 flips on at most 1% of positions; more is a backend defect, and a
tolerance taken from it would hide real bugs), and counts the control rows
and batches that each candidate tau would let pass.

Run it on the device whose policy is being set (Metal on Apple silicon for
the ``gpu`` policy), with ``kvparity calibrate`` or ``calibrate()``::

    kvparity calibrate --out calibration.json [--device gpu] [--deadline 600]
        [--phases kernels,survey,catalog,sweep,compositions,controls] [--models ...]

Each phase writes the JSON file again when it finishes, so a run that is
stopped keeps what it measured. Inputs are teacher-forced from the solo run,
as at L2, so one flipped argmax does not derail the rest.

Honesty rules: a tolerance is taken only from mlx-lm's own solo path (never
from the contiguous-read mode, which exists to look past a missing kernel),
only from settings where the reference drifts numerically rather than
computing something else, and when nothing qualifies no tau is proposed. The
proposal is data for a person writing a policy file, never applied by itself.
"""

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from typing import List, Optional

import mlx.core as mx

from kvparity.oracle.machine import machine
from kvparity.oracle.models import RANDOM_MODELS, axis_variants
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.calibration import survey as surveys
from kvparity.suites.calibration import sweep as sweeps
from kvparity.suites.calibration.proposal import propose

FORMAT = "kvparity.calibration/1"
PHASES = ("kernels", "survey", "catalog", "sweep", "compositions", "controls")
BATCH_SIZES = tuple(range(1, 17))
# Every random model, then no-GQA variants (for backends whose quantized
# matmul has no kernel for GQA's broadcast keys) of the default model, each
# axis changed alone and all changed.
MODELS = tuple(RANDOM_MODELS) + tuple(replace(m, mha=True).name for m in axis_variants(opposite=True))


def runnable(survey_entries) -> List[tuple]:
    """(model, bits, group_size, reads) where oracle and batched path both ran."""
    return [(e["model"], e["bits"], e["group_size"], e.get("reads", "as-is")) for e in survey_entries
            if e.get("oracle") == "ok" and e.get("batched") == "ok"]


def pick(runnable, limit):
    """mlx-lm's own read path first; one setting per model (4 bits
    preferred), then the rest."""
    first, rest, seen = [], [], set()
    for m, b, g, r in sorted(runnable, key=lambda t: (t[3] != "as-is", t[1] != 4, t[2] != 64, t)):
        (rest if m in seen else first).append((m, b, g, r))
        seen.add(m)
    return (first + rest)[:limit]


class Calibration:
    """One run's data, written to ``out`` again after every phase, and the
    share of the deadline each phase gets."""

    def __init__(self, out, phases, deadline, sizes, resume=None):
        self.out, self.phases, self.deadline = out, phases, deadline
        self.start = time.monotonic()
        self.end = self.start + deadline
        self.data = json.load(open(resume)) if resume else {}
        self.data.update({"format": FORMAT, "machine": machine(), "batch_sizes": sizes,
                          "timing": self.data.get("timing", {})})
        try:
            info = mx.device_info() if hasattr(mx, "device_info") else {}
        except Exception:  # some backends cannot describe themselves
            info = {}
        self.data["device_info"] = {k: str(v) for k, v in info.items()}

    def save(self):
        tmp = str(self.out) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.out)

    def phase(self, name, fn):
        """Run one phase if asked for; what it raises is recorded, not raised."""
        if name not in self.phases:
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            self.data.setdefault("phase_errors", {})[name] = traceback.format_exc()[-2000:]
        self.data["timing"][name] = round(time.perf_counter() - t, 2)
        self.save()
        print(f"calibration: {name} done in {self.data['timing'][name]} s", file=sys.stderr, flush=True)

    def until(self, fraction):
        """A deadline ``fraction`` of the whole run from now."""
        return min(self.end, time.monotonic() + fraction * self.deadline)

    def share(self, k):
        """A deadline ``1/k`` of the time left from now."""
        return min(self.end, time.monotonic() + (self.end - time.monotonic()) / k)

    def each(self, kind, chosen, measure, parts):
        """``measure(setting, deadline)`` for each chosen setting into
        ``data[kind]``, setting ``i`` given ``1/parts(i)`` of the time left."""
        self.data[kind] = []
        for i, setting in enumerate(chosen):
            self.data[kind].append(measure(setting, self.share(parts(i))))
            self.save()


def calibrate(out: str, device: Optional[str] = None, deadline: float = 600, phases=PHASES,
              models: Optional[List[str]] = None, batch_sizes=BATCH_SIZES, settings: int = 6,
              compositions: int = 24, margin: float = 10.0, resume: Optional[str] = None) -> dict:
    """Measure this device and write the data and a proposal to ``out``.

    Returns the data; ``data["proposal"]`` is ``propose``'s answer: a ``kl``
    tier with ``tau`` and the margin, or ``tau`` None with the reason when no
    setting qualifies; either way which settings calibrated it, which were
    excluded and why, and how many negative-control rows each candidate tau
    would let pass. Nothing here writes or changes a policy file. A
    ValueError for options that cannot be used, before anything runs."""
    if device:
        mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    phases = list(phases)
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phases {', '.join(unknown)}; known: {', '.join(PHASES)}")
    models = list(models) if models else list(MODELS)
    sizes = [int(b) for b in batch_sizes]
    run = Calibration(out, phases, deadline, sizes, resume)
    reference = load_implementation(None)
    data = run.data
    run.phase("kernels", lambda: data.__setitem__("kernels", surveys.kernel_survey()))
    run.phase("survey", lambda: surveys.survey(models, reference, run.until(0.25), data.setdefault("survey", []),
                                               run.save))
    run.phase("catalog", lambda: surveys.catalog(reference, run.until(0.2), data.setdefault("catalog", []), run.save))
    chosen = pick(runnable(data.get("survey", [])), settings)
    data["chosen_settings"] = chosen
    few = [b for b in (2, 4, 8, 16) if b in sizes] or sizes[:1]  # the controls' batch sizes
    run.phase("sweep", lambda: run.each(
        "sweep", chosen, lambda s, until: sweeps.sweep(*s[:3], reference, sizes, until, mode=s[3]),
        lambda i: 2 * (len(chosen) - i)))
    run.phase("compositions", lambda: run.each(
        "compositions", chosen[:3],
        lambda s, until: sweeps.compositions(*s[:3], reference, compositions, until, mode=s[3]),
        lambda i: 2 * (min(3, len(chosen)) - i)))
    run.phase("controls", lambda: run.each(
        "controls", chosen[:2], lambda s, until: sweeps.controls(*s[:3], few, until, mode=s[3]),
        lambda i: min(2, len(chosen)) - i))
    data["proposal"] = propose(data, margin)
    data["timing"]["total"] = round(time.monotonic() - run.start, 2)
    run.save()
    return data
