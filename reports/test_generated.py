"""The generated budget of kvparity run and check (``reports/commands/generated.py``):
derandomized, on by default, off with 0, and able to fail on bugs the
catalog misses, each failure joining the catalog's group of its member."""

import json
import queue
import time
from pathlib import Path

import pytest

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.reports.cli import main
from kvparity.reports.documents import check_schema
from kvparity.reports.commands.base import UsageError
from kvparity.reports.commands.generated import DEFAULT_GENERATED, budget_of, seed_of
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_OK, judge
from kvparity.reports.report_json import SCHEMA_PATH
from kvparity.reports.test_settings import settings_for
from kvparity.suites.search.campaign import Campaign
from kvparity.suites.search.workers import fixed_rounds, prepare
from kvparity.suites.core.evidence import FAIL
from kvparity.suites.format.schedule import catalog_paths

HERE = f"{__name__}"
CATALOG = Path(__file__).resolve().parents[1] / "suites" / "catalog"
CATALOG_FILE = str(CATALOG / "bits-4.json")  # one file of the catalog: it passes both bugs below


# -- one-line bugs at a boundary, written for this test (the catalog passes both) ----------


class PrepareRightPaddingPastOne(BatchQuantizedKVCache):
    """prepare records the right padding only when the longest gap is more
    than one token: a row one token shorter than the longest keeps the
    wrong offset after finalize."""

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if right_padding is not None and max(right_padding) <= 1:
            right_padding = None
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)


class FilterSharedPaddingFromTwo(BatchQuantizedKVCache):
    """filter drops the padding every survivor shares only when it is two
    columns or more."""

    def filter(self, batch_indices):
        self._filtering = True
        try:
            super().filter(batch_indices)
        finally:
            self._filtering = False

    def _drop_shared_padding(self):
        if getattr(self, "_filtering", False) and min(self.left_padding.tolist(), default=0) < 2:
            return
        super()._drop_shared_padding()


# -- how many, and when ---------------------------------------------------------------------


def args_of(tmp_path, monkeypatch, **given):
    """A check's settings as resolved from the command line ``given`` (option -> value) and a
    pyproject.toml in ``tmp_path``."""
    argv = ["check", "--impl", "kvparity.impl.batch_quantized:BatchQuantizedKVCache"]
    return settings_for(tmp_path, monkeypatch, *argv, *(f"--{option}={value}" for option, value in given.items()))


def test_the_budget_is_on_by_default_off_with_0_and_read_from_the_table(tmp_path, monkeypatch):
    assert budget_of(args_of(tmp_path, monkeypatch)) == DEFAULT_GENERATED
    assert budget_of(args_of(tmp_path, monkeypatch, generated="0")) == 0
    assert budget_of(args_of(tmp_path, monkeypatch, generated="37")) == 37
    # Levels without L1, a shard: none; schedule files of one's own: none unless the command line asks.
    assert budget_of(args_of(tmp_path, monkeypatch, level="L2")) == 0
    assert budget_of(args_of(tmp_path, monkeypatch, shard="1/2")) == 0
    assert budget_of(args_of(tmp_path, monkeypatch), files=["mine.json"]) == 0
    assert budget_of(args_of(tmp_path, monkeypatch, generated="5"), files=["mine.json"]) == 5
    (tmp_path / "pyproject.toml").write_text("[tool.kvparity]\ngenerated = 12\n")
    assert budget_of(args_of(tmp_path, monkeypatch)) == 12
    assert budget_of(args_of(tmp_path, monkeypatch), files=["mine.json"]) == 0
    (tmp_path / "pyproject.toml").write_text("[tool.kvparity]\ngenerated = \"many\"\n")
    with pytest.raises(UsageError, match=r"pyproject.toml: \[tool.kvparity\] generated 'many': expected a whole"):
        budget_of(args_of(tmp_path, monkeypatch))
    with pytest.raises(UsageError, match="--generated '-3': expected a whole number"):
        budget_of(args_of(tmp_path, monkeypatch, generated="-3"))


def test_the_seed_is_made_of_the_version_and_the_budget():
    assert seed_of(200) == seed_of(200) != seed_of(201)


def test_two_runs_of_a_budget_generate_the_same_schedules(tmp_path):
    """The gate's worker (a fixed campaign's round, here in this process)
    generates the same schedules every time, by their sha256, and so
    reaches the same cells; another seed generates others."""
    def generated(seed):
        campaign = Campaign(implementation="kvparity.impl.batch_quantized:BatchQuantizedKVCache", examples=8,
                            seed=seed, judge=_cpu_judge, found_dir=str(tmp_path), fixed=True, reach=True)
        machine, round_settings = prepare(campaign, 0, print)
        machine.judge.machine, machine.judge.start = machine, time.perf_counter()  # as a worker sets them
        messages = queue.Queue()
        fixed_rounds(campaign, 0, machine, round_settings, messages, campaign.examples, time.perf_counter())
        return drained(messages)[-1]

    first, again, other = generated(1), generated(1), generated(2)
    assert first.rows_passed > 0 and first.schedules >= 8
    assert (first.digest, first.cells, first.values, first.schedules) == (again.digest, again.cells, again.values,
                                                                          again.schedules)
    assert first.values, "the generated schedules reached no value cell of the coverage model"
    assert first.digest != other.digest


def drained(messages, kinds=("tally",)) -> list:
    """What a worker sent, of these kinds."""
    out = []
    while not messages.empty():
        kind, _, payload = messages.get_nowait()
        assert kind in kinds, (kind, payload)
        out.append(payload)
    return out


@pytest.mark.slow  # a failure found, then replayed: 2 to 9 s on 2 cores at a load of 12 to 24
def test_a_failure_saved_in_the_database_is_tried_first_next_time(tmp_path):
    """A budget that found a failure saved it in the example database; the
    next budget, of one generated schedule that alone finds nothing, replays
    it first and finds it again."""
    def found(examples, seed, database):
        campaign = Campaign(implementation=f"{HERE}:PrepareRightPaddingPastOne", examples=examples, seed=seed,
                            judge=_cpu_judge, found_dir=str(tmp_path / "found"), fixed=True, database=database,
                            shrink=False)  # what Hypothesis saves is the failure as found: shrinking it is not tested here
        machine, round_settings = prepare(campaign, 0, print)
        machine.judge.machine, machine.judge.start = machine, time.perf_counter()  # as a worker sets them
        messages = queue.Queue()
        fixed_rounds(campaign, 0, machine, round_settings, messages, examples, time.perf_counter())
        return [f for f in drained(messages, ("tally", "found")) if not hasattr(f, "rows")]

    database = str(tmp_path / "examples")
    assert not found(1, 7, None)
    assert found(DEFAULT_GENERATED, seed_of(DEFAULT_GENERATED), database)
    assert found(1, 7, database)


def _cpu_judge(result):
    return judge(result, load_policy("cpu"))


# -- failing, with the catalog ---------------------------------------------------------------


def check(tmp_path, impl, *options):
    out = tmp_path / "out"
    spec = impl if ":" in impl else f"{HERE}:{impl}"
    status = main(["check", "--level", "L1", "--impl", spec, "--out", str(out), *options])
    (report,) = out.glob("2*/report.json")
    return status, json.loads(report.read_text())


# The L1 catalog without the schedules made for the value cells, which fail both bugs below since
# those cells exist: the catalog as it was when these bugs passed it (179 of 180).
BEFORE_THE_VALUE_CELLS = [arg for path in catalog_paths("L1") if not path.stem.startswith("boundary-")
                          for arg in ("--schedule", str(path))]


@pytest.mark.slow  # the L1 catalog, then the default budget: about 60 s each on 2 cores at a load of 12
@pytest.mark.parametrize("bug, member", [("PrepareRightPaddingPastOne", "finalize"),
                                         ("FilterSharedPaddingFromTwo", "filter")])
def test_the_default_budget_fails_a_bug_the_catalog_misses(bug, member, tmp_path):
    """The generated budget finds both without the value cells' schedules."""
    status, record = check(tmp_path, bug, *BEFORE_THE_VALUE_CELLS, "--generated", str(DEFAULT_GENERATED))
    assert status == EXIT_BROKEN
    (group,) = record["failures"]
    assert group["member"] == member, group
    generated = record["generated"]
    (found,) = generated["failures"]
    assert found["replay"].startswith(f"kvparity replay {found['file']} --level L1 --impl")
    assert [r["schedule"] for r in record["results"] if r["verdict"] == FAIL] == [found["schedule"]]
    # Without the budget, those schedules pass it.
    assert main(["check", "--level", "L1", "--impl", f"{HERE}:{bug}", *BEFORE_THE_VALUE_CELLS,
                 "--generated", "0"]) == EXIT_OK


@pytest.mark.slow  # a worker process, a generated failure shrunk: 32 to 61 s on 2 cores at a load of 12 to 24
def test_the_budget_fails_a_bug_the_catalog_misses_shrunk_and_replayable(tmp_path):
    """One catalog file that passes the bug, and the budget: exit 1, one
    group naming filter, of the generated schedule, written shrunk with the
    command that replays it."""
    status, record = check(tmp_path, "FilterSharedPaddingFromTwo", "--schedule", CATALOG_FILE,
                           "--generated", str(DEFAULT_GENERATED))
    assert status == EXIT_BROKEN
    (group,) = record["failures"]
    assert group["member"] == "filter", group
    (found,) = record["generated"]["failures"]
    assert group["members"] == [found["schedule"]]
    assert found["replay"] == (f"kvparity replay {found['file']} --level L1 "
                               f"--impl {HERE}:FilterSharedPaddingFromTwo")
    assert len(json.loads(open(found["file"]).read())["events"]) <= 4
    check_schema(record, SCHEMA_PATH, "report.json", AssertionError)
    assert record["generated"]["schedules"] >= 1 and record["generated"]["cells"]["reached"] > 0


@pytest.mark.slow  # a worker process, a generated failure shrunk: 24 to 28 s on 2 cores at a load of 12 to 24
def test_a_generated_failure_joins_the_catalogs_group_of_its_member(tmp_path):
    """A bug the catalog catches too: its catalog run and the generated one
    are one group, naming filter."""
    status, record = check(tmp_path, "kvparity.impl.negative_controls:FilterKeepsSharedPadding",
                           "--schedule", str(CATALOG / "leave-longest.json"),
                           "--generated", str(DEFAULT_GENERATED))
    assert status == EXIT_BROKEN
    (group,) = record["failures"]
    assert group["member"] == "filter" and group["schedules"] == 2, group
    (found,) = record["generated"]["failures"]
    assert sorted(group["members"]) == sorted(["leave-longest", found["schedule"]])



def test_the_budget_leaves_nothing_in_the_users_working_directory(tmp_path, monkeypatch):
    """Hypothesis caches each local module's constants under ``.hypothesis/``
    of the working directory: the budget, run in the user's repository on
    their own cache module, keeps that in kvparity's cache instead."""
    repository = tmp_path / "theirs"
    repository.mkdir()
    (repository / "theircache.py").write_text(
        "from kvparity.impl.batch_quantized import BatchQuantizedKVCache\n\n\n"
        "class Cache(BatchQuantizedKVCache):\n    pass\n")
    monkeypatch.chdir(repository)
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    monkeypatch.setenv("KVPARITY_CACHE", str(tmp_path / "cache"))
    assert main(["check", "--level", "L1", "--impl", "theircache:Cache", "--schedule", CATALOG_FILE,
                 "--generated", "3"]) == EXIT_OK
    assert sorted(p.name for p in repository.iterdir() if p.name != "__pycache__") == ["theircache.py"]
