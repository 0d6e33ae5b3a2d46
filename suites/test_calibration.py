"""The calibration of a backend policy runs end to end and proposes only
what its data can honestly support."""

import json

import pytest

from kvparity.oracle.mlx_lm_versions import defects_for
from kvparity.suites.calibration.proposal import propose
from kvparity.suites.calibration.run import FORMAT, calibrate


@pytest.mark.slow
def test_calibration_runs_end_to_end_on_a_tiny_grid(tmp_path):
    """On MLX's CPU backend (batch-invariant) the oracle runs and agrees with
    itself, the reference is bit-exact at every batch size, so a proposed tau
    is tiny; and the mask and RoPE controls still fail in every batch under it."""
    out = tmp_path / "calibration.json"
    # Where the installed mlx-lm's grouped-query attention is wrong
    # (oracle/mlx_lm_versions.py), a kv head per query head.
    model = "llama-h64-f32-mha" if defects_for(4, 2) else "llama-h64-f32"
    returned = calibrate(out, device="cpu", deadline=240, models=[model],
                         phases=["survey", "sweep", "compositions", "controls"], batch_sizes=[1, 2, 4], settings=1,
                         compositions=4)
    data = json.loads(out.read_text())
    assert data["proposal"] == json.loads(json.dumps(returned["proposal"]))
    assert data["format"] == FORMAT and data["machine"]["backend"] == "cpu"
    assert not data.get("phase_errors")
    assert data["survey"] and all(e["oracle"] == "ok" and e["batched"] == "ok" for e in data["survey"])
    assert all(e["reads"] == "as-is" for e in data["survey"])  # mlx-lm's own path runs: no contiguous mode
    sweep = data["sweep"][0]
    assert sweep["pooled"]["positions"] and sweep["pooled"]["bit_exact"] == sweep["pooled"]["positions"]
    trials = data["compositions"][0]
    assert trials["compositions"] == 4 and trials["unique_logits_hashes"] == 1 == trials["unique_token_sequences"]
    assert trials["equal_to_solo_bits"] == 4
    proposal = data["proposal"]
    assert proposal["tier"] == "kl" and 0 < proposal["tau"] <= 1e-10  # bit-exact data: nothing to tolerate
    assert not proposal["excluded"] and proposal["calibrated_from"]
    escapes = proposal["control_escapes"][f"{proposal['tau']:g}"]
    assert escapes["padded_rows"] and escapes["batches"] and escapes["batches_passing"] == 0


def _sweep(reads="as-is", positions=100, top1=100, kl_max=1e-4):
    return {"model": "m", "bits": 4, "group_size": 64, "reads": reads,
            "pooled": {"positions": positions, "top1_agree": top1, "kl_max": kl_max}}


def test_no_tau_from_the_contiguous_read_mode_nor_from_a_backend_defect():
    """Data not from mlx-lm's own read path, or whose greedy tokens flip on
    more than 1% of positions, calibrates nothing: no tau is proposed."""
    proposal = propose({"sweep": [_sweep(reads="contiguous"), _sweep(top1=90, kl_max=6.7)]})
    assert proposal["tier"] is None and proposal["tau"] is None
    assert "no tolerance can be calibrated" in proposal["reason"]
    why = [e["why"] for e in proposal["excluded"]]
    assert any("contiguous" in w for w in why) and any("backend defect" in w for w in why)


def test_a_tau_is_the_largest_qualifying_kl_times_the_margin_rounded_up():
    proposal = propose({"sweep": [_sweep(kl_max=2.3e-4), _sweep(kl_max=4e-5), _sweep(top1=50, kl_max=3.0)]},
                       margin=10)
    assert proposal["tier"] == "kl" and proposal["tau"] == 3e-3 and proposal["observed_kl_max"] == 2.3e-4
    assert len(proposal["calibrated_from"]) == 2 and len(proposal["excluded"]) == 1


def test_unknown_phases_are_refused():
    import pytest

    with pytest.raises(ValueError, match="unknown phases"):
        calibrate("/nonexistent/never-written.json", phases=["survey", "bogus"])
