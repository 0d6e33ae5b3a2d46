"""The benchmark ratio table (ratios of two variants measured in one run), and
the exit status and paths of the commands that run the benchmark suite."""

import json
import os
import subprocess
import sys

import pytest

from kvparity.reports import bench as bench_module
from kvparity.reports.bench import SUITE, gqa_attention_table, long_context_table, ratio_table
from kvparity.reports.cli import EXIT_BROKEN, EXIT_OK, main
from kvparity.suites.format.schedule import CATALOG


def bench(case, variant, median, ratios=(), metric="join", **extra):
    return {
        "name": f"{metric}[{case}-{variant}]",
        "stats": {"median": median},
        "extra_info": {"metric": metric, "case": case, "variant": variant, "ratios": list(ratios), **extra},
    }


JOIN = {"name": "join: re-merge / extend time", "numerator": "remerge", "denominator": "extend",
        "quantity": "time", "target": [">=", 3.0]}
MEMORY = {"name": "memory: quantized / bf16 bytes per token", "numerator": "quantized",
          "denominator": "bf16", "quantity": "bytes_per_token", "target": ["<=", 0.3]}
FLOOR = {"name": "long context: quantized decode peak / its floor", "numerator": "quantized",
         "denominator": "quantized", "quantity": "decode_peak_bytes",
         "denominator_quantity": "floor_bytes", "target": None}


def test_ratios_targets_and_missing_sides(tmp_path):
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps({"benchmarks": [
        bench("B=16 width=1024", "extend", 1.0, [JOIN]),
        bench("B=16 width=1024", "remerge", 3.5),
        bench("B=4 width=1024", "extend", 1.0, [JOIN]),
        bench("B=4 width=1024", "remerge", 2.0),
        bench("bits=4", "quantized", 0.0, [MEMORY], metric="memory", bytes_per_token=36.0),
        bench("bits=4", "bf16", 0.0, metric="memory", bytes_per_token=128.0),
        bench("B=64 width=1024", "extend", 1.0, [JOIN]),  # its re-merge side did not run
        bench("B=4 context=8192", "quantized", 0.0, [FLOOR], metric="long-context",
              decode_peak_bytes=25.0, floor_bytes=10.0),
    ]}))
    headers, rows = ratio_table(path)
    assert headers == ["ratio", "case", "measured", "target", "met?"]
    table = {(r[0], r[1]): r[2:] for r in rows}
    assert table[JOIN["name"], "B=16 width=1024"] == [3.5, ">= 3", "yes"]
    assert table[JOIN["name"], "B=4 width=1024"] == [2.0, ">= 3", "NO"]
    assert table[MEMORY["name"], "bits=4"] == [0.281, "<= 0.3", "yes"]
    assert table[JOIN["name"], "B=64 width=1024"] == [None, ">= 3", "n/a"]
    # Two quantities of one variant: the decode's peak over the cache's own bytes.
    assert table[FLOOR["name"], "B=4 context=8192"] == [2.5, "", ""]


def test_long_context_table_in_mib(tmp_path):
    path = tmp_path / "benchmark.json"
    info = dict(model="llama-h64-bf16", B=4, context=8192, kv_dtype="4-bit", floor_bytes=10 * 2**20,
                attention_bytes=2**19, step_peak_bytes=21 * 2**20, decode_peak_bytes=25 * 2**20)
    path.write_text(json.dumps({"benchmarks": [
        bench("B=4 context=8192", "quantized", 0.0, metric="long-context", **info),
        bench("B=16 width=1024", "extend", 1.0, [JOIN]),
    ]}))
    headers, rows = long_context_table(path)
    assert headers[-4:] == ["floor MiB", "attention MiB", "step peak MiB", "decode peak MiB"]
    assert rows == [["llama-h64-bf16", 4, 8192, "quantized", "4-bit", 10.0, 0.5, 21.0, 25.0]]


def test_grouped_query_attention_table_per_architecture(tmp_path):
    path = tmp_path / "benchmark.json"
    info = dict(model="llama", B=4, context=8192, n_kv_heads=2, head_dim=64, kv_dtype="4-bit", floor_bytes=5 * 2**20)
    path.write_text(json.dumps({"benchmarks": [
        bench("llama context=8192", "grouped", 0.0, metric="gqa-attention", n_heads=4, attention_bytes=21 * 2**19,
              **info),
        bench("llama context=8192", "per-kv-head", 0.0, metric="gqa-attention", n_heads=2,
              attention_bytes=2**18, **info),
        bench("B=16 width=1024", "extend", 1.0, [JOIN]),
    ]}))
    headers, rows = gqa_attention_table(path)
    assert headers[-3:] == ["layer MiB", "attention MiB", "attention / layer"]
    assert rows == [["llama", 4, 8192, "grouped", 4, 2, 64, 5.0, 10.5, 2.1],
                    ["llama", 4, 8192, "per-kv-head", 2, 2, 64, 5.0, 0.25, 0.05]]


# -- `kvparity bench` and `run --bench`: a failing suite fails the command --------------
# A tiny suite stands in for suites/test_benchmarks*.py (minutes): run_benchmarks
# still runs it in a fresh pytest, as the real one is run.

TINY = '''
import pytest

@pytest.mark.benchmark_suite
def test_measures(benchmark):
    benchmark.extra_info.update({"metric": "tiny", "case": "one", "variant": "only"})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
'''
BREAKS = '''
@pytest.mark.benchmark_suite
def test_breaks():
    assert False, "a benchmark that breaks"
'''


@pytest.fixture
def suite(tmp_path, monkeypatch):
    def use(source):
        path = tmp_path / "suite" / "test_tiny.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(source)
        monkeypatch.setattr(bench_module, "SUITE", (path,))
        return path

    return use


def _reports(root):
    return sorted(p for p in root.iterdir()) if root.exists() else []


def test_bench_prints_the_final_path(suite, tmp_path, capsys):
    suite(TINY)
    out_dir = tmp_path / "reports"
    assert main(["bench", "--quick", "--out", str(out_dir)]) == EXIT_OK
    out = capsys.readouterr().out
    (report,) = _reports(out_dir)
    assert f"benchmarks: {report}" in out and ".partial-" not in out
    assert (report / "benchmark.json").exists() and (report / "benchmarks.md").exists()


def test_bench_measures_when_started_inside_a_pytest_xdist_worker(suite, tmp_path, monkeypatch):
    """pytest-benchmark turns itself off where it finds a pytest-xdist worker's
    variables; the suite's own pytest is not a worker, whoever starts it (this
    file's tests run under ``pytest -n`` too)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    suite(TINY)
    out_dir = tmp_path / "reports"
    assert main(["bench", "--quick", "--out", str(out_dir)]) == EXIT_OK
    (report,) = _reports(out_dir)
    (measured,) = json.loads((report / "benchmark.json").read_text())["benchmarks"]
    assert measured["extra_info"]["metric"] == "tiny" and measured["stats"]["rounds"] == 1


def test_bench_fails_when_its_suite_fails(suite, tmp_path, capsys):
    suite(TINY + BREAKS)
    out_dir = tmp_path / "reports"
    assert main(["bench", "--quick", "--out", str(out_dir)]) == EXIT_BROKEN
    captured = capsys.readouterr()
    (report,) = _reports(out_dir)  # what it did measure is kept, under its final name
    assert "benchmark suite failed (pytest exit 1)" in captured.err
    assert f"what it measured is in {report}" in captured.err
    assert ".partial-" not in captured.out + captured.err
    assert (report / "benchmark.json").exists()


def test_bench_that_measured_nothing_fails_and_leaves_nothing(suite, tmp_path, capsys):
    suite("def broken(:\n")
    out_dir = tmp_path / "reports"
    assert main(["bench", "--quick", "--out", str(out_dir)]) == EXIT_BROKEN
    captured = capsys.readouterr()
    assert "benchmark suite wrote no results" in captured.err
    assert _reports(out_dir) == [] and ".partial-" not in captured.out + captured.err


def _run_bench_failing(out_dir, capsys):
    """``kvparity run --bench`` on one L1 schedule, whose benchmark suite fails:
    exit 1, one report directory; returns it and what was printed."""
    code = main(["run", "--bench", "--quick", "--out", str(out_dir), "--level", "L1",
                 "--schedule", str(CATALOG / "join-empty.json")])
    captured = capsys.readouterr()
    assert code == EXIT_BROKEN, captured.out + captured.err
    (report,) = _reports(out_dir)
    assert (report / "report.json").exists()
    return report, captured


def test_run_bench_keeps_the_parity_report_and_fails(suite, tmp_path, capsys):
    suite(TINY + BREAKS)
    report, captured = _run_bench_failing(tmp_path / "reports", capsys)
    assert (report / "benchmark.json").exists()
    assert f"report: {report}" in captured.out and "benchmark suite failed" in captured.err


def test_run_bench_whose_suite_measured_nothing_still_writes_the_report(suite, tmp_path, capsys):
    suite("def broken(:\n")
    report, captured = _run_bench_failing(tmp_path / "reports", capsys)
    assert "benchmark suite wrote no results" in captured.err


# -- the real suite under pytest-xdist --------------------------------------------------


@pytest.mark.slow  # a pytest process that measures a benchmark
def test_the_benchmark_suite_is_skipped_in_a_pytest_xdist_worker_saying_why():
    """In a worker (the variable pytest-xdist sets, and pytest-benchmark reads)
    every benchmark is skipped with the reason; outside one the same
    benchmark measures."""

    def one_benchmark(**worker):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
        return subprocess.run([sys.executable, "-m", "pytest", *map(str, SUITE), "-m", "benchmark_suite", "-q", "-rs",
                               "-k", "test_bytes_per_token and 4-64-quantized"],
                              env={**env, **worker}, cwd=SUITE[0].parent.parent, capture_output=True, text=True)

    skipped = one_benchmark(PYTEST_XDIST_WORKER="gw0")
    assert "1 skipped" in skipped.stdout and "do not run under pytest-xdist" in skipped.stdout, skipped.stdout
    measured = one_benchmark()
    assert measured.returncode == 0 and "1 passed" in measured.stdout, measured.stdout
