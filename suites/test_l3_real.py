"""L3 on the real SmolLM2-135M: English prompts arriving over time through
mlx-lm's BatchGenerator, in both prefill modes, bit-exact against each
request run alone through generate_step."""

import pytest

from kvparity.suites.format.arrivals import L3_REAL_CATALOG, catalog_paths, load
from kvparity.suites.core.evidence import PASS
from kvparity.suites.l3.judging import explain
from kvparity.suites.l3.run import prefill_modes, run_l3

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("smollm2")]
PATHS = catalog_paths(L3_REAL_CATALOG)


def test_real_catalog_exists():
    assert len(PATHS) >= 2
    assert all(r.text for p in PATHS for r in load(p).requests.values())


@pytest.mark.parametrize("mode", list(prefill_modes(load(PATHS[0]))))
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_real_model_arrivals(path, mode, implementation, judged):
    result = judged(run_l3(prefill_modes(load(path))[mode], implementation))
    assert result.verdict == PASS, explain(result)
    assert all(row.compared("tokens") == row.metrics["log-prob vectors compared"] > 0 for row in result.evidence.rows)
