"""Shards that merge into one verdict: ``kvparity check --shard K/N`` and
``kvparity merge``. Shards 1/2 and 2/2 merged give the outcomes and counts
of one unsharded run, for an implementation that holds and for a negative
control that breaks; a merge missing a shard has no evidence. The cheap
version runs three L1 schedules; the whole catalog at every level is slow.
"""

import json
from pathlib import Path

import pytest

from kvparity.reports import shards
from kvparity.reports.commands import runs
from kvparity.reports.settings import Settings
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.format.schedule import CATALOG

THREE_L1 = ["--level", "L1", *(a for name in ("bits-4", "join-empty", "leave-longest")
                                 for a in ("--schedule", str(CATALOG / f"{name}.json")))]
BROKEN = "kvparity.impl.negative_controls:LeftPaddingOffByOne"


@pytest.fixture(autouse=True)
def no_probes(monkeypatch):
    """The L0 probes (a second per report, the same in every shard) are not what is merged here."""
    monkeypatch.setattr(runs, "probes", lambda model, device: [])


def report_in(folder: Path) -> dict:
    (found,) = folder.glob("*/report.json")
    return json.loads(found.read_text())


def check(tmp_path, name, *args) -> int:
    return main(["check", *args, "--out", str(tmp_path / name)])


def merge(tmp_path, name, *folders) -> int:
    return main(["merge", *(str(tmp_path / f) for f in folders), "--out", str(tmp_path / name)])


def same_verdict(merged: dict, whole: dict):
    """What a verdict is made of: outcomes and counts, per schedule run and row, per check, event
    kind and member, the gaps and the coverage model, and the exit status."""
    for key in ("exit_status", "headline", "summary", "checks", "coverage", "members", "gaps", "model_coverage",
                "expectations"):
        assert merged[key] == whole[key], key
    fields = lambda r: (r["level"], r["schedule"], r["verdict"], r["events"],  # noqa: E731
                        [(row["request"], row["verdict"], row["tier"], row["counts"], len(row["divergences"]))
                         for row in r["rows"]])
    assert [fields(r) for r in merged["results"]] == [fields(r) for r in whole["results"]]


def as_if_on_another_machine(folder: Path):
    """A shard's report as a runner with kvparity installed elsewhere writes it:
    its catalog paths do not exist here (the merge reads this installation's catalog)."""
    (found,) = folder.glob("*/report.json")
    record = json.loads(found.read_text())
    for result in record["results"]:
        result["path"] = "/elsewhere/site-packages/kvparity/suites/catalog/" + result["path"].split("/catalog/")[1]
    found.write_text(json.dumps(record))


def sharded(tmp_path, args, count=2):
    """The run whole, in ``count`` shards (their reports moved to another
    machine), and merged: the exit statuses and the reports."""
    status = {"whole": check(tmp_path, "whole", *args)}
    for k in range(1, count + 1):
        status[k] = check(tmp_path, f"shard-{k}", *args, "--shard", f"{k}/{count}")
        as_if_on_another_machine(tmp_path / f"shard-{k}")
    status["merged"] = merge(tmp_path, "merged", *(f"shard-{k}" for k in range(1, count + 1)))
    return status


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """``sharded_run(impl)``: (folder, exit statuses) of THREE_L1 whole, in two shards and merged, made once."""
    made = {}

    def get(impl):
        if impl not in made:
            folder = tmp_path_factory.mktemp("sharded")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(runs, "probes", lambda model, device: [])
                made[impl] = folder, sharded(folder, THREE_L1 + (["--impl", impl] if impl else []))
        return made[impl]
    return get


@pytest.mark.parametrize("impl, expected", [(None, EXIT_OK), (BROKEN, EXIT_BROKEN)])
def test_two_shards_merged_are_the_unsharded_run(sharded_run, capsys, impl, expected):
    tmp_path, status = sharded_run(impl)
    assert status["whole"] == status["merged"] == expected
    merged, whole = report_in(tmp_path / "merged"), report_in(tmp_path / "whole")
    same_verdict(merged, whole)
    one, two = report_in(tmp_path / "shard-1"), report_in(tmp_path / "shard-2")
    assert one["shard"]["plan"] == two["shard"]["plan"] == merged["shard"]["plan"]
    assert len(one["results"]) + len(two["results"]) == len(whole["results"]) == 3
    assert [m["index"] for m in merged["shard"]["merged"]] == [1, 2] and merged["shard"]["missing"] == []
    assert whole["shard"] is None

    # Dropping a shard drops its evidence: the merge cannot judge, as a run without those schedules.
    assert merge(tmp_path, "one-missing", "shard-1") == (EXIT_BROKEN if status[1] == EXIT_BROKEN else
                                                          EXIT_CANNOT_JUDGE)
    partial = report_in(tmp_path / "one-missing")
    assert partial["shard"]["missing"] == [2]
    assert partial["gaps"][0].startswith("shard 2/2 is missing")
    assert not partial["passed"]
    for name in ("report.md", "junit.xml", "report.html"):
        assert next((tmp_path / "merged").glob(f"*/{name}")).stat().st_size > 0
    assert "shard 2/2 is missing" in next((tmp_path / "one-missing").glob("*/report.md")).read_text()


def test_merge_refuses_what_is_not_shards_of_one_run(sharded_run, tmp_path, capsys):
    run, _ = sharded_run(None)
    for name in ("shard-1", "whole"):
        (tmp_path / name).symlink_to(run / name)
    assert check(tmp_path, "other-1", *THREE_L1[:6], "--shard", "1/2") == EXIT_OK  # another plan
    capsys.readouterr()
    assert merge(tmp_path, "m", "shard-1", "shard-1") == EXIT_USAGE
    assert "given twice" in capsys.readouterr().err
    assert merge(tmp_path, "m", "shard-1", "other-1") == EXIT_USAGE
    assert "plan" in capsys.readouterr().err
    assert merge(tmp_path, "m", "whole") == EXIT_USAGE
    assert "not a shard's report" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert merge(tmp_path, "m", "empty") == EXIT_USAGE
    assert "holds no report.json" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("shard", ["0/2", "3/2", "1", "a/b", "1/4"])
def test_a_bad_shard_is_refused_before_any_work(tmp_path, capsys, shard):
    # 1/4: three planned runs cannot fill four shards
    assert check(tmp_path, "s", *THREE_L1, "--shard", shard) == EXIT_USAGE
    assert "--shard" in capsys.readouterr().err
    assert main(["check", *THREE_L1, "--shard", "1/2"]) == EXIT_USAGE  # no --out
    assert "needs a report directory" in capsys.readouterr().err
    assert main(["run", *THREE_L1, "--shard", "1/2", "--no-report"]) == EXIT_USAGE
    assert "needs a report directory" in capsys.readouterr().err


def test_shares_are_deterministic_and_balanced_by_measured_cost():
    costs = {"L2 slow": 10.0, "L1 a": 1.0, "L1 b": 1.0, "L1 c": 1.0, "L2 other": 4.0}
    labels = ["L1 a", "L2 slow", "L1 b", "L1 c", "L2 other", "L1 unknown"]
    assert shards.assign(labels, 2, costs) == shards.assign(list(labels), 2, dict(costs))
    assigned = shards.assign(labels, 2, costs)
    assert assigned[labels.index("L2 slow")] != assigned[labels.index("L2 other")]
    loads = [sum(shards.cost(label, costs) for label, k in zip(labels, assigned) if k == n) for n in (1, 2)]
    assert loads == [10.0, 8.0]  # L1 unknown costs its level's median: 1
    assert shards.cost("L3 new (batched)", costs) == 1.0  # no L3 measured: the median of all


def test_the_cost_table_covers_the_catalog():
    every_level = Settings()
    labels = [label for label, _ in runs.plan(every_level, runs.select(every_level))]
    assert set(labels) <= set(shards.load_costs())


@pytest.mark.slow
def test_the_whole_catalog_in_two_shards_merged_is_the_unsharded_run(tmp_path, capsys):
    status = sharded(tmp_path, [])
    assert status["whole"] == status["merged"] == EXIT_OK
    # A shard alone does not speak for the catalog: only the merge judges members and the coverage model.
    merged, whole = report_in(tmp_path / "merged"), report_in(tmp_path / "whole")
    same_verdict(merged, whole)
    assert merge(tmp_path, "only-2", "shard-2") == EXIT_CANNOT_JUDGE
    partial = report_in(tmp_path / "only-2")
    assert partial["gaps"][0].startswith("shard 1/2 is missing")
