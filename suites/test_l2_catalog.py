"""L2 over the schedule catalog on the random models, and proof that broken
caches fail it with a first divergence at the right row and step. The gate
is the CPU policy (bit-exact) unless --policy says otherwise: never the
policy of whatever device the suite happens to run on."""

import pytest

from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL
from kvparity.suites.l2.run import run_l2
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

PATHS = catalog_paths("L2")


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
@pytest.mark.gqa_batched
def test_catalog_schedule(path, implementation, gate):
    gate(run_l2(load(path), implementation))


def test_l2_catalog_covers_models_and_settings():
    schedules = [load(p) for p in PATHS]
    models = {s.model for s in schedules if s.model}
    assert {"qwen3-h64-bf16", "qwen3-h128-f32", "llama-h64-f32"} <= models
    assert {s.bits for s in schedules} == {2, 3, 4, 5, 6, 8}
    assert {s.group_size for s in schedules} >= {32, 64, 128}
    assert {s.head_dim for s in schedules} == {64, 128}


@pytest.mark.parametrize(
    "variant, first_event, first_check",
    [
        # the mask is only used by a batched call: the first decode step
        ("MaskIgnoresLeftPadding", 1, "logits"),
        # the offset is wrong as soon as the rows merge, before any call
        ("RopeOffsetIgnoresLeftPadding", 0, "offset"),
    ],
)
@pytest.mark.gqa_batched
def test_broken_cache_fails_l2_at_the_padded_row(variant, first_event, first_check, judged):
    """join-longer-joiner: rows a (6 tokens) and b (4 tokens, 2 pad columns)
    merge, then decode. Only b is padded, so b diverges first, and its first
    wrong logits come from its first batched call (step 1, event #1)."""
    broken = load_implementation(f"kvparity.impl.negative_controls:{variant}")
    result = run_l2(load(CATALOG / "join-longer-joiner.json"), broken)
    assert judged(result).verdict == FAIL
    first = result.first
    assert (first.request, first.event_index, first.check) == ("b", first_event, first_check), first.message()
    logits = [d for d in result.row("b").divergences if d.check == "logits"]
    assert (logits[0].event_index, logits[0].step) == (1, 1), logits[0].message()
    assert "max abs diff" in logits[0].detail and "top-1 agree" in logits[0].detail
    assert all(d.event_index > 1 for d in result.row("a").divergences)


@pytest.mark.parametrize("variant, check", [("StoredRowTrimForgetsScales", "stored"),
                                            ("StoredNbytesCountsPacked", "stored_nbytes")])
@pytest.mark.gqa_batched
def test_store_controls_fail_l2_naming_the_entry(variant, check, judged):
    """Through the model too: the trimmed copy of the stored row (an exact
    hit gives a token back) and the entry's byte count."""
    broken = load_implementation(f"kvparity.impl.negative_controls:{variant}")
    result = run_l2(load(CATALOG / "prefix-exact-hit.json"), broken)
    assert judged(result).verdict == FAIL
    caught = [d for d in result.divergences if d.check == check]
    assert caught and "stored entry 'a'" in caught[0].message(), [d.message() for d in result.divergences[:3]]
