"""A device is trusted only after its known-answer check (oracle/known_answer.py):
it passes here, each kind of wrong kernel fails it, and a run on a device
that fails it judges nothing, exits 125 and writes a report saying why."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from kvparity.oracle import known_answer
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_USAGE

REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"


def test_the_cpu_computes_the_known_answers():
    answer = known_answer.known_answer(mx.cpu)
    assert answer.passed and answer.comparisons == 36 and not answer.failures, answer.summary
    assert answer.to_json() == {"device": answer.device, "passed": True, "comparisons": 36, "failures": [],
                                "unavailable": []}


def zeros_from(real):
    return lambda *args, **kwargs: mx.zeros_like(real(*args, **kwargs))


def quantize_off_the_cpu(real):
    """Right on the CPU stream (the known answer), one scale off elsewhere."""
    def quantize(x, **kwargs):
        packed, scales, biases = real(x, **kwargs)
        if kwargs.get("stream") is mx.cpu:
            return packed, scales, biases
        return packed, scales.at[..., 0].add(1), biases
    return quantize


@pytest.mark.parametrize("name, broken, caught", [
    ("quantize", quantize_off_the_cpu, "quantize 4-bit bfloat16 scales: 64 of 64"),
    ("dequantize", zeros_from, "dequantize 4-bit bfloat16"),
    ("quantized_matmul", zeros_from, "quantized_matmul 4-bit float16 (attention scores)"),
    ("fast.scaled_dot_product_attention", zeros_from, "scaled_dot_product_attention float16 over left padding"),
    ("softmax", zeros_from, "mlx-lm quantized attention float16 over left padding, 4-bit grid"),
])
def test_a_wrong_kernel_fails_the_check(name, broken, caught, monkeypatch):
    owner = mx.fast if name.startswith("fast.") else mx
    attribute = name.removeprefix("fast.")
    monkeypatch.setattr(owner, attribute, broken(getattr(owner, attribute)))
    answer = known_answer.known_answer(mx.cpu)
    assert not answer.passed and "failed its known-answer check" in answer.summary, answer.summary
    assert caught in answer.summary, answer.summary


def test_an_operation_the_device_cannot_run_is_noted_not_failed(monkeypatch):
    """As MLX's CUDA backend raises "No implementation for problem shape" on
    some quantized attention shapes: no wrong number, and the schedules that
    need it say "cannot run" themselves."""
    def no_kernel(*args, **kwargs):
        raise ValueError("No implementation for problem shape")
    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)
    answer = known_answer.known_answer(mx.cpu)
    assert answer.passed and answer.comparisons == 28 and len(answer.unavailable) == 8, answer.summary
    assert "the device raised on 8: quantized_matmul 4-bit float16 (attention scores): ValueError: No " \
           "implementation for problem shape" in answer.summary


def test_nothing_compared_is_no_pass():
    assert not known_answer.KnownAnswer("cpu").passed


# A device whose fused attention returns zeros, as the paravirtual GPUs of
# hosted macOS runners were seen to do, stood in for by the CPU with that
# kernel replaced before kvparity starts.
BROKEN_DEVICE = """\
import mlx.core as mx
_real = mx.fast.scaled_dot_product_attention
mx.fast.scaled_dot_product_attention = lambda *a, **k: mx.zeros_like(_real(*a, **k))
"""


@pytest.fixture
def broken_device(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BROKEN_DEVICE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("command", [["run", "--level", "L1"], ["check", "--level", "L1"],
                                     ["run", "--device", "cpu"]])
def test_a_device_that_fails_the_check_judges_nothing(command, broken_device, tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kvparity", *command, "--impl", REFERENCE]
    argv += ["--out", str(out)] if command[0] == "run" else []
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=broken_device)
    assert done.returncode == EXIT_CANNOT_JUDGE, done.stdout + done.stderr
    assert "cannot judge here: cpu" in done.stderr and "failed its known-answer check" in done.stderr
    assert "scaled_dot_product_attention float16 over left padding" in done.stderr
    if command[0] == "run":
        (report,) = out.glob("*/report.json")
        record = json.loads(report.read_text())
        assert record["exit_status"] == EXIT_CANNOT_JUDGE and record["passed"] is False and not record["results"]
        assert record["gaps"][0].startswith("cpu") and "failed its known-answer check" in record["gaps"][0]
        assert record["environment"]["known_answer"]["passed"] is False


def test_the_pytest_plugin_judges_nothing_on_a_device_that_fails_the_check(broken_device, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--kvparity-impl",
                           REFERENCE, "--pyargs", "kvparity.suites.test_l1_catalog", "-k", "join"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=broken_device)
    assert done.returncode == EXIT_CANNOT_JUDGE, done.stdout + done.stderr
    assert "kvparity: cannot judge here: cpu" in done.stdout + done.stderr
    assert " passed" not in done.stdout


@pytest.mark.slow  # a real git bisect run
def test_git_bisect_run_on_a_device_that_fails_the_check_aborts(broken_device, tmp_path, monkeypatch):
    """Every commit would be skipped on such a device: the bisection is
    aborted (129) on the first commit it tries, blaming and skipping none."""
    from kvparity.reports.test_bisection import GOOD, _skipped, bisect_run, commit, git

    repo = tmp_path / "server"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "dev@example.com")
    git(repo, "config", "user.name", "dev")
    shas = [commit(repo, GOOD + "#" * n + "\n", f"cache: change {n}") for n in range(4)]
    monkeypatch.setenv("PYTHONPATH", broken_device["PYTHONPATH"])
    done, log = bisect_run(repo, shas[0], shas[-1], [sys.executable, "-m", "kvparity", "check", "--impl",
                                                    "mycache:Cache", "--level", "L1"])
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "first bad commit" not in output, output
    assert f"exit code {EXIT_USAGE}" in output and "a git bisection cannot run here" in output, output
    assert log.count("# bad:") == 1 and log.count("# good:") == 1 and not _skipped(log), log


def test_the_backend_defect_script_says_where_it_cannot_run():
    """On a machine without a GPU the CUDA reproduction cannot run: exit 2, never a "fixed"."""
    import importlib.resources

    script = importlib.resources.files("kvparity.oracle") / "backend_defects" / "cuda_quantized_matmul_one_group.py"
    if mx.is_available(mx.gpu):
        pytest.skip("this machine has a GPU: the script judges it (exit 0 or 1)")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "cannot run here: this MLX has no GPU backend\n"), done.stderr
