"""L2 on the real SmolLM2-135M: English prompts, three rows, joins, a leave,
uneven rollback and preemption, bit-exact against solo mlx-lm runs."""

import pytest

from kvparity.suites.l2.run import run_l2
from kvparity.suites.format.schedule import REAL_CATALOG, catalog_paths
from kvparity.suites.core.loading import load

PATHS = catalog_paths("L2", REAL_CATALOG)
pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("smollm2")]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_real_model_schedule(path, implementation, gate):
    schedule = load(path)
    assert len(schedule.requests) >= 3
    assert sum(e.n for e in schedule.events if e.kind == "step") >= 16
    gate(run_l2(schedule, implementation))


def test_real_model_catalog_exists():
    assert len(PATHS) >= 2
