"""``kvparity coverage``: the coverage model against the catalog or a
user's schedules, from their dry runs; every cell reached is exit 0, a cell
not reached is named and the answer is 125 (cannot judge: a coverage gap)."""

import json
import shutil

from kvparity.reports.cli import main
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE
from kvparity.suites.search import coverage
from kvparity.suites.format.schedule import CATALOG


def test_the_catalog_reaches_every_cell_and_says_who_makes_each(capsys):
    assert main(["coverage"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "not reached" not in out
    assert "prepare.longest-gap-1" in out and "boundary-pads-by-one" in out and "protocol only" in out
    assert "coverage model (L1): " in out and " requirements reached by " in out


def test_a_cell_not_reached_is_named_and_cannot_be_judged(tmp_path, capsys):
    for name in ("bits-2", "boundary-rows-emptied"):
        shutil.copy(CATALOG / f"{name}.json", tmp_path)
    assert main(["coverage", str(tmp_path), "--json"]) == EXIT_CANNOT_JUDGE
    found = json.loads(capsys.readouterr().out)
    assert "filter.shift-1" in found["missing"] and "trim.empties-every-row" not in found["missing"]
    assert found["reached"] + len(found["missing"]) == found["requirements"]
    cells = {v["cell"]: v for v in found["values"]}
    assert set(cells) == set(coverage.VALUES)
    assert cells["trim.empties-every-row"]["reached_by"] == ["boundary-rows-emptied"]
    assert cells["trim.1"]["by"] == "protocol only" and cells["filter.shift-1"]["by"] == "engine"
    main(["coverage", str(tmp_path)])
    assert "not reached: filter.shift-1" in capsys.readouterr().out


def test_no_such_path_is_a_usage_error(tmp_path, capsys):
    assert main(["coverage", str(tmp_path / "nope.json")]) == EXIT_USAGE
    assert "nope.json: no such schedule file or folder" in capsys.readouterr().err
