"""The smallest cache (impl/minimal.py, where docs/protocol.md starts cache
authors) passes the default gate: the catalog alone at L1 in the default run
(its coverage line says every requirement was reached), every level with the
slow tests."""

import pytest

from kvparity.reports.cli import EXIT_OK, main
from kvparity.suites.search.coverage import requirements, values_asked

MINIMAL = "kvparity.impl.minimal:MinimalBatchQuantizedKVCache"


def check(capsys, *argv):
    code = main(["check", "--impl", MINIMAL, *argv])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "0 failed" in out and "not supported" in out  # no per-row rollback: those schedules are skipped
    asked = len(requirements()) + len(values_asked(capabilities=()))  # its value cells but per-row rollback's
    assert f"coverage model (L1): {asked} of {asked} requirements reached" in out


@pytest.mark.slow  # the L1 catalog, about 14 s on 2 cores (the README's test command stays near 2 min)
def test_the_minimal_cache_passes_l1(capsys):
    check(capsys, "--level", "L1")


@pytest.mark.slow
def test_the_minimal_cache_passes_every_level(capsys):
    check(capsys)
