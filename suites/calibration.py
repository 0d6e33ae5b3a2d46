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

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from typing import Dict, List, Optional

from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle import models as _models
from kvparity.oracle.arrays import digest, raw
from kvparity.oracle.machine import machine
from kvparity.oracle.models import SMOLLM2, available_models
from kvparity.oracle.solo import greedy, log_probs, run_solo
from kvparity.suites.adapter import load_implementation, patched
from kvparity.suites.evidence import OracleNondeterministic
from kvparity.suites.l2 import ModelBackend, trace_difference
from kvparity.suites.metrics import kl_divergence
from kvparity.suites.replay import Replay
from kvparity.suites.schedule import parse

FORMAT = "kvparity.calibration/1"
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
BATCH_SIZES = tuple(range(1, 17))
# No-GQA variants of the random models (see load_model).
MHA_MODELS = ("llama-h64-bf16-mha", "llama-h128-bf16-mha", "qwen3-h64-bf16-mha", "llama-h64-f32-mha",
              "qwen3-h128-f32-mha")
CONTROLS = (
    "kvparity.impl.negative_controls:RopeOffsetIgnoresLeftPadding",
    "kvparity.impl.negative_controls:MaskIgnoresLeftPadding",
)
# What the backend may print instead of raising.
BACKEND_WARNINGS = ("TMA", "No implementation", "error", "Error")


# -- models and read modes --------------------------------------------------------


@lru_cache(maxsize=None)
def load_model(name: str):
    """A harness model, or ``<random model>-mha``: the same config with as
    many kv heads as query heads (no GQA), for backends whose quantized
    matmul has no kernel for GQA's broadcast keys."""
    if not name.endswith("-mha"):
        return _models.load_model(name)
    base, _, dt = name[: -len("-mha")].rpartition("-")
    config = dict(_models.RANDOM_CONFIGS[base])
    config["num_key_value_heads"] = config["num_attention_heads"]
    args = {**config, "seed": _models.SEED, "dtype": dt}
    dtype = {"bf16": mx.bfloat16, "f32": mx.float32}[dt]
    model = _models.build_random_model(args, dtype, _models.SEED)
    return _models._loaded(name, model, args, dtype, None)


# How the quantized caches hand their triples to attention. "as-is" is
# mlx-lm's own path (slices of the step-256 buffers). "contiguous" copies the
# slices first: the same values, so the same mathematics, but not mlx-lm's
# code path; it is used only where the backend has no kernel for the slices,
# and every result says which mode produced it.
READS = ("as-is", "contiguous")


@contextmanager
def reads(mode: str, *implementations):
    """``contiguous``: mlx-lm's ``QuantizedKVCache`` and each implementation's
    batch class hand attention contiguous copies of their triples (each class
    patched in its own namespace while the block runs, its bases untouched)."""
    if mode == "as-is":
        yield
        return
    classes = list(dict.fromkeys([QuantizedKVCache] + [i.batch_class for i in implementations]))
    originals = [c.update_and_fetch for c in classes]  # each as it is before any is patched

    def wrap(original):
        def update_and_fetch(self, keys, values):
            return tree_map(mx.contiguous, original(self, keys, values))
        return update_and_fetch

    with ExitStack() as stack:
        for c, original in zip(classes, originals):
            stack.enter_context(patched(c, {"update_and_fetch": wrap(original)}))
        yield


def kernel_survey() -> List[dict]:
    """mlx-lm's quantized SDPA called directly: which shapes have a kernel?
    Keys as mlx-lm's cache holds them (a slice of a step-256 buffer) or
    contiguous, MHA or GQA, decode (1 query) or a window (4), 9-256 keys."""
    out = []
    rng = np.random.default_rng(0)
    for head_dim in (64, 128):
        for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
            for L in (1, 4):
                for n in (9, 64, 256):
                    for layout in ("slice of buffer", "contiguous"):
                        cap = n if layout == "contiguous" else 256 * (n // 256 + 1)
                        q = mx.array(rng.standard_normal((1, heads, L, head_dim)).astype(np.float32)).astype(mx.bfloat16)
                        kv = [mx.quantize(mx.array(rng.standard_normal((1, kv_heads, cap, head_dim)).astype(np.float32))
                                          .astype(mx.bfloat16), group_size=64, bits=4) for _ in range(2)]
                        if layout != "contiguous":
                            kv = [tuple(x[..., :n, :] for x in t) for t in kv]
                        entry = {"head_dim": head_dim, "heads": heads, "kv_heads": kv_heads, "queries": L,
                                 "keys": n, "layout": layout}
                        try:
                            o = quantized_scaled_dot_product_attention(q, kv[0], kv[1], scale=head_dim ** -0.5,
                                                                       mask=None if L == 1 else "causal",
                                                                       group_size=64, bits=4)
                            mx.eval(o)
                            entry["result"] = "ok"
                        except Exception as error:
                            entry["result"] = _error(error)
                        out.append(entry)
    return out


# -- running things --------------------------------------------------------------


@contextmanager
def captured_stderr():
    """Collect what native code writes to file descriptor 2 (MLX's CUDA
    backend prints some kernel failures instead of raising)."""
    sys.stderr.flush()
    saved = os.dup(2)
    box: List[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode(errors="replace"))


def _warnings(text: str) -> List[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [line for line in lines if any(w in line for w in BACKEND_WARNINGS)]


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def schedule_doc(model, bits, group_size, requests, events, name="calibration") -> dict:
    return {
        "name": name,
        "levels": ["L2"],
        "kv": {"bits": bits, "group_size": group_size},
        "synthetic": {
            "kv_heads": model.n_kv_heads,
            "head_dim": model.head_dim,
            "dtype": "float32" if model.dtype == mx.float32 else "bfloat16",
        },
        "requests": requests,
        "events": events,
    }


def solo_traces(model, schedule, twice=False) -> Dict[str, object]:
    """Each request alone through mlx-lm; with ``twice``, a second run that
    must equal the first byte for byte (else ``OracleNondeterministic``,
    naming the request, call, tensor, flat index and both values)."""
    traces = {}
    for rid in schedule.requests:
        trace = run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
        if twice:
            again = run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
            differs = trace_difference(rid, trace, again)
            if differs is not None:
                raise differs
        traces[rid] = trace
    return traces


def _ordered(x: mx.array) -> Optional[np.ndarray]:
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
    os_, ob = _ordered(solo), _ordered(batched)
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


def replay(model, implementation, schedule, traces):
    """L2's batched run (the one replay core), teacher-forced from
    ``traces``: per request, a list of (event kind, call index, position
    records, logits); the event kind is "alone" for logits that did not come
    out of the implementation (a joiner's solo prefill, a row waiting for
    mlx-lm's conversion)."""
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


# -- summaries -------------------------------------------------------------------


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
        "kl_log10_histogram": _histogram(kl),
    }


def _histogram(values: np.ndarray) -> Dict[str, int]:
    positive = values[values > 0]
    if not positive.size:
        return {}
    bins = np.floor(np.log10(positive)).astype(int)
    return {f"1e{b}": int((bins == b).sum()) for b in sorted(set(bins.tolist()))}


# -- phases ----------------------------------------------------------------------


def random_models() -> List[str]:
    return [m for m in available_models() if m != SMOLLM2]


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
                try:
                    solo_traces(model, parse(_probe_doc(model, bits, group_size)), twice=True)
                    entry["oracle"] = "ok"
                except OracleNondeterministic as error:
                    entry["oracle"], entry["detail"] = "nondeterministic", str(error)
                except Exception as error:
                    entry["oracle"], entry["detail"] = "raised", _error(error)
                if entry["oracle"] == "ok":
                    schedule = parse(_small_batch_doc(model, bits, group_size))
                    try:
                        traces = solo_traces(model, schedule)
                    except Exception as error:
                        entry["oracle"], entry["detail"] = "raised (batch-survey prompts)", _error(error)
                    else:
                        try:
                            rows = replay(model, implementation, schedule, traces)
                            entry["batched"] = "ok"
                            entry["metrics"] = summarize([p for r in rows.values() for p in batched_positions(r)])
                        except Exception as error:
                            entry["batched"], entry["detail"] = "raised", _error(error)
            entry["stderr"] = _warnings(err[0])[:5]
            entry["stderr_lines"] = len(_warnings(err[0]))
            entry["seconds"] = round(time.perf_counter() - start, 3)
            out.append(entry)
            saved()
            if entry["oracle"] == "ok" and entry.get("batched") == "ok":
                break  # the contiguous mode only where mlx-lm's own path cannot run
    return out


def catalog(implementation, deadline, out=None, saved=lambda: None) -> List[dict]:
    """The L2 catalog on each schedule's own model: the oracle twice, then
    ``run_l2``'s evidence per row (logit statistics and which checks
    diverged). No verdict: the tiers are what is being calibrated."""
    from kvparity.suites.l2 import fit_to_model, model_for, run_l2
    from kvparity.suites.schedule import catalog_paths, load

    out = [] if out is None else out
    for path in catalog_paths("L2"):
        if time.monotonic() > deadline:
            break
        schedule = load(path)
        if "L2" not in schedule.levels:
            continue
        model = load_model(model_for(schedule))
        schedule, unfit = fit_to_model(schedule, model)
        entry = {"schedule": schedule.name, "model": model.name, "bits": schedule.bits,
                 "group_size": schedule.group_size}
        start = time.perf_counter()
        with captured_stderr() as err:
            if unfit:
                entry["oracle"] = "skipped: " + unfit
            elif implementation.missing(schedule.needs):
                entry["oracle"] = "skipped: needs " + ", ".join(implementation.missing(schedule.needs))
            else:
                try:
                    solo_traces(model, schedule, twice=True)
                    entry["oracle"] = "ok"
                except OracleNondeterministic as error:
                    entry["oracle"], entry["detail"] = "nondeterministic", str(error)
                except Exception as error:
                    entry["oracle"], entry["detail"] = "raised", _error(error)
            if entry["oracle"] == "ok":
                try:
                    result = run_l2(schedule, implementation, model.name, use_cache=False, repeat_oracle=False)
                    entry["stopped"] = result.stopped
                    entry["reason"] = result.reason
                    entry["rows"] = {r.request: {"diverged": sorted({d.check for d in r.divergences}),
                                                 **{k: r.metrics.get(k) for k in
                                                    ("positions", "bit_exact", "top1_agree", "max_ulp", "kl_max")}}
                                     for r in result.rows}
                except Exception as error:
                    entry["stopped"], entry["detail"] = "harness raised", _error(error)
        entry["stderr"] = _warnings(err[0])[:5]
        entry["stderr_lines"] = len(_warnings(err[0]))
        entry["seconds"] = round(time.perf_counter() - start, 3)
        out.append(entry)
        saved()
    return out


def sweep_doc(model, bits, group_size, B, seed=0):
    rng = np.random.default_rng([seed, B, bits, group_size])
    lengths = rng.integers(2, 48, size=B)
    if B > 1:
        lengths[rng.integers(0, B)] = 48  # at least one row padded when B > 1
    requests = {f"r{i}": {"prompt_len": int(n), "seed": int(seed * 1000 + i)} for i, n in enumerate(lengths)}
    accepted = {rid: int(rng.integers(0, 4)) for rid in requests}
    events = [{"join": list(requests)}, {"step": 4}, {"spec_round": {"k": 3, "accepted": accepted}}, {"step": 2}]
    return schedule_doc(model, bits, group_size, requests, events, f"sweep-B{B}")


def spread(sizes) -> List[int]:
    """Powers of two first, then the rest: a sweep cut short by its deadline
    still spans the range."""
    first = [b for b in sizes if b & (b - 1) == 0]
    return first + [b for b in sizes if b not in first]


def _reading(mode, implementation, run, *args) -> dict:
    """``run(*args)`` with attention reading its keys as ``mode`` says; the
    result records the mode."""
    with reads(mode, implementation):
        result = run(*args)
    return {**result, "reads": mode}


def sweep(model_name, bits, group_size, implementation, batch_sizes, deadline, seed=0, mode="as-is"):
    return _reading(mode, implementation, _sweep, model_name, bits, group_size, implementation, batch_sizes,
                    deadline, seed)


def _sweep(model_name, bits, group_size, implementation, batch_sizes, deadline, seed=0):
    model = load_model(model_name)
    per_b, pooled, errors = {}, [], []
    for B in spread(batch_sizes):
        if time.monotonic() > deadline:
            break
        schedule = parse(sweep_doc(model, bits, group_size, B, seed))
        try:
            with captured_stderr() as err:
                traces = solo_traces(model, schedule)
                rows = replay(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"B": B, "error": _error(error)})
            continue
        positions = [p for r in rows.values() for p in batched_positions(r)]
        pooled += positions
        per_b[str(B)] = summarize(positions)
        per_b[str(B)]["stderr_lines"] = len(_warnings(err[0]))
    return {"model": model_name, "bits": bits, "group_size": group_size, "per_batch_size": per_b,
            "pooled": summarize(pooled), "errors": errors}


def composition_docs(model, bits, group_size, n, seed=0, steps=6):
    """The same target request ``t`` in ``n`` batch compositions; it always
    sees a prefill and ``steps`` decode calls, so its solo run is one."""
    rng = np.random.default_rng([seed, 17])
    target = {"prompt_len": 13, "seed": 4242}
    docs = []
    for c in range(n):
        k = 0 if c == 0 else int(rng.integers(1, 16))
        others = [f"o{i}" for i in range(k)]
        requests = {"t": target, **{o: {"prompt_len": int(rng.integers(1, 60)), "seed": int(rng.integers(0, 1 << 30))}
                                     for o in others}}
        kind = "alone" if k == 0 else ("together", "target-joins-last", "target-joins-first", "co-runners-leave")[c % 4]
        j = int(rng.integers(1, steps))
        if kind in ("alone", "together"):
            order = others[:]
            order.insert(int(rng.integers(0, k + 1)), "t")
            events = [{"join": order}, {"step": steps}]
        elif kind == "target-joins-last":
            events = [{"join": others}, {"step": j}, {"join": ["t"]}, {"step": steps}]
        elif kind == "target-joins-first":
            half = others[: k // 2]
            events = [{"join": ["t"] + half}, {"step": j}]
            if others[k // 2:]:
                events.append({"join": others[k // 2:]})
            events.append({"step": steps - j})
        else:
            order = others[:]
            order.insert(int(rng.integers(0, k + 1)), "t")
            leaving = others[: max(1, k // 2)]
            events = [{"join": order}, {"step": j}, {"leave": leaving}, {"step": steps - j}]
        doc = schedule_doc(model, bits, group_size, requests, events, f"composition-{c}")
        docs.append((kind, len(requests), doc))
    return docs


def compositions(model_name, bits, group_size, implementation, n, deadline, seed=0, mode="as-is"):
    return _reading(mode, implementation, _compositions, model_name, bits, group_size, implementation, n,
                    deadline, seed)


def _compositions(model_name, bits, group_size, implementation, n, deadline, seed=0):
    model = load_model(model_name)
    trials, errors = [], []
    solo_hash = solo_tokens = None
    for kind, size, doc in composition_docs(model, bits, group_size, n, seed):
        if time.monotonic() > deadline:
            break
        schedule = parse(doc)
        try:
            traces = solo_traces(model, schedule)
            rows = replay(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"kind": kind, "error": _error(error)})
            continue
        solo = traces["t"]
        decode = [c.logits for c in solo.calls if c.op == "append"]
        if solo_hash is None:
            solo_hash = digest(decode)
            solo_tokens = [greedy(x[-1]) for x in decode]
        elif digest(decode) != solo_hash:
            errors.append({"kind": kind, "error": "the target's solo run differs between compositions"})
        mine = [logits for kind_, _, _, logits in rows["t"] if kind_ not in ("join", "alone")]
        positions = [p for kind_, _, ps, _ in rows["t"] if kind_ not in ("join", "alone") for p in ps]
        trials.append({
            "kind": kind,
            "batch_size": size,
            "tokens": [p["token"] for p in positions],
            "logits_sha256": digest(mine),
            "kl_max": max((p["kl"] for p in positions), default=0.0),
            "top1_agree": sum(p["top1"] for p in positions),
            "positions": len(positions),
        })
    tokens = {tuple(t["tokens"]) for t in trials}
    hashes = {t["logits_sha256"] for t in trials}
    return {
        "model": model_name, "bits": bits, "group_size": group_size,
        "compositions": len(trials),
        "unique_token_sequences": len(tokens),
        "unique_logits_hashes": len(hashes),
        "equal_to_solo_bits": sum(t["logits_sha256"] == solo_hash for t in trials),
        "equal_to_solo_tokens": sum(t["tokens"] == solo_tokens for t in trials),
        "kl_max": max((t["kl_max"] for t in trials), default=None),
        "by_kind": {k: sum(t["kind"] == k for t in trials) for k in sorted({t["kind"] for t in trials})},
        "trials": trials,
        "errors": errors,
    }


def controls(model_name, bits, group_size, batch_sizes, deadline, seed=0, mode="as-is"):
    """Each control through the sweep's schedules: per padded row, its KL
    max and whether every greedy token agreed."""
    model = load_model(model_name)
    out = {}
    for spec in CONTROLS:
        implementation = load_implementation(spec)
        out[spec.rpartition(":")[2]] = _reading(mode, implementation, _control, model, model_name, bits,
                                                group_size, implementation, batch_sizes, deadline, seed)
    return out


def _control(model, model_name, bits, group_size, implementation, batch_sizes, deadline, seed=0):
    rows_out, errors = [], []
    for B in batch_sizes:
        if time.monotonic() > deadline:
            break
        doc = sweep_doc(model, bits, group_size, B, seed)
        schedule = parse(doc)
        width = max(r["prompt_len"] for r in doc["requests"].values())
        try:
            traces = solo_traces(model, schedule)
            rows = replay(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"B": B, "error": _error(error)})
            continue
        for rid, records in rows.items():
            positions = batched_positions(records)
            if not positions:
                continue
            rows_out.append({
                "B": B, "row": rid, "padded": doc["requests"][rid]["prompt_len"] < width,
                "kl_max": max(p["kl"] for p in positions),
                "kl_mean": float(np.mean([p["kl"] for p in positions])),
                "top1_agree": sum(p["top1"] for p in positions), "positions": len(positions),
            })
    padded = [r for r in rows_out if r["padded"]]
    return {
        "model": model_name, "bits": bits, "group_size": group_size,
        "padded_rows": len(padded),
        "padded_kl_max_min": min((r["kl_max"] for r in padded), default=None),
        "padded_kl_max_median": float(np.median([r["kl_max"] for r in padded])) if padded else None,
        "padded_rows_top1_flip": sum(r["top1_agree"] < r["positions"] for r in padded),
        "rows": rows_out,
        "errors": errors,
    }


# -- the policy ------------------------------------------------------------------


def _round_up_1sig(x: float) -> float:
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


def _eligible(entry) -> Optional[str]:
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
            why = _eligible({**stats, "reads": entry.get("reads", "as-is")})
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
    tau = _round_up_1sig(max(observed, 1e-12) * margin)
    proposal.update(tier="kl", tau=tau, observed_kl_max=observed,
                    control_escapes=control_escapes(data, CANDIDATE_TAUS + (tau,)))
    return proposal


# -- entry point -----------------------------------------------------------------


def _runnable(survey_entries) -> List[tuple]:
    """(model, bits, group_size, reads) where oracle and batched path both ran."""
    return [(e["model"], e["bits"], e["group_size"], e.get("reads", "as-is")) for e in survey_entries
            if e.get("oracle") == "ok" and e.get("batched") == "ok"]


def _pick(runnable, limit):
    """mlx-lm's own read path first; one setting per model (4 bits
    preferred), then the rest."""
    first, rest, seen = [], [], set()
    for m, b, g, r in sorted(runnable, key=lambda t: (t[3] != "as-is", t[1] != 4, t[2] != 64, t)):
        (rest if m in seen else first).append((m, b, g, r))
        seen.add(m)
    return (first + rest)[:limit]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``kvparity calibrate`` (and of ``main``)."""
    parser.add_argument("--out", required=True, metavar="FILE", help="JSON file to write (rewritten after each phase)")
    parser.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")
    parser.add_argument("--deadline", type=float, default=600, metavar="SECONDS",
                        help="seconds for the whole run (default 600); phases stop at their share of it")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    parser.add_argument("--models", help="comma-separated random models, '-mha' variants allowed (default: all)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                        help="batch sizes of the sweep (default 1-16)")
    parser.add_argument("--settings", type=int, default=6, help="how many runnable settings to sweep (default 6)")
    parser.add_argument("--compositions", type=int, default=24, help="batch compositions per setting (default 24)")
    parser.add_argument("--margin", type=float, default=10.0,
                        help="tau = largest KL observed times this, rounded up (default 10)")
    parser.add_argument("--resume", metavar="FILE", help="a JSON file of an earlier run: keep its phases")
    return parser


PHASES = ("kernels", "survey", "catalog", "sweep", "compositions", "controls")


def calibrate(out: str, device: Optional[str] = None, deadline: float = 600, phases=PHASES,
              models: Optional[List[str]] = None, batch_sizes=BATCH_SIZES, settings: int = 6,
              compositions: int = 24, margin: float = 10.0, resume: Optional[str] = None) -> dict:
    """Measure this device and write the data and a proposal to ``out``.

    Returns the data; ``data["proposal"]`` is ``propose``'s answer: a ``kl``
    tier with ``tau`` and the margin, or ``tau`` None with the reason when no
    setting qualifies; either way which settings calibrated it, which were
    excluded and why, and how many negative-control rows each candidate tau
    would let pass. Nothing here writes or changes a policy file."""
    if device:
        mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    phases = list(phases)
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phases {', '.join(unknown)}; known: {', '.join(PHASES)}")
    models = list(models) if models else random_models() + list(MHA_MODELS)
    sizes = [int(b) for b in batch_sizes]
    start = time.monotonic()
    end = start + deadline
    reference = load_implementation(None)
    data = json.load(open(resume)) if resume else {}
    data.update({"format": FORMAT, "machine": machine(), "batch_sizes": sizes, "timing": data.get("timing", {})})
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:  # some backends cannot describe themselves
        info = {}
    data["device_info"] = {k: str(v) for k, v in info.items()}

    def save():
        tmp = str(out) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, out)

    def phase(name, fn):
        if name not in phases:
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            data.setdefault("phase_errors", {})[name] = traceback.format_exc()[-2000:]
        data["timing"][name] = round(time.perf_counter() - t, 2)
        save()
        print(f"calibration: {name} done in {data['timing'][name]} s", file=sys.stderr, flush=True)

    phase("kernels", lambda: data.__setitem__("kernels", kernel_survey()))
    until = lambda fraction: min(end, time.monotonic() + fraction * deadline)
    phase("survey", lambda: survey(models, reference, until(0.25), data.setdefault("survey", []), save))
    phase("catalog", lambda: catalog(reference, until(0.2), data.setdefault("catalog", []), save))
    chosen = _pick(_runnable(data.get("survey", [])), settings)
    data["chosen_settings"] = chosen
    share = lambda k: time.monotonic() + (end - time.monotonic()) / k

    def do_sweep():
        data["sweep"] = []
        for i, (m, b, g, r) in enumerate(chosen):
            data["sweep"].append(sweep(m, b, g, reference, sizes, min(end, share(2 * (len(chosen) - i))), mode=r))
            save()

    def do_compositions():
        data["compositions"] = []
        for i, (m, b, g, r) in enumerate(chosen[:3]):
            data["compositions"].append(_compositions_of(m, b, g, reference, compositions,
                                                         min(end, share(2 * (min(3, len(chosen)) - i))), mode=r))
            save()

    def do_controls():
        data["controls"] = []
        for i, (m, b, g, r) in enumerate(chosen[:2]):
            data["controls"].append(controls(m, b, g, [b_ for b_ in (2, 4, 8, 16) if b_ in sizes] or sizes[:1],
                                             min(end, share(min(2, len(chosen)) - i)), mode=r))
            save()

    phase("sweep", do_sweep)
    phase("compositions", do_compositions)
    phase("controls", do_controls)
    data["proposal"] = propose(data, margin)
    data["timing"]["total"] = round(time.monotonic() - start, 2)
    save()
    return data


_compositions_of = compositions


def from_args(args) -> dict:
    """Calibrate as the parsed options of ``add_arguments`` say; ValueError
    for options that cannot be used."""
    return calibrate(args.out, device=args.device, deadline=args.deadline, phases=args.phases.split(","),
                     models=args.models.split(",") if args.models else None,
                     batch_sizes=[int(b) for b in args.batch_sizes.split(",")], settings=args.settings,
                     compositions=args.compositions, margin=args.margin, resume=args.resume)


def main(argv=None) -> int:
    """``kvparity calibrate``: measure, write ``--out``, print the proposal."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvparity calibrate",
                                                   description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    try:
        data = from_args(args)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(data["proposal"], indent=1))
    return 0
