"""The kvparity command: exit codes, summary, reports.

Exit codes are what `git bisect run` and CI act on: 0 parity holds, 1 parity
broken, 125 cannot judge here, and above 127 (git aborts a bisection) 128 the
harness itself failed, 129 usage (refused before any work). Each class is checked here in-process; test_bisection.py
checks them under a real `git bisect run`.
"""

import json
import sys
import textwrap

import pytest

from kvparity.reports import cli, verdicts
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_HARNESS_ERROR, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.format.schedule import CATALOG

CONTROLS = "kvparity.impl.negative_controls"
ONE_L1 = ["--level", "L1", "--schedule", str(CATALOG / "join-longer-joiner.json")]


def outcome(capsys):
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a schedule, a solo run or a benchmark starts: usage
    errors must be found before any of them."""

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the usage error was found")

    import kvparity.oracle.solo
    import kvparity.reports.bench
    import kvparity.suites.l1.run
    import kvparity.suites.l2.run

    monkeypatch.setattr(kvparity.suites.l1.run, "run_l1", forbidden)
    monkeypatch.setattr(kvparity.suites.l2.run, "run_l2", forbidden)
    monkeypatch.setattr(kvparity.oracle.solo, "run_solo", forbidden)
    monkeypatch.setattr(kvparity.reports.bench, "run_benchmarks", forbidden)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A folder on sys.path for implementations written by a test (the CLI
    also puts the working directory first, as under git bisect run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_exit_codes_agree_with_the_verdicts():
    # cli spells them out so that it can report a harness that cannot import itself
    assert (cli.EXIT_OK, cli.EXIT_BROKEN, cli.EXIT_USAGE, cli.EXIT_CANNOT_JUDGE) == (
        verdicts.EXIT_OK, verdicts.EXIT_BROKEN, verdicts.EXIT_USAGE, verdicts.EXIT_CANNOT_JUDGE)


@pytest.mark.gqa_batched
def test_run_passes_and_writes_a_report(tmp_path, capsys):
    code = main(["run", "--out", str(tmp_path), "--schedule", str(CATALOG / "join-longer-joiner.json")])
    out, err = outcome(capsys)
    assert code == EXIT_OK, out + err
    assert "join-longer-joiner" in out and "2 passed, 0 failed" in out
    (report,) = list(tmp_path.iterdir())
    assert f"report: {report}" in out and ".partial-" not in out
    record = json.loads((report / "report.json").read_text())
    assert record["schema"].startswith("kvparity.report/") and record["exit_status"] == EXIT_OK
    assert record["environment"]["implementation"].endswith("BatchQuantizedKVCache")
    assert "## Summary" in (report / "report.md").read_text()


def test_run_exits_1_when_parity_breaks(capsys):
    assert main(["run", "--no-report", *ONE_L1, "--impl", f"{CONTROLS}:MaskIgnoresLeftPadding"]) == EXIT_BROKEN
    assert "FAIL" in outcome(capsys)[0]


def test_an_exception_from_the_implementation_is_a_failure_not_a_harness_error(module_dir, capsys):
    (module_dir / "raising_cache.py").write_text(textwrap.dedent("""
        from kvparity.impl.batch_quantized import BatchQuantizedKVCache

        class Cache(BatchQuantizedKVCache):
            def extend(self, other):
                raise ValueError("shapes do not line up")
    """))
    code = main(["check", *ONE_L1, "--impl", "raising_cache:Cache"])
    out, err = outcome(capsys)
    assert code == EXIT_BROKEN, out + err
    assert "extend raised ValueError" in out and "Traceback" not in err


# -- 2: usage, one line on stderr, before any work -------------------------------------


def _policy_file(tmp_path, doc):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(doc))
    return str(path)


USAGE = {
    "unknown model": (lambda tmp: ["check", "--model", "nosuchmodel"],
                      "unknown model (available: llama-h64-bf16"),
    "unknown model, probe": (lambda tmp: ["probe", "--model", "nosuchmodel"], "unknown model"),
    "impl without a colon": (lambda tmp: ["check", "--impl", "nonexistent"], "expected 'package.module:factory'"),
    "impl without a class": (lambda tmp: ["check", "--impl", "kvparity.impl.batch_quantized:Nope"],
                             "has no Nope"),
    "class missing members": (lambda tmp: ["check", "--impl", "collections:OrderedDict"],
                              "OrderedDict lacks merge, extend"),
    "run --out under a file": (lambda tmp: ["run", "--out", str(tmp / "file" / "reports"), *ONE_L1],
                               "is not a directory"),
    "bench --out under a file": (lambda tmp: ["bench", "--out", str(tmp / "file" / "reports")],
                                 "is not a directory"),
    "bisect --out under a file": (lambda tmp: ["bisect", str(CATALOG / "rollback-uneven.json"),
                                               "--out", str(tmp / "file" / "min.json")], "is not a directory"),
    "record under a file": (lambda tmp: ["record", str(tmp / "file" / "golden")], "is not a directory"),
    "record into an existing directory": (lambda tmp: ["record", str(tmp)], "never overwritten"),
    "policy with an unknown field": (
        lambda tmp: ["check", "--policy", _policy_file(tmp, {"backend": "cpu", "colour": "red"})],
        "unknown field 'colour'"),
    "policy without a backend": (
        lambda tmp: ["check", "--policy", _policy_file(tmp, {"logits": {"gate": "bit-exact"}})],
        "missing field 'backend'"),
    "policy by an unknown name": (lambda tmp: ["check", "--policy", "tpu"], "no policy 'tpu'"),
    "policy on compare": (lambda tmp: ["compare", str(tmp), str(tmp), "--policy", "tpu"], "no policy 'tpu'"),
    "text prompt without a tokenizer": (
        lambda tmp: ["check", "--level", "L2", "--model", "llama-h64-bf16",
                     "--schedule", str(CATALOG / "real" / "smollm2-joins-rollback-leave.json")],
        "text prompts need a tokenizer"),
    "bisect at a level the schedule lacks": (
        lambda tmp: ["bisect", str(CATALOG / "batched-prefill.json"), "--level", "L2"], "not an L2 schedule"),
    "not a trace directory": (lambda tmp: ["compare", str(tmp), str(tmp)], "not a trace directory"),
}


@pytest.mark.parametrize("case", USAGE, ids=list(USAGE))
def test_usage_errors_exit_129_before_any_work(case, tmp_path, no_work, capsys):
    (tmp_path / "file").write_text("a file, not a folder\n")
    argv, message = USAGE[case]
    code = main(argv(tmp_path))
    out, err = outcome(capsys)
    assert code == EXIT_USAGE, out + err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not any(p.name.startswith(".kvparity-probe-") for p in tmp_path.iterdir())


def test_argparses_own_errors_exit_as_usage_errors_do(capsys):
    for argv in (["check", "--no-such-option"], ["nosuchcommand"], ["bisect"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == EXIT_USAGE > 127, argv  # argparse's 2 would read as "bad" to git bisect run
    assert main(["check", "--level", "L9"]) == EXIT_USAGE
    assert "levels 'L9': expected some of L1, L2, L3, L4, or all" in outcome(capsys)[1]


def test_calibrate_refuses_unknown_phases_and_an_unwritable_out_before_any_work(tmp_path, no_work, capsys):
    (tmp_path / "file").write_text("a file, not a folder\n")
    assert main(["calibrate", "--out", str(tmp_path / "c.json"), "--phases", "survey,bogus"]) == EXIT_USAGE
    assert "unknown phases bogus" in outcome(capsys)[1]
    assert main(["calibrate", "--out", str(tmp_path / "file" / "c.json")]) == EXIT_USAGE
    assert "is not a directory" in outcome(capsys)[1]
    assert not (tmp_path / "c.json").exists()


def test_usage_is_reported_before_what_cannot_run_here(no_work, capsys):
    # A typo is found even on a machine that could not run the rest.
    assert main(["check", "--device", "gpu", "--impl", "nonexistent"]) == EXIT_USAGE
    assert main(["check", "--policy", "tpu", "--impl", "no.such.module:Cache"]) == EXIT_USAGE


def test_bad_schedule_exits_2_naming_the_file(tmp_path, no_work, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "requests": {"a": {"prompt_len": 2}}, "events": [{"leave": ["a"]}]}))
    assert main(["run", "--no-report", "--schedule", str(bad)]) == EXIT_USAGE
    assert f"{bad}: event #0 leave" in outcome(capsys)[1]


# -- 125: cannot judge here ------------------------------------------------------------


def test_a_module_that_does_not_import_exits_125(capsys):
    assert main(["run", "--no-report", *ONE_L1, "--impl", "no.such.module:Cache"]) == EXIT_CANNOT_JUDGE
    assert "cannot import no.such.module" in outcome(capsys)[1]


def test_a_module_that_does_not_even_parse_exits_125(module_dir, capsys):
    (module_dir / "halfway_cache.py").write_text("def merge(:\n")
    assert main(["check", *ONE_L1, "--impl", "halfway_cache:Cache"]) == EXIT_CANNOT_JUDGE
    err = outcome(capsys)[1]
    assert "importing halfway_cache raised SyntaxError" in err and "Traceback" not in err


def test_a_factory_that_raises_exits_125(module_dir, capsys):
    (module_dir / "failing_factory.py").write_text("def make():\n    raise RuntimeError('no kernels here')\n")
    assert main(["check", *ONE_L1, "--impl", "failing_factory:make"]) == EXIT_CANNOT_JUDGE
    err = outcome(capsys)[1]
    assert "the factory raised RuntimeError: no kernels here" in err and "Traceback" not in err


def test_missing_backend_exits_125(capsys):
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        pytest.skip("this machine has a GPU backend")
    assert main(["run", "--no-report", "--device", "gpu", *ONE_L1]) == EXIT_CANNOT_JUDGE
    assert "no gpu backend" in outcome(capsys)[1]


def test_a_run_without_evidence_exits_125(capsys):
    # Every schedule selected needs per-row rollback, which this class lacks:
    # nothing was compared, so nothing can be said.
    code = main(["check", "--level", "L1", "--schedule", str(CATALOG / "rollback-uneven.json"),
                 "--impl", f"{CONTROLS}:WithoutPerRowRollback"])
    out, _ = outcome(capsys)
    assert code == EXIT_CANNOT_JUDGE, out
    assert "0 passed, 0 failed, 1 not supported" in out


# -- 128: the harness's own error ------------------------------------------------------


def test_an_error_inside_the_harness_exits_128(monkeypatch, capsys):
    import kvparity.suites.l1.run

    def bug(*args, **kwargs):
        raise KeyError("a bug in the harness")

    monkeypatch.setattr(kvparity.suites.l1.run, "check_event", bug)
    code = main(["check", *ONE_L1])
    out, err = outcome(capsys)
    assert code == EXIT_HARNESS_ERROR, out + err
    assert code > 127  # git bisect run aborts on it rather than marking the commit bad
    assert "internal error" in err and "KeyError" in err


# -- the other commands ----------------------------------------------------------------


def test_replay_prints_first_divergences(capsys):
    path = CATALOG / "rollback-uneven.json"
    code = main(["replay", str(path), "--level", "L1", "--impl", f"{CONTROLS}:RollbackByLargest"])
    assert code == EXIT_BROKEN
    assert "offset: after event #2 spec_round" in outcome(capsys)[0]


def test_help_lists_commands_models_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = outcome(capsys)[0]
    assert "run" in out and "replay" in out and "125" in out and "128" in out
    assert "llama-h64-bf16" in out and "smollm2" in out


def test_probe_prints_the_l0_table(capsys):
    assert main(["probe", "--batch-sizes", "1,4"]) == EXIT_OK
    out = outcome(capsys)[0]
    for op in ("matmul", "quantized_matmul", "quantize", "rope_per_row_offset", "quantized_sdpa_left_padding"):
        assert op in out
    assert "B=4" in out


@pytest.mark.gqa_batched
def test_run_l2_reports_logit_agreement(capsys):
    code = main(["run", "--no-report", "--level", "L2", "--schedule", str(CATALOG / "rollback-uneven.json")])
    out = outcome(capsys)[0]
    assert code == EXIT_OK, out
    # 36 positions: only logits the implementation produced count (waiting rows are mlx-lm alone)
    assert "logits bit-exact" in out and "36/36" in out


def test_main_module_exits_with_mains_status(tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "kvparity", "check", "--impl", "nonexistent"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE, done.stderr


# -- L3 through the command line -------------------------------------------------------

STAGGERED = str(CATALOG / "l3" / "staggered.json")


@pytest.mark.gqa_batched
def test_l3_run_serves_both_prefill_modes_and_reports_the_timeline(tmp_path, capsys):
    assert main(["run", "--level", "L3", "--schedule", STAGGERED, "--out", str(tmp_path)]) == EXIT_OK
    out = outcome(capsys)[0]
    assert "staggered (prefill_batch_size=1)" in out and "staggered (engine default)" in out
    (report,) = tmp_path.iterdir()
    record = json.loads((report / "report.json").read_text())
    assert {r["level"] for r in record["results"]} == {"L3"}
    assert all(r["timeline"] for r in record["results"])
    assert "## L3 timeline" in (report / "report.md").read_text()


@pytest.mark.gqa_batched
def test_l3_check_fails_a_mask_bug_naming_request_token_and_engine_step(capsys):
    code = main(["replay", STAGGERED, "--level", "L3", "--impl", f"{CONTROLS}:MaskIgnoresLeftPadding"])
    assert code == EXIT_BROKEN
    assert "logprobs: after event #0 serve, engine step" in outcome(capsys)[0]


@pytest.mark.gqa_batched
def test_l3_bisect_shrinks_an_arrivals_schedule_that_replays(tmp_path, capsys):
    out = tmp_path / "min.json"
    mask_bug = f"{CONTROLS}:MaskIgnoresLeftPadding"
    assert main(["bisect", STAGGERED, "--level", "L3", "--impl", mask_bug, "--out", str(out)]) == EXIT_BROKEN
    minimal = json.loads(out.read_text())
    assert minimal["kind"] == "arrivals" and len(minimal["requests"]) < 4
    assert main(["replay", str(out), "--level", "L3", "--impl", mask_bug]) == EXIT_BROKEN
    assert main(["replay", str(out), "--level", "L3"]) == EXIT_OK


@pytest.mark.parametrize("argv, message", [
    (["check", "--level", "L3", "--schedule", str(CATALOG / "join-empty.json")], "holds no schedule for L3"),
    (["check", "--level", "L3", "--schedule", STAGGERED, "--engine", "nocolon"], "expected 'package.module:factory'"),
    (["check", "--level", "L3", "--schedule", STAGGERED, "--engine", "kvparity.suites.l3.engines:nothing"], "has no"),
])
def test_l3_usage_errors_exit_129(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in outcome(capsys)[1]
