"""L4, a real server over HTTP: mlx-lm's own server passes, dense and with
--kv-bits; each negative-control server fails naming the request, the token
position and the comparison that broke; a server that dies is a FAIL with
its last log lines, one that never answers cannot be judged, and bad input
is refused before anything runs. No process is left behind. (How answers
and streams are read and compared, with no server: ``test_l4_answers.py``.)"""

import json
import os
import sys
from pathlib import Path

import pytest

from kvparity.oracle.atomic import STAGING
from kvparity.oracle.models import zoo_models
from kvparity.reports.cli import main
from kvparity.reports.documents import load_checked
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE
from kvparity.reports.report_json import SCHEMA_PATH
from kvparity.suites.l4 import server as l4_server
from kvparity.suites.format.checks import ALONE, KV_APPLIED, LOGPROBS, TEXT, TOKENS
from kvparity.suites.format.levels import L4
from kvparity.suites.runners import L4_CATALOG, RUNNERS, RunOptions, model_set

BURST = str(L4_CATALOG / "burst.json")
STREAMED = str(L4_CATALOG / "streamed.json")
CONVERSATIONS = str(L4_CATALOG / "conversations.json")
MLX_LM = f"{sys.executable} -m mlx_lm server --model {{model}} --port {{port}}"
KV = "--kv-bits 4 --kv-group-size 64 --quantized-kv-start 0"
DIES = f"{sys.executable} -c \"import sys; print('cannot load {{model}}', file=sys.stderr); sys.exit(3)\" {{port}}"


def control(name: str) -> str:
    return f"{sys.executable} -m kvparity.impl.servers.{name} --model {{model}} --port {{port}}"


def serving(root: Path) -> list:
    """Processes serving a model directory under root (none may outlive a run)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"{root}/" in line:
            found.append(line)
    return found


@pytest.fixture
def servers_running(tmp_path_factory, tmp_path, monkeypatch):
    """This test's servers: its runs, in process and in children, write their
    model directories under their --out (its tmp_path) or the default output
    under a working directory of its own, so a server another xdist worker
    runs at the same moment is not taken for one left behind."""
    root = tmp_path_factory.mktemp("models")
    monkeypatch.chdir(root)
    monkeypatch.setattr(l4_server, "_MODEL_ROOT", None)
    monkeypatch.setattr(l4_server, "_MODEL_DIRS", {})
    return lambda: serving(root) + serving(tmp_path)


def report(out: Path) -> dict:
    """The run's report.json, checked against the report schema (beside it, while
    the process lasts, the folder of the model directories its servers loaded)."""
    (directory,) = (entry for entry in out.iterdir() if not entry.name.startswith(STAGING))
    return load_checked(directory / "report.json", SCHEMA_PATH, AssertionError)


def unpassed_rows(doc: dict) -> str:
    """Each row that did not pass, with its reason and what it stood on (the
    server's prompt cache, mlx-lm's run it was or was not compared with): a
    no-evidence row depends on the server's timing, which the summary table omits."""
    return "\n".join(f"{run['schedule']} {row['request']}: {row['verdict']}: {row['reason']}; "
                     f"{json.dumps(row['metrics'])}"
                     for run in doc["results"] for row in run["rows"] if row["verdict"] != "pass")


@pytest.mark.parametrize("args, said", [
    ([], "L4 judges a server: give --server"),
    (["--server", MLX_LM, "--url", "http://127.0.0.1:8080"], "--server and --url: give one"),
    (["--server", "python -m mlx_lm server --model {model}"], "{port}"),
    (["--url", "http://example.com:8080"], "127.0.0.1, localhost or [::1]"),
    (["--server", MLX_LM, "--concurrency", "0"], "--concurrency 0"),
])
def test_bad_server_input_is_refused_before_anything_runs(args, said, tmp_path, capsys):
    assert main(["run", "--level", "L4", "--schedule", BURST, "--out", str(tmp_path), *args]) == EXIT_USAGE
    assert said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_server_that_dies_is_its_fail_with_its_last_log_lines(servers_running, tmp_path, capsys):
    assert main(["run", "--level", "L4", "--schedule", BURST, "--server", DIES, "--out", str(tmp_path)]) == EXIT_BROKEN
    out = capsys.readouterr().out
    assert "the server died" in out and "status 3" in out and "cannot load" in out
    doc = report(tmp_path)
    (run,) = doc["results"]
    assert run["verdict"] == "FAIL" and "cannot load" in run["server"]["log"]
    assert not servers_running()


@pytest.mark.slow  # two servers on a small model
def test_a_model_directory_is_served_as_it_is(servers_running, tmp_path, capsys):
    """--model DIR: the server loads that directory, not a copy kvparity writes."""
    directory = tmp_path / "served"
    assert main(["model-dir", "qwen3_5", str(directory)]) == EXIT_OK
    args = ["run", "--level", "L4", "--model", str(directory), "--schedule", BURST, "--server", MLX_LM,
            "--prompt-cache-off", "--prompt-cache-size 0", "--out", str(tmp_path / "out")]
    assert main(args) == EXIT_OK
    (run,) = report(tmp_path / "out")["results"]
    assert run["verdict"] == "pass" and run["server"]["server starts"] == 2
    (folder,) = (tmp_path / "out").iterdir()
    for log in run["server"]["log_files"]:  # each server's log begins with its command line
        assert f"--model {directory} " in (folder / log).read_text().splitlines()[0]
    assert not servers_running()


def test_a_model_directory_whose_tokenizer_reads_no_prompt_is_not_supported_before_a_server_starts(
        servers_running, tmp_path, capsys):
    """What the issue's Qwen3.5 run met: a word-level tokenizer.json that
    transformers' Qwen2 class rebuilds from its vocabulary alone reads every
    prompt as no tokens. The run says which request and why, and starts no
    server (this one would die: a FAIL)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path / "qwen2"
    assert main(["model-dir", "qwen2", str(directory)]) == EXIT_OK
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(512)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(directory / "tokenizer.json"))
    args = ["run", "--level", "L4", "--model", str(directory), "--schedule", BURST, "--server", DIES,
            "--out", str(tmp_path / "out")]
    assert main(args) == EXIT_CANNOT_JUDGE
    (run,) = report(tmp_path / "out")["results"]
    assert run["verdict"] == "not supported" and "request 'a'" in run["reason"], run["reason"]
    assert "makes no tokens of it" in run["reason"] and not run["server"]


@pytest.mark.parametrize("model, kv, outcome, said", [
    # mlx-lm's own solo kv_bits run raises on a sliding layer: the answers have nothing to be judged against
    ("gemma3_text", ["--kv-bits", "4"], "mlx-lm defect", "RotatingKVCache Quantization NYI"),
    ("deepseek_v3", ["--kv-bits", "4"], "mlx-lm defect", "swapaxes"),
    # keys of 96: a group of 64 does not divide them
    ("minicpm3", ["--kv-bits", "4", "--kv-group-size", "64"], "not supported", "--kv-group-size 64"),
])
def test_what_mlx_lm_cannot_run_or_the_declared_settings_do_not_fit_is_said_before_a_server_starts(
        model, kv, outcome, said, servers_running, tmp_path, capsys):
    args = ["run", "--level", "L4", "--model", model, "--schedule", BURST, "--server", DIES, *kv,
            "--out", str(tmp_path)]
    assert main(args) == EXIT_CANNOT_JUDGE
    (run,) = report(tmp_path)["results"]
    assert run["verdict"] == outcome and said in run["reason"], run["reason"]
    assert not run["server"]  # the server (which dies) never started


def test_a_server_that_never_answers_cannot_be_judged(servers_running, tmp_path, capsys):
    silent = f"{sys.executable} -c \"import time; time.sleep(60)\" {{model}} {{port}}"
    args = ["run", "--level", "L4", "--schedule", BURST, "--server", silent, "--ready-timeout", "2", "--no-report"]
    assert main(args) == EXIT_CANNOT_JUDGE
    assert "2" in capsys.readouterr().err
    assert not servers_running()


@pytest.mark.slow  # mlx-lm's server started for each schedule, on two models
@pytest.mark.parametrize("kv, off", [((), ()), (("--kv-bits", "4"), ("--prompt-cache-off", "--prompt-cache-size 0"))],
                         ids=["dense", "kv-bits-4"])
def test_mlx_lm_server_passes_l4_dense_and_with_kv_bits(servers_running, kv, off, tmp_path, capsys):
    """With its prompt cache turned off (declared), one server answers every
    request alone; else a fresh server answers each conversation alone."""
    command = MLX_LM + (f" {KV}" if kv else "")
    args = ["run", "--level", "L4", "--server", command, *kv, *off, "--models", "none", "--out", str(tmp_path)]
    status = main(args)
    doc = report(tmp_path)
    assert status == EXIT_OK, unpassed_rows(doc)
    assert len(doc["results"]) >= 2 and all(r["verdict"] == "pass" for r in doc["results"])
    for run in doc["results"]:
        assert run["server"]["tokens per second"] > 0 and run["server"]["log"] and run["server"]["load seconds"] > 0
        requests = json.loads((L4_CATALOG / f"{run['schedule']}.json").read_text())["requests"].values()
        conversations = sum(1 for r in requests if "continues" not in r)
        assert run["server"]["server starts"] == (2 if off else conversations + 1), run["server"]
        assert all(row["metrics"].get("tokens compared", 0) > 0 or row["metrics"].get("text characters compared", 0) > 0
                   for row in run["rows"])
        assert any(row["metrics"]["in flight with"] > 0 for row in run["rows"])  # it was concurrent
    # the turns the server served from its prompt cache were judged from the same stored prefix
    (talk,) = [run for run in doc["results"] if run["schedule"] == "conversations"]
    prefixed = [row for row in talk["rows"] if "from the prompt cache entry of" in row["metrics"]["oracle"]]
    assert len(prefixed) >= 4 and all(row["metrics"]["prompt tokens from the server's cache"] > 0
                                      for row in prefixed)
    assert not servers_running()


def test_the_l4_catalog_runs_on_every_architecture_of_the_axis():
    """--models all: each catalog file on its own model, then on every
    architecture of the zoo, each a run of its own named by its model."""
    options = RunOptions(models=model_set("all"), server=l4_server.ServerUnderTest("serve {model} {port}"))
    runner = RUNNERS[L4]
    for schedule in runner.catalog(options):
        labels = [label for label, _ in runner.runs(schedule, options)]
        assert labels == [f"L4 {schedule.name}"] + [f"L4 {schedule.name} on {m}" for m in zoo_models()]


@pytest.mark.slow  # the catalog on two architectures, through mlx-lm's server with --kv-bits
def test_an_architecture_mlx_lm_cannot_run_quantized_is_its_named_limit_beside_a_verdict(servers_running, tmp_path,
                                                                                        capsys):
    args = ["run", "--level", "L4", "--server", f"{MLX_LM} {KV}", "--kv-bits", "4", "--prompt-cache-off",
            "--prompt-cache-size 0", "--models", "qwen3_5,gemma3_text", "--out", str(tmp_path)]
    assert main(args) == EXIT_OK
    runs = {run["schedule"]: run for run in report(tmp_path)["results"]}
    for name in ("burst", "conversations", "staggered-ms", "streamed"):
        assert runs[name]["verdict"] == runs[f"{name} on qwen3_5"]["verdict"] == "pass"
        limited = runs[f"{name} on gemma3_text"]
        assert limited["verdict"] == "mlx-lm defect" and "RotatingKVCache Quantization NYI" in limited["reason"]
    assert not servers_running()


@pytest.mark.slow  # two servers, twice
@pytest.mark.parametrize("name, status", [(None, EXIT_OK), ("ignores_kv_bits", EXIT_BROKEN)])
def test_qwen3_5_through_a_server_that_declares_kv_bits(name, status, servers_running, tmp_path, capsys):
    """The hybrid users report: mlx_lm.server --kv-bits 4 passes; a server that
    accepts --kv-bits and serves dense fails on kv_applied (it ended in 128 when
    the model directory's tokenizer read every prompt as no tokens)."""
    command = (control(name) if name else MLX_LM) + f" {KV}"
    args = ["run", "--level", "L4", "--model", "qwen3_5", "--schedule", BURST, "--server", command, "--kv-bits", "4",
            "--out", str(tmp_path)]
    assert main(args) == status
    (run,) = report(tmp_path)["results"]
    assert run["model"] == "qwen3_5" and all(row["metrics"]["tokens compared"] > 0 for row in run["rows"])
    broke = {d["check"] for row in run["rows"] for d in row["divergences"]}
    assert (KV_APPLIED in broke) == bool(name), broke
    assert not servers_running()


@pytest.mark.slow  # each control is a server started twice per schedule
@pytest.mark.parametrize("name, kv, checks, schedule", [
    ("swaps_rows", (), {ALONE}, BURST),
    ("rounds_logprobs", (), {LOGPROBS}, BURST),
    ("ignores_kv_bits", ("--kv-bits", "4"), {KV_APPLIED, TOKENS, LOGPROBS}, BURST),
    ("swaps_rows", (), {ALONE, TEXT}, STREAMED),  # streams of text: judged on the text
    ("ignores_kv_bits", ("--kv-bits", "4"), {KV_APPLIED, TEXT}, STREAMED),
    # turns served from the server's prompt cache: judged from the same stored prefix
    ("rounds_logprobs", (), {LOGPROBS}, CONVERSATIONS),
], ids=lambda v: Path(v).stem if isinstance(v, str) and v.endswith(".json") else None)
def test_each_negative_control_server_fails_naming_request_position_and_comparison(name, kv, checks, schedule,
                                                                                   servers_running, tmp_path):
    command = control(name) + (f" {KV}" if kv else "")
    args = ["run", "--level", "L4", "--schedule", schedule, "--server", command, *kv, "--out", str(tmp_path)]
    assert main(args) == EXIT_BROKEN
    (run,) = report(tmp_path)["results"]
    assert run["verdict"] == "FAIL"
    broke = {(d["check"], d["request"]) for row in run["rows"] for d in row["divergences"]}
    assert checks <= {check for check, _ in broke}, broke
    # each names the request and, where it is a token's, its position
    positioned = [d for row in run["rows"] for d in row["divergences"] if d["check"] in (ALONE, TOKENS, LOGPROBS, TEXT)]
    assert positioned and all(d["request"] and d["step"] is not None for d in positioned)
    # a turn the server served from its prompt cache fails against mlx-lm's run from the same stored prefix
    prefixed = [row for row in run["rows"] if "from the prompt cache entry of" in row["metrics"]["oracle"]]
    assert schedule != CONVERSATIONS or any(row["verdict"] == "FAIL" for row in prefixed)
    assert not servers_running()


@pytest.mark.slow  # a server started twice
def test_a_server_that_quantizes_only_requests_served_alone_is_said_to(servers_running, tmp_path):
    """With --kv-bits it answers alone as mlx-lm's kv_bits run and among
    others as the dense run: the finding says so, not that it did not quantize."""
    args = ["run", "--level", "L4", "--schedule", BURST, "--server", f"{control('quantizes_alone_only')} {KV}",
            "--kv-bits", "4", "--out", str(tmp_path)]
    assert main(args) == EXIT_BROKEN
    (run,) = report(tmp_path)["results"]
    applied = [d for row in run["rows"] for d in row["divergences"] if d["check"] == KV_APPLIED]
    assert applied and all("quantized alone, dense when batched with others" in d["detail"] for d in applied)
    assert not any("did not quantize" in d["detail"] for d in applied)
    assert not servers_running()


@pytest.mark.slow
def test_the_server_log_and_timing_are_in_the_report_and_ctrl_c_leaves_nothing(servers_running, tmp_path):
    """An interrupted run (SIGINT while the server serves) stops it."""
    import signal
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-m", "kvparity", "run", "--level", "L4", "--schedule", BURST,
                              "--server", MLX_LM, "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not servers_running() and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)
    assert servers_running(), "the server never started"
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    deadline = time.monotonic() + 15
    while servers_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers_running()
    assert child.returncode == 130


@pytest.mark.slow
def test_sigterm_to_a_run_leaves_no_server_behind(servers_running, tmp_path):
    """What a CI runner sends to cancel a job: the server goes with the run."""
    import signal
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-m", "kvparity", "run", "--level", "L4", "--schedule", BURST,
                              "--server", MLX_LM, "--no-report"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not servers_running() and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)
    assert servers_running(), "the server never started"
    os.killpg(child.pid, signal.SIGTERM)  # the whole job, as a runner cancels it
    child.wait(timeout=60)
    deadline = time.monotonic() + 15
    while servers_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers_running()


@pytest.mark.real_model
def test_mlx_lm_server_passes_l4_on_smollm2(servers_running, tmp_path, capsys):
    """The L4 catalog on the real model: its own tokenizer and chat template, its end-of-sequence token."""
    assert main(["run", "--level", "L4", "--model", "smollm2", "--schedule", BURST, "--server", MLX_LM,
                 "--out", str(tmp_path)]) == EXIT_OK
    (run,) = report(tmp_path)["results"]
    assert run["model"] == "smollm2" and run["verdict"] == "pass"
    assert all(row["metrics"]["tokens compared"] > 0 for row in run["rows"])
    assert not servers_running()


@pytest.mark.slow  # 32 requests in flight, each also served alone
def test_thirty_two_requests_in_flight(servers_running, tmp_path, capsys):
    """Sent 10 ms apart, each answering 32 tokens, all 32 are at the server together
    (3 tokens each let the first finish before the last were sent). (Connected in the
    same instant, mlx_lm.server 0.32.2 resets some: http.server's listen
    backlog is 5. Plain httpx shows it: 8 of 32 dropped, none with a backlog of 64.)"""
    requests = {f"r{i}": {"arrival": 0, "arrival_ms": 10 * i, "prompt_len": 3 + i % 7, "max_tokens": 32, "seed": i,
                          **({"endpoint": "chat"} if i % 2 else {})} for i in range(32)}
    burst = tmp_path / "burst-32.json"
    burst.write_text(json.dumps({"kind": "arrivals", "name": "burst-32", "model": "llama-h64-f32",
                                 "requests": requests}))
    args = ["run", "--level", "L4", "--schedule", str(burst), "--server", MLX_LM, "--concurrency", "32",
            "--out", str(tmp_path / "out")]
    assert main(args) == EXIT_OK
    (run,) = report(tmp_path / "out")["results"]
    assert len(run["rows"]) == 32 and max(row["metrics"]["in flight with"] for row in run["rows"]) >= 16
    assert not servers_running()
