"""What runs here at all: the quantized attention kernels mlx-lm calls
(``kernel_survey``), the oracle and the batched path at every random model
and kv setting (``survey``), and the L2 catalog on its own models
(``catalog``)."""

import time
from typing import List

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from kvparity.oracle.mlx_lm_versions import defect_for_model
from kvparity.oracle.models import RANDOM_MODELS, load_model
from kvparity.oracle.quantization import BITS, GROUP_SIZES
from kvparity.suites.calibration.backend import (
    READS, backend_warnings, captured_stderr, error_text, reads, schedule_doc, fresh_solo_traces,
)
from kvparity.suites.calibration.drift import batched_positions, batched_rows, summarize
from kvparity.suites.core.evidence import MLX_LM_DEFECT, OracleNondeterministic
from kvparity.suites.l2.run import fit_to_model, model_for, run_l2
from kvparity.suites.format.levels import L2
from kvparity.suites.format.schedule import catalog_paths
from kvparity.suites.core.loading import load, parse


def kernel_survey() -> List[dict]:
    """mlx-lm's quantized SDPA called directly: which shapes have a kernel?
    Keys as mlx-lm's cache holds them (a slice of a step-256 buffer) or
    contiguous, MHA or GQA, decode (1 query) or a window (4), 9-256 keys,
    at the random models' head dims."""
    out = []
    rng = np.random.default_rng(0)
    for head_dim in sorted({m.head_dim for m in RANDOM_MODELS.values()}):
        for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
            for L in (1, 4):
                for n in (9, 64, 256):
                    for layout in ("slice of buffer", "contiguous"):
                        entry = {"head_dim": head_dim, "heads": heads, "kv_heads": kv_heads, "queries": L,
                                 "keys": n, "layout": layout}
                        entry["result"] = _attend(rng, head_dim, heads, kv_heads, L, n, layout)
                        out.append(entry)
    return out


def _attend(rng, head_dim, heads, kv_heads, L, n, layout) -> str:
    cap = n if layout == "contiguous" else 256 * (n // 256 + 1)
    q = mx.array(rng.standard_normal((1, heads, L, head_dim)).astype(np.float32)).astype(mx.bfloat16)
    kv = [mx.quantize(mx.array(rng.standard_normal((1, kv_heads, cap, head_dim)).astype(np.float32))
                      .astype(mx.bfloat16), group_size=64, bits=4) for _ in range(2)]
    if layout != "contiguous":
        kv = [tuple(x[..., :n, :] for x in t) for t in kv]
    try:
        o = quantized_scaled_dot_product_attention(q, kv[0], kv[1], scale=head_dim ** -0.5,
                                                   mask=None if L == 1 else "causal", group_size=64, bits=4)
        mx.eval(o)
        return "ok"
    except Exception as error:
        return error_text(error)


def settings_for(model) -> List[tuple]:
    return [(b, g) for g in GROUP_SIZES if model.head_dim % g == 0 for b in BITS]


def _probe_doc(model, bits, group_size):
    requests = {"a": {"prompt_len": 9, "seed": 1}}
    events = [{"join": ["a"]}, {"step": 3}, {"spec_round": {"k": 3, "accepted": {"a": 1}}}, {"step": 1}]
    return schedule_doc(model, bits, group_size, requests, events, "survey-solo")


def _small_batch_doc(model, bits, group_size):
    requests = {"a": {"prompt_len": 9, "seed": 1}, "b": {"prompt_len": 3, "seed": 2}, "c": {"prompt_len": 21, "seed": 3}}
    events = [{"join": ["a", "b", "c"]}, {"step": 2}, {"spec_round": {"k": 3, "accepted": {"a": 1, "b": 3, "c": 0}}},
              {"step": 1}]
    return schedule_doc(model, bits, group_size, requests, events, "survey-batch")


def survey(models, implementation, deadline, out=None, saved=lambda: None) -> List[dict]:
    """Per model and kv setting: does the oracle run, is it deterministic,
    does the batched path run. Entries go to ``out`` as they come
    (``saved`` is called after each), so a crash keeps what was measured."""
    out = [] if out is None else out
    # Settings-major, 4 bits first, so a survey cut short still covers every model.
    order = {b: i for i, b in enumerate((4, 8, 2, 3, 6, 5))}
    grid = sorted(((name, b, g) for name in models for b, g in settings_for(load_model(name))),
                  key=lambda t: (order[t[1]], t[2], models.index(t[0])))
    for name, bits, group_size in grid:
        model = load_model(name)
        if time.monotonic() > deadline:
            return out
        for mode in READS:
            entry = {"model": name, "bits": bits, "group_size": group_size, "reads": mode}
            start = time.perf_counter()
            with captured_stderr() as err, reads(mode, implementation):
                _survey_setting(model, implementation, bits, group_size, entry)
            entry["stderr"] = backend_warnings(err[0])[:5]
            entry["stderr_lines"] = len(backend_warnings(err[0]))
            entry["seconds"] = round(time.perf_counter() - start, 3)
            out.append(entry)
            saved()
            if entry["oracle"] == "ok" and entry.get("batched") == "ok":
                break  # the contiguous mode only where mlx-lm's own path cannot run
    return out


def _oracle_twice(model, schedule, entry) -> bool:
    """mlx-lm's solo path twice on ``schedule``: ``entry["oracle"]`` says how
    it went (``ok``, ``nondeterministic`` or ``raised``, with the detail)."""
    try:
        fresh_solo_traces(model, schedule, twice=True)
        entry["oracle"] = "ok"
    except OracleNondeterministic as error:
        entry["oracle"], entry["detail"] = "nondeterministic", str(error)
    except Exception as error:
        entry["oracle"], entry["detail"] = "raised", error_text(error)
    return entry["oracle"] == "ok"


def _survey_setting(model, implementation, bits, group_size, entry):
    """One request alone twice, then a small batch: into ``entry``."""
    if not _oracle_twice(model, parse(_probe_doc(model, bits, group_size)), entry):
        return
    schedule = parse(_small_batch_doc(model, bits, group_size))
    try:
        traces = fresh_solo_traces(model, schedule)
    except Exception as error:
        entry["oracle"], entry["detail"] = "raised (batch-survey prompts)", error_text(error)
        return
    defect = defect_for_model(model)
    if defect is not None:  # distances through mlx-lm's own wrong attention calibrate nothing
        entry["batched"], entry["detail"] = MLX_LM_DEFECT, defect.attribution()
        return
    try:
        rows = batched_rows(model, implementation, schedule, traces)
        entry["batched"] = "ok"
        entry["metrics"] = summarize([p for r in rows.values() for p in batched_positions(r)])
    except Exception as error:
        entry["batched"], entry["detail"] = "raised", error_text(error)


def catalog(implementation, deadline, out=None, saved=lambda: None) -> List[dict]:
    """The L2 catalog on each schedule's own model: the oracle twice, then
    ``run_l2``'s evidence per row (logit statistics and which checks
    diverged). No verdict: the tiers are what is being calibrated."""
    out = [] if out is None else out
    for path in catalog_paths(L2):
        if time.monotonic() > deadline:
            break
        schedule = load(path)
        if L2 not in schedule.levels:
            continue
        model = load_model(model_for(schedule))
        schedule, unfit = fit_to_model(schedule, model)
        entry = {"schedule": schedule.name, "model": model.name, "bits": schedule.bits,
                 "group_size": schedule.group_size}
        start = time.perf_counter()
        with captured_stderr() as err:
            _catalog_schedule(model, implementation, schedule, unfit, entry)
        entry["stderr"] = backend_warnings(err[0])[:5]
        entry["stderr_lines"] = len(backend_warnings(err[0]))
        entry["seconds"] = round(time.perf_counter() - start, 3)
        out.append(entry)
        saved()
    return out


def _catalog_schedule(model, implementation, schedule, unfit, entry):
    if unfit:
        entry["oracle"] = "skipped: " + unfit
    elif implementation.missing(schedule.needs):
        entry["oracle"] = "skipped: needs " + ", ".join(implementation.missing(schedule.needs))
    else:
        _oracle_twice(model, schedule, entry)
    if entry["oracle"] != "ok":
        return
    try:
        result = run_l2(schedule, implementation, model.name, use_cache=False, repeat_oracle=False)
        entry["stopped"] = result.stopped
        entry["reason"] = result.reason
        entry["rows"] = {r.request: {"diverged": sorted({d.check for d in r.divergences}),
                                     **{k: r.metrics.get(k) for k in
                                        ("positions", "bit_exact", "top1_agree", "max_ulp", "kl_max")}}
                         for r in result.rows}
    except Exception as error:
        entry["stopped"], entry["detail"] = "harness raised", error_text(error)

