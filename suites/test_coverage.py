"""Coverage that does not hinge on optional capabilities.

An implementation without optional capabilities runs only the catalog
schedules whose ``needs`` is empty; the rest are "not supported". Every
setting the suite lists must still be exercised by one of those, or a bug
that only that setting reveals survives the whole catalog.

Data only: these tests read the schedule files, they do not replay them.
"""

import json
from functools import lru_cache

import pytest

from kvparity.suites.schedule import CATALOG, catalog_paths, load

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16", "float32")
# mlx-lm's caches grow their buffers in steps of 256 tokens.
GROWTH_BOUNDARIES = (256, 512)
DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64

# The schedules that test per-row rollback itself: they keep needing it.
PER_ROW_ROLLBACK_SET = (
    "rollback-uneven",
    "rollback-everything-appended",
    "rollback-then-join",
    "kv-start-delayed-mixed",
)

SETTINGS = (
    [("bits", b) for b in BITS]
    + [("group_size", g) for g in GROUP_SIZES]
    + [("head_dim", h) for h in HEAD_DIMS]
    + [("dtype", d) for d in DTYPES]
)


@lru_cache(maxsize=None)
def capability_free():
    """Catalog schedules that need no optional capability and run at L1.

    Only L1 counts: head_dim and dtype describe the synthetic keys and values,
    which L1 uses; at L2 the model decides them.
    """
    schedules = (load(p) for p in catalog_paths("L1"))
    return tuple(s for s in schedules if not s.needs)


def appends_across(schedule, boundary):
    """Requests whose cache grows past ``boundary`` tokens in an append.

    A prompt already longer than the boundary when it prefills gets its
    buffer in one allocation; only an append that starts at or below the
    boundary and ends past it makes the cache grow there.
    """
    crossing = []
    for rid, calls in schedule.calls.items():
        length = 0
        for call in calls:
            before = length
            length += -call.n if call.op == "trim" else call.n
            if call.op == "append" and before <= boundary < length:
                crossing.append(rid)
                break
    return crossing


def batched_joins_into_empty_batch(schedule):
    """Indices of ``batched_join`` events that find no row in the batch."""
    in_batch, found = set(), []
    for event in schedule.events:
        if event.kind == "batched_join" and not in_batch:
            found.append(event.index)
        if event.kind in ("join", "batched_join"):
            in_batch |= set(event.args)
        elif event.kind == "reinsert":
            in_batch.add(event.args)
        elif event.kind == "leave":
            in_batch -= set(event.args)
        elif event.kind == "extract":
            in_batch.discard(event.args)
    return found


def describe(schedules):
    return ", ".join(s.name for s in schedules) or "none"


@pytest.mark.parametrize("setting,value", SETTINGS, ids=[f"{s}-{v}" for s, v in SETTINGS])
def test_each_listed_setting_runs_without_optional_capabilities(setting, value):
    if not any(getattr(s, setting) == value for s in capability_free()):
        needing = [s for s in map(load, catalog_paths("L1")) if getattr(s, setting) == value]
        pytest.fail(
            f"no capability-free L1 schedule has {setting}={value} "
            f"(schedules with it that need a capability: {describe(needing)})"
        )


GROWTH = [(b, h, n) for b in BITS for h in HEAD_DIMS for n in GROWTH_BOUNDARIES]


@pytest.mark.parametrize(
    "bits,head_dim,boundary", GROWTH, ids=[f"bits-{b}-h{h}-past-{n}" for b, h, n in GROWTH]
)
def test_buffer_growth_at_every_bits_and_head_dim(bits, head_dim, boundary):
    same = [s for s in capability_free() if (s.bits, s.head_dim) == (bits, head_dim)]
    assert any(appends_across(s, boundary) for s in same), (
        f"no capability-free L1 schedule at {bits} bits, head_dim {head_dim} grows a "
        f"request past {boundary} tokens in an append (schedules there: {describe(same)})"
    )


def test_batched_prefill_into_an_empty_batch_at_non_default_settings():
    found = [
        s for s in capability_free()
        if s.bits != DEFAULT_BITS and s.group_size != DEFAULT_GROUP_SIZE
        and batched_joins_into_empty_batch(s)
    ]
    assert found, (
        "no capability-free L1 schedule prefills a batched_join into an empty batch "
        f"at bits other than {DEFAULT_BITS} and a group size other than {DEFAULT_GROUP_SIZE}"
    )


def test_the_per_row_rollback_set_still_needs_it():
    # Coverage must come from new capability-free schedules, not from evening
    # out the schedules whose point is uneven rollback.
    for name in PER_ROW_ROLLBACK_SET:
        assert load(CATALOG / f"{name}.json").needs == ("per_row_rollback",), name


def test_growth_counts_appends_not_prompts_that_start_past_the_boundary(tmp_path):
    doc = {
        "name": "growth-probe",
        "levels": ["L1"],
        "requests": {"long": {"prompt_len": 300}, "near": {"prompt_len": 255}},
        "events": [{"join": ["long", "near"]}, {"step": 1}, {"spec_round": {"k": 1}}],
    }
    path = tmp_path / "growth-probe.json"
    path.write_text(json.dumps(doc))
    schedule = load(path)
    # near: 255 -> 256 (step, not past) -> 258 (verify window, past 256).
    assert appends_across(schedule, 256) == ["near"]
    assert appends_across(schedule, 512) == []


def test_empty_batch_detection_follows_leaves_and_extracts(tmp_path):
    doc = {
        "name": "empty-probe",
        "levels": ["L1"],
        "requests": {rid: {"prompt_len": 4} for rid in "abcd"},
        "events": [
            {"batched_join": ["a"]},
            {"extract": "a"},
            {"batched_join": ["b"]},
            {"reinsert": "a"},
            {"leave": ["b"]},
            {"batched_join": ["c"]},
            {"leave": ["a", "c"]},
            {"batched_join": ["d"]},
        ],
    }
    path = tmp_path / "empty-probe.json"
    path.write_text(json.dumps(doc))
    assert batched_joins_into_empty_batch(load(path)) == [0, 2, 7]
