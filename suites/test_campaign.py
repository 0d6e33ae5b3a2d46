"""Fuzz campaigns: worker processes sharing an example database, so that a
failure one worker found is the first thing a later run replays. The
several-machine mode runs against a real Redis server started here."""

import functools
import multiprocessing
import os
import re
import signal
import shutil
import socket
import subprocess
import time

import pytest

from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import judge
from kvparity.suites.search.database import REDIS_PREFIX, DatabaseError, DatabaseUnavailable, check_database, fallible, database_key, open_database
from kvparity.suites.search.campaign import Campaign, CampaignResult, Tally
from kvparity.suites.search.supervisor import replace_dead, run_campaign
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.search.fuzz import ScheduleFailed, found_in

CONTROL = "kvparity.impl.negative_controls:TrimForgetsOffset"
REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"


def cpu_judge():
    return functools.partial(judge, policy=load_policy("cpu"))


# -- cheap: what a campaign is made of -------------------------------------------------


def test_a_directory_database_and_none(tmp_path):
    assert open_database(None) is None
    assert type(open_database(str(tmp_path / "db"))).__name__ == "DirectoryBasedExampleDatabase"


@pytest.mark.parametrize("spec, message", [("ftp://host/db", "a directory or redis://"),
                                           ("FILE", "not a directory")])
def test_a_database_that_cannot_be_one_is_refused_naming_it(spec, message, tmp_path):
    (tmp_path / "FILE").write_text("")
    spec = spec.replace("FILE", str(tmp_path / "FILE"))
    with pytest.raises(DatabaseError, match=message) as error:
        open_database(spec)
    assert spec in str(error.value)


def test_a_redis_server_that_does_not_answer_cannot_be_used_here():
    # Without the redis package the same URL is unavailable too, saying what to install.
    with pytest.raises(DatabaseUnavailable, match="redis://127.0.0.1:1"):
        check_database("redis://127.0.0.1:1")


def test_examples_are_shared_out_over_the_workers():
    campaign = Campaign(REFERENCE, judge=None, workers=3, examples=7)
    assert [campaign.share(w) for w in range(3)] == [3, 2, 2]
    assert Campaign(REFERENCE, judge=None, workers=2, seconds=1).share(0) is None


def test_each_level_and_implementation_keeps_its_own_examples():
    keys = {database_key(level, impl) for level in ("L1", "L2") for impl in (REFERENCE, CONTROL)}
    assert len(keys) == 4


def test_every_failure_in_a_group_is_found_and_nothing_else():
    one, two = ScheduleFailed("a", {"name": "a"}), ScheduleFailed("b", {"name": "b"})
    group = BaseExceptionGroup("two", [one, ExceptionGroup("inner", [two])])
    assert found_in(group, ScheduleFailed) == [one, two]
    assert found_in(ValueError("harness"), ScheduleFailed) == []


def test_the_campaigns_rate_adds_up_its_workers_rates():
    result = CampaignResult(None, {0: Tally(schedules=30, seconds=10.0), 1: Tally(schedules=20, seconds=5.0),
                                   2: Tally()}, [], 10.0)
    assert result.schedules == 50 and result.schedules_per_second == 7.0
    assert result.first_failure_s is None


def test_a_dead_worker_is_noted_and_replaced_for_what_it_had_left():
    campaign = Campaign(REFERENCE, cpu_judge(), workers=2, examples=100)
    result = CampaignResult(campaign, {0: Tally(schedules=30), 1: Tally(schedules=12)}, [], 4.0)
    assert replace_dead(campaign, result, 0, -9, 2, 4.0, False) == (2, (20, None))
    assert result.lost == ["worker 0 died (SIGKILL (9)) after 30 generated schedules; what it judged up to its "
                           "last report is kept, the schedules it was running are lost; worker 2 took its place"]
    timed = Campaign(REFERENCE, cpu_judge(), workers=1, seconds=60.0)
    assert replace_dead(timed, result, 1, -11, 1, 45.0, False) == (1, (None, 15.0))
    # one replacement per worker the campaign started with, none once it stops or its share is done
    assert replace_dead(timed, result, 1, -11, 2, 45.0, False) is None
    assert replace_dead(campaign, result, 1, -11, 2, 4.0, True) is None
    assert result.lost[-1].endswith("; not replaced")


# -- workers on several machines: a real Redis server -----------------------------------


@pytest.fixture
def redis_url(redis_server):
    return redis_server[0]


@pytest.fixture
def redis_server(tmp_path):
    """A Redis server of this test's own on a free port, its data in
    tmp_path: (its URL, its process)."""
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'kvparity[redis]')")
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (CI installs it: .ci/run)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(tmp_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):  # until it answers: a readiness wait, not a timing
            try:
                check_database(url)
                break
            except DatabaseUnavailable:
                if process.poll() is not None:
                    pytest.skip(f"redis-server could not start (exit {process.returncode})")
                time.sleep(0.1)
        else:
            pytest.skip("redis-server did not answer in 10 s")
        yield url, process
    finally:
        process.terminate()
        process.wait()


@pytest.mark.slow
def test_a_failure_one_campaign_found_is_replayed_first_by_the_next_through_redis(redis_url, tmp_path):
    """Two workers find a control's failure and save it in Redis; a second
    campaign of two new workers (new seeds, one example each, no shrinking)
    fails on its first schedule, both workers: the database's example,
    replayed before any generated one."""
    first = run_campaign(Campaign(CONTROL, cpu_judge(), workers=2, examples=400, database=redis_url, seed=1,
                                  found_dir=str(tmp_path / "first")))
    assert first.found, f"the control was not caught in {first.schedules} schedules"
    assert {f.doc["name"] for f in first.found} == {"found-L1-TrimForgetsOffset"}
    stored = open_database(redis_url).redis.keys(REDIS_PREFIX + b"*")
    assert stored, "nothing was saved in Redis"

    second = run_campaign(Campaign(CONTROL, cpu_judge(), workers=2, examples=2, database=redis_url, seed=2,
                                   found_dir=str(tmp_path / "second"), shrink=False))
    assert sorted(f.worker for f in second.found) == [0, 1]
    passed = sum(t.outcomes.get(PASS, 0) for t in second.tallies.values())
    assert passed == 0, "a generated schedule ran before the stored failure"
    assert all(": FAIL: offset:" in f.message for f in second.found), [f.message for f in second.found]

    # The reference's campaign on the same server has a key of its own: nothing of the control's replays.
    reference = run_campaign(Campaign(REFERENCE, cpu_judge(), workers=1, examples=5, database=redis_url,
                                      found_dir=str(tmp_path / "reference")))
    assert not reference.found and reference.rows_passed > 0
    assert FAIL not in reference.tallies[0].outcomes


@pytest.mark.slow
def test_a_worker_killed_from_outside_is_replaced_and_the_campaign_keeps_the_evidence(tmp_path):
    """kill -9 of a worker, as the out-of-memory killer does: the campaign
    names it, keeps what it reported, starts another in its place and ends
    with its verdict."""
    killed = []

    def kill_one(result):
        workers = [p for p in multiprocessing.active_children() if p.is_alive()]
        if not killed and result.tallies[0].schedules > 0 and workers:
            killed.append(min(workers, key=lambda p: p.name).pid)
            os.kill(killed[0], signal.SIGKILL)

    result = run_campaign(Campaign(REFERENCE, cpu_judge(), workers=2, seconds=20.0, found_dir=str(tmp_path)),
                          on_progress=kill_one, progress_s=1.0)
    assert killed, "no worker was killed: the campaign ended first"
    assert not result.found and result.rows_passed > 0
    (lost,) = result.lost
    assert lost.startswith("worker ") and " died (SIGKILL (9)) after " in lost and lost.endswith("took its place")
    assert result.tallies[2].schedules > 0, "the replacement generated nothing"


# -- an example database that goes away ------------------------------------------------


class GoneDatabase:
    """A database whose server stopped after ``calls`` calls."""

    def __init__(self, calls):
        self.calls, self.saved = calls, []

    def _use(self):
        self.calls -= 1
        if self.calls < 0:
            raise ConnectionError("Connection refused")

    def fetch(self, key):
        self._use()
        return iter(self.saved)

    def save(self, key, value):
        self._use()
        self.saved.append(value)

    def delete(self, key, value):
        self._use()

    def move(self, src, dest, value):
        self._use()


def test_a_database_that_goes_away_is_reported_once_and_the_worker_goes_on_in_memory():
    heard, shared = [], GoneDatabase(calls=2)
    database = fallible(shared, "redis://db:6379", heard.append)
    database.save(b"k", b"first")
    assert list(database.fetch(b"k")) == [b"first"] and not heard
    database.save(b"k", b"second")  # the server is gone from here on
    database.save(b"k", b"third")
    assert sorted(database.fetch(b"k")) == [b"second", b"third"], "the examples from the loss on are in memory"
    assert shared.saved == [b"first"]
    (said,) = heard
    assert said.startswith("the example database redis://db:6379 went away (ConnectionError: Connection refused)")


@pytest.mark.slow
def test_a_campaign_whose_redis_server_stops_finishes_on_what_it_has(redis_server, tmp_path):
    """The shared Redis server is stopped while two workers generate: each
    worker says the database went away, goes on in memory, and the
    campaign ends with its verdict (never a harness error)."""
    url, server = redis_server

    def stop_the_server(result):
        if server.poll() is None and result.schedules > 0:
            server.kill()
            server.wait()

    result = run_campaign(Campaign(REFERENCE, cpu_judge(), workers=2, seconds=15.0, database=url,
                                   found_dir=str(tmp_path)), on_progress=stop_the_server, progress_s=1.0)
    assert server.poll() is not None, "the server was not stopped: the campaign ended first"
    assert not result.found and not result.lost and result.rows_passed > 0
    assert result.database_lost, "nobody said the database went away"
    for said in result.database_lost:
        assert re.match(rf"worker \d: the example database {re.escape(url)} went away \(ConnectionError: ", said), said
