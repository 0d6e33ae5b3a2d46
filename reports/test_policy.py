"""Verdict tiers and per-backend policies."""

import json

import pytest

from kvparity.reports.policy import PolicyError, load_policy, tier_of
from kvparity.reports.results import Divergence

EXACT = {"positions": 4, "bit_exact": 4, "top1_agree": 4, "max_ulp": 0, "kl_max": 0.0}
CLOSE = {"positions": 4, "bit_exact": 1, "top1_agree": 4, "max_ulp": 3, "kl_max": 2e-5}
FLIPPED = {"positions": 4, "bit_exact": 1, "top1_agree": 3, "max_ulp": 900, "kl_max": 2e-2}
LOGITS = Divergence("logits", "#1 step 1", "a", tensor="logits", step=1)
CACHE = Divergence("bytes", "#1 step 1", "a", tensor="keys.packed", layer=0, step=1)
RAISED = Divergence("raised", "#1 step 1", "a")


def test_tiers_reached():
    assert tier_of(EXACT, bytes_ok=True) == "bit-exact"
    assert tier_of(EXACT, bytes_ok=False) == "ulp<=0"
    assert tier_of(CLOSE, bytes_ok=True) == "ulp<=3"
    assert tier_of({**CLOSE, "max_ulp": -1}, bytes_ok=True) == "kl<=2e-05 and top-1 agree"
    assert tier_of(FLIPPED, bytes_ok=True) == "diverged"
    assert tier_of({}, bytes_ok=False) == "diverged"


def test_cpu_policy_requires_bit_exact():
    cpu = load_policy("cpu")
    assert cpu.required() == "bit-exact"
    assert cpu.gates(LOGITS, CLOSE) and cpu.gates(CACHE, CLOSE)


def test_gpu_policy_tolerates_small_logit_moves_but_not_a_flipped_token():
    gpu = load_policy("gpu")
    assert not gpu.gates(LOGITS, CLOSE)
    assert gpu.gates(LOGITS, FLIPPED)
    assert not gpu.gates(CACHE, CLOSE)  # model-written cache bytes follow the logits there
    assert gpu.gates(RAISED, EXACT)


def test_policy_file_errors(tmp_path):
    with pytest.raises(PolicyError, match="no policy 'tpu'"):
        load_policy("tpu")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"logits": {"tier": "close-enough"}}))
    with pytest.raises(PolicyError, match="logits.tier 'close-enough' is not one of"):
        load_policy(str(bad))
    ulp = tmp_path / "ulp.json"
    ulp.write_text(json.dumps({"backend": "cpu", "logits": {"tier": "ulp", "max_ulp": 4}}))
    policy = load_policy(str(ulp))
    assert not policy.gates(LOGITS, CLOSE) and policy.gates(LOGITS, FLIPPED)
