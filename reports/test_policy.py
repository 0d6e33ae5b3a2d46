"""Verdict tiers and per-backend policies: which tier a row's logits reached,
which divergences gate, and policy files read strictly."""

import json
import math

import pytest

from kvparity.reports.policy import PolicyError, load_policy, round_up, tier_family
from kvparity.suites.format.checks import ALWAYS, BY_HYGIENE_POLICY, BY_TIER, CHECKS, HYGIENE, MODEL_WRITTEN
from kvparity.suites.core.compare import Divergence
from kvparity.suites.format.levels import LEVELS

EXACT = {"positions": 4, "bit_exact": 4, "top1_agree": 4, "max_ulp": 0, "kl_max": 0.0, "comparable": True}
CLOSE = {"positions": 4, "bit_exact": 1, "top1_agree": 4, "max_ulp": 3, "kl_max": 2e-5, "comparable": True}
NEAR = {"positions": 4, "bit_exact": 1, "top1_agree": 4, "max_ulp": 500, "kl_max": 2e-4, "comparable": True}
FLIPPED = {"positions": 4, "bit_exact": 1, "top1_agree": 3, "max_ulp": 900, "kl_max": 2e-2, "comparable": True}
LOGITS = Divergence("logits", "#1 step 1", "a", tensor="logits", step=1)
MODEL_BYTES = Divergence("bytes", "#1 step 1", "a", tensor="keys.packed", layer=0, step=1)
L1_BYTES = Divergence("bytes", "#1 step 1", "a", tensor="keys.packed")
LAYOUT = Divergence("layout", "#1 step 1", "a", tensor="keys.packed", layer=0)
RAISED = Divergence("raised", "#1 step 1", "a")
PAD = Divergence("pad", "#1 step 1", "a")


def test_tiers_reached():
    cpu, gpu = load_policy("cpu"), load_policy("gpu")
    assert cpu.logit_tier(EXACT) == "bit-exact"
    assert cpu.logit_tier(CLOSE) == "ulp<=4"
    assert cpu.logit_tier(NEAR) == "diverged"  # KL 2e-4 is over the cpu policy's 1e-4
    assert cpu.logit_tier({**NEAR, "kl_max": 5e-5}) == "kl<=0.0001 and top-1 agree"
    assert gpu.logit_tier(NEAR) == "kl<=0.001 and top-1 agree"
    assert gpu.logit_tier(FLIPPED) == "diverged"
    # "not comparable" (dtype or shape differs) is never a tier above diverged,
    # and no max_ulp of its own can lift it.
    assert gpu.logit_tier({**EXACT, "bit_exact": 0, "comparable": False}) == "diverged"
    assert gpu.logit_tier({**CLOSE, "max_ulp": None}) == "kl<=0.001 and top-1 agree"
    assert gpu.logit_tier({**CLOSE, "kl_max": math.inf, "max_ulp": None}) == "diverged"
    assert cpu.logit_tier({"positions": 0}) is None  # nothing compared: no tier at all
    assert [tier_family(t) for t in ("bit-exact", "ulp<=4", "kl<=0.001 and top-1 agree", "diverged")] == [
        "bit-exact", "ulp", "kl", "diverged"]


def test_cpu_policy_requires_bit_exact():
    cpu = load_policy("cpu")
    assert cpu.required() == "bit-exact"
    assert cpu.accepts("bit-exact") and not cpu.accepts("ulp<=4") and not cpu.accepts("diverged")
    assert cpu.gates(MODEL_BYTES, "L2") and cpu.gates(L1_BYTES, "L1")
    assert not cpu.gates(LOGITS, "L2")  # the tier decides logits
    assert not cpu.gates(PAD, "L1")  # hygiene is reported


def test_gpu_policy_tolerates_small_logit_moves_but_not_a_flipped_token():
    gpu = load_policy("gpu")
    assert gpu.required() == "kl<=0.001 and top-1 agree"
    assert gpu.accepts(gpu.logit_tier(CLOSE)) and gpu.accepts(gpu.logit_tier(NEAR))
    assert not gpu.accepts(gpu.logit_tier(FLIPPED))
    assert not gpu.gates(MODEL_BYTES, "L2")  # model-written cache bytes follow the logits there
    assert gpu.gates(L1_BYTES, "L1")  # data movement: bit-exact on every backend


def test_layout_and_raised_gate_under_every_policy():
    for name in ("cpu", "gpu", "strict"):
        policy = load_policy(name)
        for level in ("L1", "L2"):
            assert policy.gates(LAYOUT, level) and policy.gates(RAISED, level), (name, level)


def test_strict_gates_hygiene():
    assert load_policy("strict").gates(PAD, "L1")


def test_every_check_gates_as_its_row_of_the_table_says():
    cpu, gpu, strict = (load_policy(name) for name in ("cpu", "gpu", "strict"))
    for name, check in CHECKS.items():
        alone, in_a_layer = Divergence(name, "#1 step 1", "a"), Divergence(name, "#1 step 1", "a", layer=0)
        assert (check.kind == HYGIENE) == (check.gates == BY_HYGIENE_POLICY), name  # what no request sees
        if check.gates == BY_HYGIENE_POLICY:
            assert not cpu.gates(alone, "L1") and not gpu.gates(alone, "L1") and strict.gates(alone, "L1"), name
        elif check.gates == BY_TIER:
            assert not any(p.gates(in_a_layer, "L2") for p in (cpu, gpu, strict)), name
        elif check.gates == MODEL_WRITTEN:
            assert gpu.gates(in_a_layer, "L1") and gpu.gates(alone, "L2") and not gpu.gates(in_a_layer, "L2"), name
            assert cpu.gates(in_a_layer, "L2") and strict.gates(in_a_layer, "L2"), name
        else:
            assert check.gates == ALWAYS, name
            assert all(p.gates(in_a_layer, level) for p in (cpu, gpu, strict) for level in LEVELS), name


def _write(tmp_path, doc, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


@pytest.mark.parametrize("doc, message", [
    ({"backend": "cpu", "colour": "red"}, "unknown field 'colour'"),
    ({"logits": {"gate": "bit-exact"}}, "missing field 'backend'"),
    ({"backend": "cpu", "logits": {"tier": "ulp"}}, "logits: unknown field 'tier'"),
    ({"backend": "cpu", "logits": {"gate": "close-enough"}}, "logits.gate 'close-enough' is not one of"),
    ({"backend": "cpu", "logits": {"gate": "ulp", "max_ulp": -1}}, "max_ulp must be an integer >= 0"),
    ({"backend": "cpu", "logits": {"gate": "kl", "tau": "small"}}, "tau must be a number >= 0"),
    ({"backend": "cpu", "cache_bytes": "sometimes"}, "cache_bytes must be one of"),
    ("[1, 2]", "expected an object"),
    ("{", "not JSON"),
])
def test_policy_file_errors(tmp_path, doc, message):
    with pytest.raises(PolicyError, match=message):
        load_policy(_write(tmp_path, doc))


def test_unknown_policy_name():
    with pytest.raises(PolicyError, match="no policy 'tpu'"):
        load_policy("tpu")


def test_backend_comes_from_the_file_never_its_name(tmp_path):
    path = _write(tmp_path, {"backend": "cpu", "logits": {"gate": "ulp", "max_ulp": 4}}, name="gpu.json")
    policy = load_policy(path)
    assert policy.backend == "cpu" and policy.name == "gpu"
    assert policy.required() == "ulp<=4"
    assert policy.accepts(policy.logit_tier(CLOSE)) and not policy.accepts(policy.logit_tier(FLIPPED))


def test_round_up_keeps_a_printed_bound_a_bound():
    for x in (1.2341e-4, 0.0009999, 3.0, 12345.6):
        assert float(round_up(x)) >= x
    assert round_up(1.2341e-4) == "0.000124"
    assert round_up(0.0) == "0"
