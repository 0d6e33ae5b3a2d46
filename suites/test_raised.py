"""One rule for exceptions, at every level.

Raised on the implementation's path and not on mlx-lm's solo path: a FAIL
naming the level, schedule, event, layer and frame. Raised on both: the
oracle cannot run. Exit 128 only for kvparity's own bugs.
"""

import pytest
from mlx_lm.models import llama

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.oracle.models import load_model
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_HARNESS_ERROR, main
from kvparity.suites.core.adapter import Implementation, detect_capabilities
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load

L2_SCHEDULE = CATALOG / "join-longer-joiner.json"
L3_SCHEDULE = CATALOG / "l3" / "staggered.json"
MODEL = "llama-h64-bf16"  # both schedules' (the L3 file names it, the L2 file takes the default)

FORWARD = "the model's forward raised RuntimeError: this attention takes no batch"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def fresh_oracle(tmp_path, monkeypatch):
    """Solo runs computed now, under whatever this test patched, not read from disk."""
    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path / "oracle"))


def wrap_attention(monkeypatch, refuses):
    """An attention wrapper of the kind a cache's package installs into mlx-lm.
    mlx-lm's limits on the schedules' model are probed first, unpatched: a
    process probes them once, when first asked, and keeps them."""
    load_model(MODEL).limit
    plain = llama.scaled_dot_product_attention

    def attention(queries, keys, values, cache, *args, **kwargs):
        if refuses(cache):
            raise RuntimeError("this attention takes no batch")
        return plain(queries, keys, values, cache, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", attention)


def batched(cache):
    return hasattr(cache, "left_padding")


@pytest.mark.parametrize("level, schedule, event", [
    ("L2", L2_SCHEDULE, "event #1 step"),
    ("L3", L3_SCHEDULE, "event #0 serve"),
])
@pytest.mark.gqa_batched
def test_the_models_forward_raising_on_the_batch_is_a_failure_worded_alike(
        capsys, monkeypatch, fresh_oracle, level, schedule, event):
    wrap_attention(monkeypatch, batched)
    code, out, err = run(capsys, "replay", schedule, "--level", level)
    assert "Traceback" not in err and "internal error" not in err, err
    assert code == EXIT_BROKEN, out + err
    assert f"{level} {schedule.stem}" in out and event in out, out
    assert f"{FORWARD} (layer 0, at " in out and "in attention" in out, out


@pytest.mark.parametrize("level, schedule", [("L2", L2_SCHEDULE), ("L3", L3_SCHEDULE)])
@pytest.mark.gqa_batched
def test_raising_on_the_solo_path_too_means_the_oracle_cannot_run(capsys, monkeypatch, fresh_oracle, level,
                                                                   schedule):
    wrap_attention(monkeypatch, lambda cache: True)
    code, out, err = run(capsys, "check", "--level", level, "--schedule", schedule)
    assert "Traceback" not in err, err
    assert code == EXIT_CANNOT_JUDGE, out + err
    assert "oracle cannot run" in out and "FAIL" not in out, out


@pytest.mark.parametrize("level, schedule, harness_part", [
    ("L1", CATALOG / "join-longer-joiner.json", "kvparity.suites.l1.checks.check_mask"),
    ("L2", L2_SCHEDULE, "kvparity.suites.l2.run.compare_caches"),
    ("L3", L3_SCHEDULE, "kvparity.suites.l3.run.compare_request"),
])
@pytest.mark.gqa_batched
def test_only_a_bug_of_kvparity_itself_exits_128(capsys, monkeypatch, level, schedule, harness_part):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the harness")

    monkeypatch.setattr(harness_part, broken)
    code, out, err = run(capsys, "check", "--level", level, "--schedule", schedule)
    assert code == EXIT_HARNESS_ERROR, out + err
    assert "a bug in the harness" in err and "internal error (a bug in kvparity" in err


def filter_that_raises(self, batch_indices):
    raise RuntimeError("rows went missing")


@pytest.mark.parametrize("level, schedule, said", [
    ("L1", CATALOG / "leave-longest.json", "filter raised RuntimeError: rows went missing"),
    ("L3", L3_SCHEDULE, "the engine's call of filter raised RuntimeError: rows went missing"),
])
@pytest.mark.gqa_batched
def test_a_member_raising_is_a_failure_that_names_it(capsys, monkeypatch, level, schedule, said):
    """A required member that raises (not NotImplementedError) is the cache's
    FAIL, naming the member, at every level; never kvparity's crash."""
    from kvparity.impl.batch_quantized import BatchQuantizedKVCache

    monkeypatch.setattr(BatchQuantizedKVCache, "filter", filter_that_raises)
    code, out, err = run(capsys, "replay", schedule, "--level", level)
    assert "Traceback" not in err and "internal error" not in err, err
    assert code == EXIT_BROKEN, out + err
    assert said in out, out


class LazyFloatShift(BatchQuantizedKVCache):
    """A rollback whose gather indices are floats: MLX builds the graph and the
    member returns; computing the batch it left raises, in kvparity's reading."""

    def _shift_rows_right(self, shifts):
        super()._shift_rows_right([s / 2 if s else s for s in shifts])


def test_an_array_a_member_left_that_cannot_be_computed_is_that_member_s_failure():
    result = run_l1(load(CATALOG / "rollback-uneven.json"), Implementation(
        f"{__name__}:LazyFloatShift", LazyFloatShift, detect_capabilities(LazyFloatShift)))
    assert result.raised_by == "rollback", result.reason
    assert "rollback raised LazyArrayFailed: the arrays it left in the batch could not be computed: " \
           "RuntimeError" in result.reason, result.reason
