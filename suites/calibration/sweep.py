"""Measuring drift where both paths run: B requests in one batch over the
batch sizes (``sweep``), one target request in many batch compositions
(``compositions``), and the RoPE and mask negative controls through the
sweep's schedules (``controls``), which a threshold must not tolerate."""

import time
from typing import List

import numpy as np

from kvparity.oracle.arrays import digest
from kvparity.oracle.models import load_model
from kvparity.oracle.solo import greedy
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.calibration.backend import (
    backend_warnings, captured_stderr, error_text, reading, schedule_doc, fresh_solo_traces,
)
from kvparity.suites.calibration.drift import batched_positions, batched_rows, summarize
from kvparity.suites.core.loading import parse

CONTROLS = (
    "kvparity.impl.negative_controls:RopeOffsetIgnoresLeftPadding",
    "kvparity.impl.negative_controls:MaskIgnoresLeftPadding",
)


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


def sweep(model_name, bits, group_size, implementation, batch_sizes, deadline, seed=0, mode="as-is"):
    return reading(mode, implementation, _sweep, model_name, bits, group_size, implementation, batch_sizes,
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
                traces = fresh_solo_traces(model, schedule)
                rows = batched_rows(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"B": B, "error": error_text(error)})
            continue
        positions = [p for r in rows.values() for p in batched_positions(r)]
        pooled += positions
        per_b[str(B)] = summarize(positions)
        per_b[str(B)]["stderr_lines"] = len(backend_warnings(err[0]))
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
    return reading(mode, implementation, _compositions, model_name, bits, group_size, implementation, n,
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
            traces = fresh_solo_traces(model, schedule)
            rows = batched_rows(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"kind": kind, "error": error_text(error)})
            continue
        solo = traces["t"]
        decode = [c.logits for c in solo.calls if c.op == "append"]
        if solo_hash is None:
            solo_hash = digest(decode)
            solo_tokens = [greedy(x[-1]) for x in decode]
        elif digest(decode) != solo_hash:
            errors.append({"kind": kind, "error": "the target's solo run differs between compositions"})
        trials.append(_trial(kind, size, rows["t"]))
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


def _trial(kind, size, records) -> dict:
    """The target's calls after it joined, as the batch computed them."""
    mine = [logits for kind_, _, _, logits in records if kind_ not in ("join", "alone")]
    positions = [p for kind_, _, ps, _ in records if kind_ not in ("join", "alone") for p in ps]
    return {
        "kind": kind,
        "batch_size": size,
        "tokens": [p["token"] for p in positions],
        "logits_sha256": digest(mine),
        "kl_max": max((p["kl"] for p in positions), default=0.0),
        "top1_agree": sum(p["top1"] for p in positions),
        "positions": len(positions),
    }


def controls(model_name, bits, group_size, batch_sizes, deadline, seed=0, mode="as-is"):
    """Each control through the sweep's schedules: per padded row, its KL
    max and whether every greedy token agreed."""
    model = load_model(model_name)
    out = {}
    for spec in CONTROLS:
        implementation = load_implementation(spec)
        out[spec.rpartition(":")[2]] = reading(mode, implementation, _control, model, model_name, bits,
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
            traces = fresh_solo_traces(model, schedule)
            rows = batched_rows(model, implementation, schedule, traces)
        except Exception as error:
            errors.append({"B": B, "error": error_text(error)})
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
