"""L1 over the schedule catalog: every data file is one test."""

import pytest

from kvparity.suites.l1 import run_l1
from kvparity.suites.schedule import catalog_paths, load
from kvparity.suites.verdicts import assert_parity

PATHS = catalog_paths("L1")


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_catalog_schedule(path, implementation):
    assert_parity(run_l1(load(path), implementation))


def test_catalog_covers_the_design_list():
    names = {p.stem for p in PATHS}
    required = {
        "join-empty", "join-longer-joiner", "join-shorter-joiner", "join-several-one-step",
        "leave-longest", "leave-all-refill", "buffer-growth-256", "prompt-length-1",
        "rollback-uneven", "rollback-everything-appended", "rollback-then-join",
        "extract-decode-reinsert", "kv-start-inside-prompt", "kv-start-after-join",
        "head-dim-64", "head-dim-128",
    }
    required |= {f"bits-{b}" for b in (2, 3, 4, 5, 6, 8)}
    required |= {f"group-{g}" for g in (32, 64, 128)}
    assert required <= names, sorted(required - names)
