"""A real model's run kept affordable: what the catalog asks of it, chosen and costed.

A model directory (``--model DIR``: a team's own checkpoint) can be large, and
each schedule runs it twice (alone, for the oracle, and batched) or three
times (L3: alone, and the engine in both prefill modes). Before anything
runs, kvparity

* reads its size from the safetensors headers (parameters, bytes) and refuses
  it where its weights, the largest schedule's caches and the logits the
  oracle keeps would not fit the memory limit (``KVPARITY_MAX_MEMORY``,
  ``suites/format/schedule.py``'s rule);
* measures its cost per token (a prefill and a few decode steps through
  mlx-lm's own prompt cache);
* picks the smallest set of catalog files that still reaches every cell the
  model can express: at L2, each (path by which a batch's arrays are created
  or grown, or event kind) at each (bits, group size) a file runs with; at
  L3, each engine feature a file exercises at each kv setting. A file that
  does not fit the model reaches none. ``--schedule`` and ``--level``
  narrow the run further;
* says all of it, with the estimated wall time of the selection.
"""

import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, FrozenSet, List, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvparity.suites.format import arrivals
from kvparity.suites.search.coverage import paths_of
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.format.schedule import gib, memory_limit

PROBE_PROMPT, PROBE_DECODE = 32, 8  # the cost measurement: one prefill, then single-token steps
PASSES = {"L2": 2, "L3": 3}  # times a schedule's tokens go through the model: alone, and batched (L3: two modes)


class ModelTooLarge(ScheduleError):
    """The model and the selection would not fit the memory limit."""


@dataclass(frozen=True)
class ModelCost:
    parameters: int
    weight_bytes: int
    seconds_per_call: float  # measured: a forward of one token
    seconds_per_token: float  # measured: each further token of a prefill
    cache_bytes_per_token: int  # every layer's keys and values, dense, at the model's dtype
    logits_bytes_per_token: int  # what a solo trace keeps per token (float32 logits)

    def seconds(self, calls: int, tokens: int) -> float:
        return calls * self.seconds_per_call + max(tokens - calls, 0) * self.seconds_per_token


def measure(loaded) -> ModelCost:
    """The model's size (from its weight files) and its measured cost per token."""
    from kvparity.oracle.model_path import read_config, weights_size

    size = weights_size(loaded.directory, read_config(loaded.directory))

    def timed(cache, tokens):
        start = time.perf_counter()
        mx.eval(loaded.model(mx.array(tokens)[None] % loaded.vocab_size, cache=cache))
        return time.perf_counter() - start

    timed(make_prompt_cache(loaded.model), list(range(PROBE_PROMPT)))  # the first call builds what later ones reuse
    cache = make_prompt_cache(loaded.model)
    prefill = timed(cache, list(range(PROBE_PROMPT)))
    step = min(timed(cache, [i]) for i in range(PROBE_DECODE))
    per_token = sum((layer.kv_heads or 0) * ((layer.key_dim or 0) + (layer.value_dim or 0))
                    for layer in loaded.plan.layers) * loaded.dtype.size
    return ModelCost(size.parameters, size.bytes, step, max(prefill - step, 0.0) / (PROBE_PROMPT - 1), per_token,
                     4 * loaded.vocab_size)


def tokens_of(level: str, schedule) -> Tuple[int, int]:
    """(forward calls, tokens) of one pass of the schedule, each request alone."""
    if arrivals.ArrivalSchedule is type(schedule):
        requests = schedule.requests.values()
        return (sum(1 + r.max_tokens for r in requests),
                sum(r.prompt_len + len(r.prompt or ()) + r.max_tokens for r in requests))
    calls = [c for calls in schedule.calls.values() for c in calls]
    return len(calls), sum(c.n for c in calls)


def cells_of(level: str, schedule, unfit: Callable) -> FrozenSet[tuple]:
    """What one file exercises on the model (nothing where it does not fit)."""
    if unfit(schedule):
        return frozenset()
    if level == "L2":
        what = set(paths_of(schedule)) | {e.kind for e in schedule.events}
        return frozenset((w, schedule.bits, schedule.group_size) for w in what)
    features = {f"engine.{k}" for k, v in vars(schedule.engine).items() if v is not None}
    features |= {f"request.{k}" for r in schedule.requests.values() for k, v in vars(r).items()
                 if v not in (None, False, 0, ()) and k not in ("id", "arrival", "seed", "sent_at_ms")}
    return frozenset((f, bits, group) for f in features for bits, group, _ in schedule.kv_settings)


def smallest_cover(level: str, schedules: List, unfit: Callable) -> List:
    """The fewest files (greedy, the cheapest first among equals) reaching every cell the files reach."""
    cells = {id(s): cells_of(level, s, unfit) for s in schedules}
    wanted = set().union(*cells.values()) if cells else set()
    chosen = []
    while wanted:
        best = max(schedules, key=lambda s: (len(cells[id(s)] & wanted), -tokens_of(level, s)[1]))
        chosen.append(best)
        wanted -= cells[id(best)]
    return sorted(chosen, key=lambda s: s.name)


@lru_cache(maxsize=None)
def _cost(path: str):
    from kvparity.oracle.models import load_model

    return measure(load_model(path))


def select_for_model(level: str, schedules: List, loaded, unfit: Callable, out=None) -> List:
    """The catalog files a model directory runs by default at ``level``, said
    with the model's size, cost and the estimated wall time; refused where
    the selection would not fit the memory limit."""
    cost = _cost(str(loaded.path))
    chosen = smallest_cover(level, schedules, unfit)
    calls, processed = (sum(tokens_of(level, s)[i] for s in chosen) * PASSES[level] for i in (0, 1))
    held = max((tokens_of(level, s)[1] for s in chosen), default=0)
    need = cost.weight_bytes + held * (2 * cost.cache_bytes_per_token + cost.logits_bytes_per_token)
    limit, whence = memory_limit()
    where = Path(loaded.path)
    if need > limit:
        raise ModelTooLarge(f"{where}: {cost.parameters / 1e6:.1f}M parameters would need about {gib(need)} "
                            f"({gib(cost.weight_bytes)} of weights, and {held} tokens of the largest {level} "
                            f"file's caches and logits), over the limit of {gib(limit)} ({whence})")
    print(f"{level} on {where}: {cost.parameters / 1e6:.1f}M parameters, {gib(cost.weight_bytes)} of weights; "
          f"measured {cost.seconds_per_call * 1e3:.1f} ms a decode step, {cost.seconds_per_token * 1e3:.2f} ms a "
          f"further prefill token; {len(chosen)} of {len(schedules)} catalog files reach every cell it can express; "
          f"about {gib(need)} at most (limit {gib(limit)}); estimated wall time "
          f"{cost.seconds(calls, processed):.0f} s ({calls} forward calls, {processed} tokens)", file=out or sys.stderr)
    return chosen
