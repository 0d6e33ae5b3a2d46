"""L1 over the schedule catalog: every data file is one test."""

import pytest

from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import NOT_SUPPORTED, PASS
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

PATHS = catalog_paths("L1")
# The walks of every path over three layers at head_dim 256 and 512 take a
# second or more each: the one at 6 bits (packed widths that go wrong at
# 256) runs by default, the others under `slow` (CI runs them).
WIDE_BY_DEFAULT = "paths-bits-6-h256-h512-k192-v128"
WIDE = [p.stem for p in PATHS if "-h256-h512-" in p.stem and p.stem != WIDE_BY_DEFAULT]


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in WIDE else p for p in PATHS],
                         ids=[p.stem for p in PATHS])
def test_catalog_schedule(path, implementation, gate):
    gate(run_l1(load(path), implementation))


def test_catalog_covers_the_design_list():
    names = {p.stem for p in PATHS}
    required = {
        "join-empty", "join-longer-joiner", "join-shorter-joiner", "join-several-one-step",
        "leave-longest", "leave-all-refill", "buffer-growth-256", "prompt-length-1",
        "rollback-uneven", "rollback-everything-appended", "rollback-then-join",
        "extract-decode-reinsert", "kv-start-inside-prompt", "kv-start-after-join",
        "head-dim-64", "head-dim-128", "head-dim-256", "head-dim-512", "head-dim-k512-v256",
    }
    required |= {f"bits-{b}" for b in (2, 3, 4, 5, 6, 8)}
    required |= {f"group-{g}" for g in (32, 64, 128)}
    assert required <= names, sorted(required - names)


WITHOUT_ROLLBACK = "kvparity.impl.negative_controls:WithoutPerRowRollback"


def test_a_missing_capability_is_not_supported_never_a_pass(gate, judged):
    impl = load_implementation(WITHOUT_ROLLBACK)
    assert impl.capabilities == {"per_row_rollback": False}
    uneven = run_l1(load(CATALOG / "rollback-uneven.json"), impl)
    with pytest.raises(pytest.skip.Exception, match="not supported: needs per_row_rollback"):
        gate(uneven)
    assert judged(uneven).verdict == NOT_SUPPORTED
    assert all(row.verdict == NOT_SUPPORTED for row in judged(uneven).rows)
    assert gate(run_l1(load(CATALOG / "spec-round-even.json"), impl)).verdict == PASS
