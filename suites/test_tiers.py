"""Every tier is reachable: an L2 run whose batched forward perturbs the
logits by known amounts lands on exactly the tier the amount implies, and
the CPU policy gates all but bit-exact."""

import dataclasses

import mlx.core as mx
import pytest

from kvparity.oracle.models import load_model
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.l2.run import run_l2
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load


class Perturbed:
    """The model, with its output logits passed through ``change``."""

    def __init__(self, model, change):
        self.inner, self.change = model, change

    def __call__(self, *args, **kwargs):
        return self.change(self.inner(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def one_ulp(logits):
    bits = {2: mx.uint16, 4: mx.uint32}[logits.dtype.size]
    return (logits.view(bits) + 1).view(logits.dtype)  # the next float away from zero (or toward, below it)


@pytest.mark.parametrize("change, tier, verdict", [
    (lambda x: x, "bit-exact", PASS),
    (one_ulp, "ulp<=4", FAIL),
    (lambda x: x + 0.5, "kl<=0.0001 and top-1 agree", FAIL),  # a shift: softmax unchanged, every value moved
    (lambda x: -x, "diverged", FAIL),  # the greedy token flips
], ids=["none", "one ulp", "shift", "negated"])
@pytest.mark.gqa_batched
def test_each_tier_is_reached_by_a_known_perturbation(implementation, judged, change, tier, verdict):
    loaded = load_model("llama-h64-bf16")
    perturbed = dataclasses.replace(loaded, model=Perturbed(loaded.model, change))
    result = judged(run_l2(load(CATALOG / "join-longer-joiner.json"), implementation, model=perturbed))
    assert {row.tier for row in result.rows} == {tier}, [(r.evidence.request, r.tier, r.evidence.metrics)
                                                          for r in result.rows]
    assert result.verdict == verdict
