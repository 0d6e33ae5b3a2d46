"""``kvparity bench``: run the benchmark suite and tabulate its ratios.

The suite (``suites/test_benchmarks*.py``, ``SUITE``) records in each benchmark's
``extra_info`` what it measured (``metric``, ``case``, ``variant``, byte
counts) and, on the variant a ratio is about, the ratio's definition and
target. This module only reads the JSON pytest-benchmark writes, so a table
can be rebuilt from any earlier run's ``benchmark.json``.
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from tabulate import tabulate

import kvparity.suites
from kvparity.suites.core.adapter import REFERENCE

# The suite's modules, in the order they run: the cache's speed (and what the others import
# from it), its memory, the harness's own speed.
SUITE = tuple(Path(kvparity.suites.__file__).parent / f"{name}.py"
              for name in ("test_benchmarks", "test_benchmarks_memory", "test_benchmarks_harness"))
RATIO_HEADERS = ["ratio", "case", "measured", "target", "met?"]
DECODE_HEADERS = [
    "model", "B", "variant", "KV", "step ms", "tokens/s", "cache MiB", "step peak MiB"
]
LONG_CONTEXT_HEADERS = [
    "model", "B", "context", "variant", "KV", "floor MiB", "attention MiB", "step peak MiB", "decode peak MiB"
]
GQA_ATTENTION_HEADERS = [
    "model", "B", "context", "read by", "query heads", "kv heads", "head_dim", "layer MiB", "attention MiB",
    "attention / layer",
]


class BenchmarkFailed(RuntimeError):
    """The suite failed. ``measured``: it still wrote results (a table is
    worth keeping); otherwise it measured nothing."""

    def __init__(self, message: str, measured: bool):
        super().__init__(message)
        self.measured = measured


def run_benchmarks(
    out_dir: Path, quick: bool, impl: Optional[str] = None, pytest_args: Sequence[str] = ()
) -> Path:
    """Run the suite into ``out_dir/benchmark.json``; write and return ``benchmarks.md``.

    The suite runs in a fresh interpreter (MLX state and model caches stay out
    of this process) through the kvparity pytest plugin, from an empty
    directory with an empty configuration of its own: the same run from a
    checkout, a wheel or a team's repository, whose pytest settings stay out
    of it. A failing suite still gets its table written when pytest produced
    the JSON; then BenchmarkFailed says so (``measured``). Paths are not
    named, by the message or by pytest-benchmark (quiet): ``out_dir`` may be a
    staging directory that is renamed or removed afterwards.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "benchmark.json"
    json_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvparity-bench-") as empty:
        config = Path(empty) / "pytest.ini"
        config.write_text("[pytest]\n")
        argv = [
            sys.executable, "-m", "pytest", *map(str, SUITE),
            "-c", str(config), "--rootdir", empty, "-p", "no:cacheprovider", "--import-mode=importlib",
            "-m", "benchmark_suite",
            f"--benchmark-json={json_path}",
            "--benchmark-quiet",
            "--benchmark-sort=fullname",
            "--kvparity-impl", impl or REFERENCE,
            *pytest_args,
        ]
        # The repository under test is the working directory, as for the other commands. A pytest
        # of its own, never a pytest-xdist worker: pytest-benchmark turns itself off where it finds
        # a worker's variables (inherited from a run under -n).
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST_")}
        env.update(KVPARITY_BENCH_QUICK="1" if quick else "0", PYTHONPATH=path)
        start = time.perf_counter()
        status = subprocess.run(argv, env=env, cwd=empty).returncode
        seconds = time.perf_counter() - start
    if not json_path.exists():
        raise BenchmarkFailed(f"benchmark suite wrote no results (pytest exit {status})", measured=False)

    md_path = out_dir / "benchmarks.md"
    md_path.write_text(render_markdown(json_path, quick, seconds=seconds, impl=impl))
    if status != 0:
        raise BenchmarkFailed(f"benchmark suite failed (pytest exit {status})", measured=True)
    return md_path


def _load(benchmark_json_path) -> List[dict]:
    return json.loads(Path(benchmark_json_path).read_text())["benchmarks"]


def _value(bench: dict, quantity: str) -> float:
    if quantity == "time":
        return bench["stats"]["median"]
    return bench["extra_info"][quantity]


def _met(value: float, target) -> str:
    if target is None:
        return ""
    op, bound = target
    return "yes" if (value >= bound if op == ">=" else value <= bound) else "NO"


def ratio_table(benchmark_json_path) -> Tuple[List[str], List[list]]:
    """(headers, rows): one row per ratio and case, grouped by ratio in run order.

    A ratio without a denominator is a rate measured on its own (generated
    schedules per second): its row shows the quantity itself. A row's
    measured value is None ("n/a") when one side of the ratio did not run
    (skipped, failed or deselected).
    """
    benchmarks = _load(benchmark_json_path)
    found: Dict[tuple, dict] = {}
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        if "metric" in info:
            found[info["metric"], info["case"], info["variant"]] = bench

    rows, seen = [], set()
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        for ratio in info.get("ratios", ()):
            key = (ratio["name"], info["case"])
            if key in seen:
                continue
            seen.add(key)
            target = ratio["target"]
            value = None
            if ratio["denominator"] is None:  # a rate: the measured quantity itself
                side = found.get((info["metric"], info["case"], ratio["numerator"]))
                value = None if side is None else _value(side, ratio["quantity"])
            else:
                sides = [
                    found.get((info["metric"], info["case"], ratio[side]))
                    for side in ("numerator", "denominator")
                ]
                if all(sides):
                    # A ratio of two quantities (peak / floor) names the denominator's.
                    quantities = (ratio["quantity"], ratio.get("denominator_quantity") or ratio["quantity"])
                    num, den = (_value(b, q) for b, q in zip(sides, quantities))
                    value = num / den if den else None
            rows.append([
                ratio["name"],
                info["case"],
                None if value is None else round(value, 3),
                "" if target is None else f"{target[0]} {target[1]:g}",
                "n/a" if value is None else _met(value, target),
            ])
    # Group the rows by ratio, in the order the ratios first ran.
    first = {}
    for row in rows:
        first.setdefault(row[0], len(first))
    return RATIO_HEADERS, sorted(rows, key=lambda row: first[row[0]])


def decode_table(benchmark_json_path) -> Tuple[List[str], List[list]]:
    """(headers, rows): step time, tokens/s and step peak memory per decode benchmark."""
    rows = []
    for bench in _load(benchmark_json_path):
        info = bench.get("extra_info", {})
        if info.get("metric") != "decode":
            continue
        step = bench["stats"]["median"]
        rows.append([
            info["model"], info["B"], info["variant"], info["kv_dtype"],
            round(step * 1e3, 2), round(info["tokens"] / step, 1),
            round(info["cache_bytes"] / 2**20, 2), round(info["step_peak_bytes"] / 2**20, 2),
        ])
    return DECODE_HEADERS, rows


def long_context_table(benchmark_json_path) -> Tuple[List[str], List[list]]:
    """(headers, rows): the memory of long-context decodes, in MiB beyond the weights."""
    rows = []
    for bench in _load(benchmark_json_path):
        info = bench.get("extra_info", {})
        if info.get("metric") != "long-context":
            continue
        mib = [
            round(info[key] / 2**20, 2)
            for key in ("floor_bytes", "attention_bytes", "step_peak_bytes", "decode_peak_bytes")
        ]
        rows.append([info["model"], info["B"], info["context"], info["variant"], info["kv_dtype"], *mib])
    return LONG_CONTEXT_HEADERS, rows


def gqa_attention_table(benchmark_json_path) -> Tuple[List[str], List[list]]:
    """(headers, rows): what mlx-lm's quantized attention over one layer allocates beyond it, per architecture."""
    rows = []
    for bench in _load(benchmark_json_path):
        info = bench.get("extra_info", {})
        if info.get("metric") != "gqa-attention":
            continue
        rows.append([
            info["model"], info["B"], info["context"], info["variant"], info["n_heads"], info["n_kv_heads"],
            info["head_dim"], round(info["floor_bytes"] / 2**20, 2), round(info["attention_bytes"] / 2**20, 2),
            round(info["attention_bytes"] / info["floor_bytes"], 2),
        ])
    return GQA_ATTENTION_HEADERS, rows


def render_markdown(
    benchmark_json_path, quick: bool, seconds: Optional[float] = None, impl: Optional[str] = None
) -> str:
    machine = json.loads(Path(benchmark_json_path).read_text()).get("machine_info", {})
    lines = [
        "# kvparity benchmarks",
        "",
        f"- grid: {'quick (KVPARITY_BENCH_QUICK=1)' if quick else 'full'}",
        f"- machine: {machine.get('cpu', {}).get('brand_raw', platform.processor())}, "
        f"{os.cpu_count()} cores, {platform.system()}; MLX {mx.__version__} "
        f"on {mx.default_device()}",
    ]
    if impl:
        lines.append(f"- implementation: `{impl}`")
    if seconds is not None:
        lines.append(f"- wall time of the suite: {seconds:.0f} s")
    lines += [
        "",
        "Each ratio is numerator / denominator, both measured in this run "
        "(median times, or bytes): `re-merge / extend` 4 means extend is 4x "
        "cheaper than re-merging; `batched / solo tokens per second` is the "
        "solo step time over the batched one. A rate (`schedules per second`) "
        "is the measured value itself.",
        "",
    ]
    headers, rows = ratio_table(benchmark_json_path)
    lines += [tabulate(rows, headers, tablefmt="github", missingval="n/a"), ""]
    headers, rows = decode_table(benchmark_json_path)
    if rows:
        lines += ["## Decode steps", "", tabulate(rows, headers, tablefmt="github"), ""]
    headers, rows = long_context_table(benchmark_json_path)
    if rows:
        lines += [
            "## Long-context memory",
            "",
            "Beyond the weights: the floor is the cache's own bytes; attention is what "
            "mlx-lm's attention over one layer allocates beyond them; the step is the "
            "last of 256 decoded tokens, the decode all 256, through one growth of the buffers.",
            "",
            tabulate(rows, headers, tablefmt="github"),
            "",
        ]
    headers, rows = gqa_attention_table(benchmark_json_path)
    if rows:
        lines += [
            "## Quantized attention for grouped-query heads",
            "",
            "What mlx-lm's quantized attention over one layer of the cache allocates beyond it, read by "
            "the architecture's query heads (grouped) and, over the same cache, by one query head per kv "
            "head: grouped heads materialise the layer's keys and values about once per query head of a "
            "group (oracle/mlx_lm_defects/gqa_quantized_attention_memory.py).",
            "",
            tabulate(rows, headers, tablefmt="github"),
            "",
        ]
    return "\n".join(lines)
