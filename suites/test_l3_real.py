"""L3 on the real SmolLM2-135M: English prompts arriving over time through
mlx-lm's BatchGenerator, in both prefill modes, bit-exact against each
request run alone through generate_step."""

import pytest

from kvparity.oracle.models import ModelUnavailable, load_model
from kvparity.suites.arrivals import L3_REAL_CATALOG, catalog_paths, load
from kvparity.suites.l3 import PASSED, explain, prefill_modes, run_l3

pytestmark = pytest.mark.real_model
PATHS = catalog_paths(L3_REAL_CATALOG)


@pytest.fixture(scope="module", autouse=True)
def smollm2():
    try:
        return load_model("smollm2")
    except ModelUnavailable as error:
        pytest.skip(str(error))


def test_real_catalog_exists():
    assert len(PATHS) >= 2
    assert all(r.text for p in PATHS for r in load(p).requests.values())


@pytest.mark.parametrize("mode", list(prefill_modes(load(PATHS[0]))))
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_real_model_arrivals(path, mode, implementation):
    outcome = run_l3(prefill_modes(load(path))[mode], implementation)
    assert outcome.verdict == PASSED, explain(outcome)
    assert all(c.tokens_compared == c.logprob_vectors_compared > 0 for c in outcome.comparisons.values())
