"""The oracle cache under concurrent writers (``pytest -n``, two CI jobs on
one cache): several processes, started at once, compute and store the same
and different solo traces into one cache directory. Every entry ends
complete and readable, holding the bytes every process computed; no reader
(nor the test, watching the directory) ever meets a half-written entry; none is lost (a second pass computes
nothing); no staging directory is left behind.

Run as a script, this file is one of those processes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WRITERS = 4
SHARED = (12, 13)  # prompt lengths every writer stores
MODEL = "llama-h64-bf16"


def schedule_of(prompt_len):
    from kvparity.suites.core.loading import parse

    return parse({
        "name": f"writers-{prompt_len}",
        "levels": ["L2"],
        "kv": {"bits": 4, "group_size": 64},
        "requests": {"a": {"prompt_len": prompt_len, "quantized_kv_start": 0, "prefill_step_size": 5}},
        "events": [{"join": ["a"]}, {"step": 3}],
    })


def prompt_lengths(writer: int):
    """The shared ones and one of its own, in an order of its own."""
    lengths = [*SHARED, 20 + writer]
    return lengths[writer % 3:] + lengths[:writer % 3]


def trace_digest(trace) -> str:
    from kvparity.oracle.arrays import digest

    logits = [call.logits for call in trace.calls if call.logits is not None]
    cache = [x for layers in trace.snapshots.values() for arrays in layers for x in arrays.values()]
    return digest(logits + cache)


def wait_for(path: Path):
    while not path.exists():
        time.sleep(0.01)


def writer(index: int, rendezvous: Path):
    """Two passes of ``cached_solo`` over this writer's prompts, each started
    when every writer is ready; writes what each call did and saw."""
    from kvparity.oracle import trace as trace_module
    from kvparity.oracle.models import load_model
    from kvparity.oracle.sealed import LEDGER
    from kvparity.oracle.solo import run_solo

    model = load_model(MODEL)
    damaged = LEDGER.dropped  # every entry this process met that did not prove whole
    calls = []
    for run_pass in (1, 2):
        (rendezvous / f"ready-{run_pass}-{index}").touch()
        wait_for(rendezvous / f"go-{run_pass}")
        for prompt_len in prompt_lengths(index):
            schedule, computed = schedule_of(prompt_len), []

            def run():
                computed.append(True)
                return run_solo(model.model, schedule, "a", model.vocab_size)

            trace = trace_module.cached_solo(run, schedule, "a", model)
            calls.append({"pass": run_pass, "key": trace_module.request_key(schedule, "a", model),
                          "computed": bool(computed), "digest": trace_digest(trace)})
    (rendezvous / f"done-{index}.json").write_text(json.dumps({"calls": calls, "damaged": damaged}))


def start_together(rendezvous: Path, processes, run_pass: int, watch=lambda: None):
    """Once every writer is ready for ``run_pass``, start it; ``watch()`` meanwhile."""
    for index, process in enumerate(processes):
        while not (rendezvous / f"ready-{run_pass}-{index}").exists():
            assert process.poll() is None, f"writer {index} exited {process.returncode} before pass {run_pass}"
            watch()
            time.sleep(0.0005)
    (rendezvous / f"go-{run_pass}").touch()


def entry_states(cache: Path, seen: set):
    """Adds the set of file names each entry in ``cache`` holds now."""
    for entry in cache.glob("[!.]*") if cache.exists() else ():
        try:
            seen.add(frozenset(p.name for p in entry.iterdir()))
        except FileNotFoundError:
            pass


@pytest.mark.slow  # four processes, each importing mlx-lm
def test_concurrent_writers_leave_every_entry_complete_and_none_lost(tmp_path):
    from kvparity.oracle.atomic import STAGING
    from kvparity.oracle.trace import load_trace

    cache, rendezvous = tmp_path / "oracle", tmp_path / "rendezvous"
    rendezvous.mkdir()
    env = {**os.environ, "KVPARITY_ORACLE_CACHE": str(cache)}
    processes = [subprocess.Popen([sys.executable, __file__, str(i), str(rendezvous)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(WRITERS)]
    try:
        seen = set()  # what the entries held while the first pass wrote them
        start_together(rendezvous, processes, 1)
        # The second pass starts when every first pass has stored what it computed.
        start_together(rendezvous, processes, 2, watch=lambda: entry_states(cache, seen))
        for process in processes:
            output = process.communicate(timeout=300)[0]
            assert process.returncode == 0, output[-3000:]
    finally:
        for process in processes:
            process.kill()
            process.wait()

    # Never seen with only some of its files (an entry is claimed empty for an instant, then filled at once).
    assert seen <= {frozenset(), frozenset({"manifest.json", "trace.safetensors", "seal.json"})}, seen
    reports = [json.loads((rendezvous / f"done-{i}.json").read_text()) for i in range(WRITERS)]
    assert [r["damaged"] for r in reports] == [[]] * WRITERS  # no reader met a half-written entry
    calls = [call for report in reports for call in report["calls"]]
    digests = {}
    for call in calls:
        digests.setdefault(call["key"], set()).add(call["digest"])
    assert len(digests) == len(SHARED) + WRITERS
    assert all(len(seen) == 1 for seen in digests.values()), digests  # one trace per key, whoever computed it
    assert [call for call in calls if call["pass"] == 2 and call["computed"]] == []  # nothing stored was lost
    assert sum(call["computed"] for call in calls) >= len(digests)

    assert sorted(p.name for p in cache.iterdir()) == sorted(digests)  # no staging left, nothing else
    assert not list(cache.glob(STAGING + "*"))
    for key, (expected,) in digests.items():
        assert trace_digest(load_trace(cache / key)) == expected  # complete, readable, the bytes computed


def test_a_dropped_entry_goes_at_once_and_dropping_it_twice_is_no_error(tmp_path):
    from kvparity.oracle.sealed import drop_entry

    entry = tmp_path / "key"
    entry.mkdir()
    (entry / "manifest.json").write_text("{}")
    drop_entry(entry)
    drop_entry(entry)  # another process dropped it first
    drop_entry(tmp_path / "no-cache-yet" / "key")
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    writer(int(sys.argv[1]), Path(sys.argv[2]))
