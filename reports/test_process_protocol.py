"""A cache in another process (``--impl exec:COMMAND``): the reference served
over the process protocol is judged as in process, a control served so fails
naming the same member, and a process that exits, crashes, hangs or writes
garbage is the cache's FAIL, named, with its stderr, and is gone afterwards."""

import gc
import json
import os
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.reports import failures
from kvparity.reports.cli import EXIT_BROKEN, EXIT_OK, main
from kvparity.reports.environment import describe
from kvparity.suites.core.raised import HungEarlier, ImplementationError, ImplementationUnavailable, MemberRaised
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.l1.run import run_l1
from kvparity.suites.core.process_frame import FrameGarbage, FrameReader, encode
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

KVPARITY = Path(sys.executable).with_name("kvparity")
SERVER = f"{shlex.quote(sys.executable)} -m kvparity.suites.process_server"
REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
LEAVES = load(CATALOG / "leave-longest.json")  # filter runs at its event #2
STAYS = load(CATALOG / "join-empty.json")  # no filter

# A process that speaks the frame by hand (no MLX: it starts in milliseconds):
# its hello, then {fault} at the first request for {op}; every other request
# is answered ok with batch 1. Every process notes its pid.
SPEAKER = """\
import json, os, struct, sys, time
with open({pids!r}, "a") as pids:
    pids.write(f"{{os.getpid()}}\\n")
stdin, out = sys.stdin.buffer, sys.stdout.buffer
SIZES = {{"uint32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "float32": 4, "bool": 1}}

def send(header, after=b""):
    text = json.dumps(header).encode()
    out.write(b"KVP1" + struct.pack("<I", len(text)) + text + after)
    out.flush()

def receive():
    head = stdin.read(8)
    if len(head) < 8:
        sys.exit(0)
    header = json.loads(stdin.read(struct.unpack("<I", head[4:])[0]))
    for tensor in header.get("tensors") or []:
        size = SIZES[tensor["dtype"]]
        for n in tensor["shape"]:
            size *= n
        stdin.read(size)
    return header

{before_hello}
send({{"id": 0, "ok": True, "op": "hello", "result": {{"protocol": 1, "name": "speaker", "language": "python"}}}})
while True:
    request = receive()
    if request["op"] == {op!r}:
        {fault}
    send({{"id": request["id"], "ok": True, "result": {{"batch": 1}}}})
"""
# The reference served, with a fault when a member runs.
FAULTY_SERVER = """\
import os, sys, time
with open({pids!r}, "a") as pids:
    pids.write(f"{{os.getpid()}}\\n")
from kvparity.suites import process_server
answer = process_server.Server.answer

def faulty(self, op, args, tensors):
    if op == {op!r}:
        {fault}
    return answer(self, op, args, tensors)

process_server.Server.answer = faulty
serve = process_server.serve


def serving(spec, stdin, stdout):  # PIPE: the pipe to kvparity (the server sends stdout's prints to stderr)
    global PIPE
    PIPE = stdout
    return serve(spec, stdin, stdout)


process_server.serve = serving
sys.exit(process_server.main([{spec!r}]))
"""


def write_speaker(tmp_path, fault, op="merge", before_hello=""):
    script = tmp_path / "speaker.py"
    script.write_text(SPEAKER.format(pids=str(tmp_path / "pids"), op=op, fault=fault, before_hello=before_hello))
    return f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def write_faulty_server(tmp_path, op, fault, spec=REFERENCE):
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY_SERVER.format(pids=str(tmp_path / "pids"), op=op, fault=fault, spec=spec))
    return f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def left_running(tmp_path):
    """The processes the test's cache commands started that are still there."""
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert pids, "no cache process was started"
    deadline = time.monotonic() + 2  # a process killed a moment ago may not be reaped yet
    while True:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in status_of(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def status_of(pid):
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.fixture
def member_timeout():
    before, hung = FLIGHT.timeout, FLIGHT.hung
    FLIGHT.limit(1.0)
    FLIGHT.hung = {}
    yield 1.0
    FLIGHT.limit(before)
    FLIGHT.hung = hung


# -- the frame -----------------------------------------------------------------------------


def test_a_frame_is_magic_length_json_then_the_raw_bytes_in_order():
    frame = encode({"id": 7, "op": "x"}, [("a", mx.array([1, 2], dtype=mx.uint32)),
                                           ("b", mx.array([1.5], dtype=mx.bfloat16))])
    text = b'{"id":7,"op":"x","tensors":[{"name":"a","dtype":"uint32","shape":[2]},' \
           b'{"name":"b","dtype":"bfloat16","shape":[1]}]}'
    assert frame == b"KVP1" + struct.pack("<I", len(text)) + text + b"\1\0\0\0\2\0\0\0" + b"\xc0\x3f"
    read, write = os.pipe()
    os.write(write, frame + b"debug: hello\n")
    os.close(write)
    reader = FrameReader(read)
    header, tensors = reader.read()
    assert header["id"] == 7 and tensors["a"].tolist() == [1, 2] and tensors["b"].dtype == mx.bfloat16
    assert tensors["b"].item() == 1.5
    with pytest.raises(FrameGarbage, match=r"does not start with KVP1\): b'debug: hello\\n'"):
        reader.read()
    os.close(read)


# -- the reference and a control through the Python server -------------------------------------


def test_the_reference_served_over_the_protocol_passes_as_in_process(judged):
    served, inside = load_implementation(f"exec:{SERVER} {REFERENCE}"), load_implementation(REFERENCE)
    assert served.batch_class.hello["language"] == "python" and served.supports("per_row_rollback")
    for name in ("leave-longest", "rollback-uneven", "extract-decode-reinsert"):
        schedule = load(CATALOG / f"{name}.json")
        result = run_l1(schedule, served)
        assert judged(result).verdict == PASS, result.reason
        # The same comparisons, row by row and check by check, as the class in process gets.
        compared = {row.request: row.counts for row in result.rows}
        assert compared == {row.request: row.counts for row in run_l1(schedule, inside).rows}
        assert sum(row.compared() for row in result.rows) > 0
    # Every member crossed the pipe and was counted on the proxy class, as on any class.
    assert {"merge", "extend", "filter", "extract", "update_and_fetch", "make_mask", "rollback", "size",
            "state"} <= set(served.calls)


def test_a_control_served_over_the_protocol_fails_naming_the_same_member(judged):
    control = "kvparity.impl.negative_controls:FilterSharedPaddingOffByOne"
    member = {}
    for spec in (control, f"exec:{SERVER} {control}"):
        impl = load_implementation(spec)
        results = [judged(run_l1(LEAVES, impl))]
        groups = failures.group(results, {"impl": spec})
        assert [r.verdict for r in results] == [FAIL], [r.evidence.reason for r in results]
        member[spec] = [(g.member, g.at_fault, g.check, g.tensor) for g in groups]
    (inside, served) = member.values()
    assert inside == served == [("filter", "filter", "bytes", "keys.packed")]


# -- a process that fails ---------------------------------------------------------------------------


def failed(result, judged, member):
    assert judged(result).verdict == FAIL and result.raised_by == member, result.reason
    return result.reason


def test_a_process_that_exits_before_its_hello_fails_every_run_at_merge(tmp_path, judged):
    spec = write_speaker(tmp_path, "pass", before_hello="sys.stderr.write('cannot open cache.bin\\n'); sys.exit(3)")
    impl = load_implementation(spec)  # not a usage error: the runs are the cache's FAILs
    reason = failed(run_l1(STAYS, impl), judged, "merge")
    impl.batch_class._processes.stop()  # the one started again after it, as kvparity's exit does
    assert ("merge raised ProcessDied: the cache process exited with status 3 before its hello; "
            "its stderr was: 'cannot open cache.bin'") in reason
    assert not left_running(tmp_path)


def test_garbage_on_the_pipe_is_the_member_s_fail_and_the_process_is_stopped(tmp_path, judged):
    spec = write_speaker(tmp_path, "print('merging 2 rows', flush=True); time.sleep(60)")
    impl = load_implementation(spec)
    reason = failed(run_l1(STAYS, impl), judged, "merge")
    impl.batch_class._processes.stop()
    # what was seen is what one read got: the newline may come in a read of its own
    assert ("merge raised ProcessGarbage: garbage on stdout after merge: no frame (it does not start with "
            "KVP1): b'merging 2 rows") in reason and "; it wrote nothing on stderr" in reason
    assert not left_running(tmp_path)


def test_an_error_answering_free_says_so_from_the_member_it_came_before(tmp_path):
    spec = write_speaker(tmp_path, "send({'id': request['id'], 'ok': False, 'error': {'type': 'ValueError', "
                         "'message': 'no batch 1'}}); continue", op="free")
    impl = load_implementation(spec)
    with impl.watching():
        dropped = impl.batch_class.merge([QuantizedKVCache(group_size=64, bits=4)])
        kept = impl.batch_class.merge([QuantizedKVCache(group_size=64, bits=4)])
        del dropped
        gc.collect()
        with pytest.raises(MemberRaised) as raised:
            kept.filter([0])
    assert raised.value.member == "filter" and isinstance(raised.value.error, ValueError)
    assert str(raised.value.error) == "free of batches [1], sent before filter, raised: no batch 1"
    impl.batch_class._processes.stop()
    assert not left_running(tmp_path)


def test_bytes_after_an_answer_are_garbage_of_the_member_answered(tmp_path, judged):
    # In one write with the answer: what comes later is found after the next request, and is said so.
    spec = write_speaker(tmp_path, "send({'id': request['id'], 'ok': True, 'result': {'batch': 1}}, b'merged\\n'); "
                         "time.sleep(60)")
    impl = load_implementation(spec)
    reason = failed(run_l1(STAYS, impl), judged, "merge")
    impl.batch_class._processes.stop()
    assert "merge raised ProcessGarbage: garbage on stdout after merge: bytes after its answer: b'merged\\n'" in reason
    assert not left_running(tmp_path)


def test_a_process_that_hangs_is_stopped_at_the_member_timeout(tmp_path, judged, member_timeout):
    spec = write_speaker(tmp_path, "sys.stderr.write('waiting for a lock\\n'); sys.stderr.flush(); time.sleep(60)")
    impl, started = load_implementation(spec), time.monotonic()
    reason = failed(run_l1(STAYS, impl), judged, "merge")
    impl.batch_class._processes.stop()
    assert time.monotonic() - started < 10
    assert ("merge raised MemberHung: the cache process did not answer merge within 1 s "
            "(--member-timeout); it was stopped; its stderr was: 'waiting for a lock'") in reason
    assert not left_running(tmp_path)


def test_a_member_a_process_hung_in_is_not_waited_on_again(tmp_path, member_timeout):
    """After filter hung once (the process stopped: the member's FAIL), a later
    call of filter in the run raises HungEarlier at once, which stops the
    schedule run calling it as not judged: a hung cache process costs one
    timeout for the whole run, as a member hung in an isolated child does."""
    spec = write_speaker(tmp_path, "time.sleep(60)", op="filter")
    impl = load_implementation(spec)
    FLIGHT.run("L1 leave-longest")
    with impl.watching():
        batch = impl.batch_class.merge([QuantizedKVCache(group_size=64, bits=4)])
        with pytest.raises(MemberRaised, match="filter raised MemberHung: the cache process did not answer filter"):
            batch.filter([0])
        started = time.monotonic()
        again = impl.batch_class.merge([QuantizedKVCache(group_size=64, bits=4)])  # the process started again
        with pytest.raises(HungEarlier) as skipped:
            again.filter([0])
        assert time.monotonic() - started < 1  # no second wait of the 1 s timeout
    assert str(skipped.value) == "calls filter, which hung in L1 leave-longest after 1 s (--member-timeout): not called again"
    assert impl.calls["filter"] == 1
    impl.batch_class._processes.stop()
    assert not left_running(tmp_path)


def test_a_process_that_exits_during_a_member_fails_naming_it_and_is_gone(tmp_path):
    spec = write_speaker(tmp_path, "sys.stderr.write('filter: out of memory\\n'); sys.exit(3)", op="filter")
    impl = load_implementation(spec)
    with impl.watching():
        batch = impl.batch_class.merge([QuantizedKVCache(group_size=64, bits=4)])
        with pytest.raises(MemberRaised) as raised:
            batch.filter([0])
        assert raised.value.member == "filter" and str(raised.value.error) == (
            "the cache process exited with status 3 during filter; its stderr was: 'filter: out of memory'")
        with pytest.raises(MemberRaised, match="size raised ProcessDied: the cache process is gone "
                           r"\(it exited with status 3 during filter\), so size cannot run"):
            batch.size()  # a batch of a process that ended
    assert impl.calls["filter"] == 1
    impl.batch_class._processes.stop()  # the one started again after it, as kvparity's exit does
    assert not left_running(tmp_path)


# -- the command line: exit 1, nothing left behind ----------------------------------------------------


@pytest.mark.parametrize("fault, said", [
    pytest.param("os._exit(3)", "filter raised ProcessDied: the cache process exited with status 3 during filter",
                 id="exit", marks=pytest.mark.slow),
    pytest.param("os.abort()", "filter raised ProcessDied: the cache process died of SIGABRT (6) during filter",
                 id="crash", marks=pytest.mark.slow),
    pytest.param("time.sleep(10**6)", "filter raised MemberHung: the cache process did not answer filter "
                 "within 4 s (--member-timeout); it was stopped", id="hang", marks=pytest.mark.slow),
    pytest.param("os.write(PIPE, b'\\x00' * 16); time.sleep(60)", "filter raised ProcessGarbage: garbage on stdout "
                 "after filter: no frame (it does not start with KVP1): b'\\x00\\x00", id="garbage",
                 marks=pytest.mark.slow),
])
def test_kvparity_check_fails_a_cache_process_that_breaks_and_leaves_none_running(tmp_path, fault, said):
    timeout = "4" if "sleep(10**6)" in fault else "30"  # a server's first member call warms MLX up
    spec = write_faulty_server(tmp_path, "filter", fault)
    done = subprocess.run([str(KVPARITY), "check", "--impl", spec, "--level", "L1", "--member-timeout", timeout,
                           # join-empty first: the command started again after the fault has a member timeout
                           # to start in, and a Python server's start (MLX, mlx-lm) may take longer than 4 s
                           "--schedule", str(CATALOG / "join-empty.json"), "--schedule",
                           str(CATALOG / "leave-longest.json"), "--out", "out"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert said in done.stdout and "1 passed, 1 failed (2 schedule runs)" in done.stdout, done.stdout
    (report,) = (tmp_path / "out").glob("*/report.json")
    results = {r["schedule"]: r for r in json.loads(report.read_text())["results"]}
    assert results["leave-longest"]["raised_by"] == "filter" and said in results["leave-longest"]["reason"]
    assert not left_running(tmp_path)


@pytest.mark.slow
def test_the_whole_l1_catalog_served_over_the_protocol_is_judged_as_in_process(tmp_path):
    """The reference through the Python server gets the same verdict, the same
    comparisons row by row and the same member calls on every schedule run of
    the L1 catalog as in process (86 runs, 20,283 member calls; 12 s and 40 s
    on an idle 2-core machine, 25 s and 67 s under load)."""
    runs = {}
    for spec in (REFERENCE, f"exec:{SERVER} {REFERENCE}"):
        out = tmp_path / str(len(runs))
        done = subprocess.run([str(KVPARITY), "check", "--impl", spec, "--level", "L1", "--out", str(out)],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == EXIT_OK, done.stdout + done.stderr
        (report,) = out.glob("*/report.json")
        runs[spec] = {(r["schedule"], r["level"], r["model"]): (r["verdict"], r["rows"], r["members"])
                      for r in json.loads(report.read_text())["results"]}
    inside, served = runs.values()
    assert inside == served and len(inside) >= len(catalog_paths("L1"))


def test_a_command_that_cannot_start_cannot_be_judged_here_and_a_malformed_one_is_a_usage_error():
    with pytest.raises(ImplementationUnavailable, match="cannot start /nonexistent/cache: .*No such file"):
        load_implementation("exec:/nonexistent/cache --bits 4")
    for spec, said in (("exec:", "no command after 'exec:'"), ("exec:'unbalanced", "No closing quotation")):
        with pytest.raises(ImplementationError, match=said) as refused:
            load_implementation(spec)
        assert not isinstance(refused.value, ImplementationUnavailable)


def test_the_report_names_the_language_and_the_cache_the_hello_gave(tmp_path):
    impl = load_implementation(write_speaker(tmp_path, "pass"))
    env = describe(impl)
    assert (env["implementation_language"], env["implementation_package"]) == ("python", "speaker")
    assert load_implementation(REFERENCE).language == "python" and load_implementation(REFERENCE).process is None
    impl.batch_class._processes.stop()
    assert not left_running(tmp_path)


@pytest.mark.slow
def test_bisect_through_the_protocol_names_the_member_and_a_replay_command_that_parses(tmp_path, capsys):
    """kvparity bisect shrinks a control served over the protocol (about 40 s
    under load: 159 tries) and names filter; the replay command it prints
    keeps the command as one word (it printed ``--impl exec:python -m ...``)."""
    spec = f"exec:{SERVER} kvparity.impl.negative_controls:FilterSharedPaddingOffByOne"
    out = tmp_path / "min.json"
    assert main(["bisect", str(CATALOG / "leave-longest.json"), "--level", "L1", "--impl", spec,
                 "--out", str(out)]) == EXIT_BROKEN
    printed = capsys.readouterr().out
    assert "member at fault: filter" in printed, printed
    replay = shlex.split(printed.split("replay with: ")[1].splitlines()[0])
    assert replay[:3] == ["kvparity", "replay", str(out)] and replay[replay.index("--impl") + 1] == spec
    assert main(replay[1:]) == EXIT_BROKEN
