"""Coverage that does not hinge on optional capabilities.

An implementation without optional capabilities runs only the catalog
schedules whose ``needs`` is empty; the rest are "not supported". Every cell
of the coverage model (``suites/search/coverage.py``) must still be reached by one
of those at L1, and every model family by one of those at L2, or a bug that
only that cell or family reveals survives the whole catalog.

Data only: these tests read the schedule files and walk their dry runs,
they do not replay them on a cache.
"""

import json
from functools import lru_cache

import pytest

from kvparity.suites.search import coverage
from kvparity.suites.search.coverage import cells_of, family_of, meets, missing, name, paths_of, requirements
from kvparity.suites.format.schedule import BITS, CATALOG, REAL_CATALOG, catalog_paths
from kvparity.suites.core.loading import load

# The schedules that test per-row rollback itself: they keep needing it.
PER_ROW_ROLLBACK_SET = (
    "rollback-uneven",
    "rollback-everything-appended",
    "rollback-then-join",
    "kv-start-delayed-mixed",
)
# The cell of mlx-lm's QuantizedKVCache sizing a new cache's packed words
# (head_dim // (32 // bits)): wrong at 6 bits for head_dim 96.
EMPTY_BATCH_CELL = {"path": "batched-prefill-into-empty", "bits": 6, "head_dim": 96}


@lru_cache(maxsize=None)
def capability_free(level="L1", folder=CATALOG):
    """Catalog schedules of ``level`` that need no optional capability."""
    schedules = (load(p) for p in catalog_paths(level, folder))
    return tuple(s for s in schedules if not s.needs)


def uncovered(schedules):
    return missing(cell for s in schedules for cell in cells_of(s))


def probe(tmp_path, events, requests, **settings):
    doc = {"name": "probe", "levels": ["L1"], "requests": requests, "events": events, **settings}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    return load(path)


def test_every_cell_is_reached_without_optional_capabilities():
    gaps = uncovered(capability_free())
    assert not gaps, (f"{len(gaps)} cells of the coverage model are reached by no capability-free L1 "
                      "schedule:\n  " + "\n  ".join(gaps))


def test_removing_a_cells_schedules_leaves_it_uncovered():
    schedules = capability_free()
    reaching = [s for s in schedules if any(meets(cell, EMPTY_BATCH_CELL) for cell in cells_of(s))]
    assert reaching
    rest = [s for s in schedules if s not in reaching]
    assert name(EMPTY_BATCH_CELL) in uncovered(rest)
    # By name: the schedules that reach it at 6 bits, head_dim 128: the walk
    # of every path, and two whose values are at 128 beside keys at 192.
    cell = "path=batched-prefill-into-empty bits=6 head_dim=128"
    walks = {"paths-bits-6-h128", "paths-bits-6-h256-h512-k192-v128", "batched-join-empty-k192-v128"}
    assert {s.name for s in schedules if cell not in uncovered([s])} == walks
    assert cell in uncovered([s for s in schedules if s.name not in walks])


def test_the_model_asks_for_the_shapes_real_models_have():
    """Keys and values of dims of their own, head_dim 256 and 512, one kv
    head: every path at each, and each with every bits value."""
    asked = requirements()
    for path in coverage.PATHS:
        assert {"path": path, "kv_dims": "differ"} in asked
        assert {"path": path, "kv_heads": 1} in asked
        for bits in BITS:
            assert {"path": path, "bits": bits, "head_dim": 256} in asked
            assert {"path": path, "bits": bits, "head_dim": 512} in asked
    assert {"bits": 3, "kv_dims": "differ"} in asked and {"head_dim": 512, "kv_heads": 1} in asked


def test_keys_apart_from_values_are_reached_only_by_layers_that_have_them():
    schedules = capability_free()
    differ = [s for s in schedules if any(shape.key_dim != shape.value_dim for shape in s.shapes)]
    assert differ
    rest = [s for s in schedules if s not in differ]
    gaps = uncovered(rest)
    for path in coverage.PATHS:
        assert f"path={path} kv_dims=differ" in gaps


def test_the_model_asks_for_every_path_at_every_bits_and_head_dim_and_pairs_that_can_meet():
    asked = requirements()
    full = [r for r in asked if set(r) == set(coverage.FULL)]
    assert len(full) == len(coverage.PATHS) * len(BITS) * len(coverage.HEAD_DIMS)
    assert {"path": "growth-past-256", "bits": 5, "head_dim": 96} in full
    assert {"group_size": 128, "dtype": "float16"} in asked
    assert {"head_dim": 96, "group_size": 32} in asked
    assert not [r for r in asked if r.get("head_dim") == 96 and r.get("group_size") in (64, 128)]
    # A pair already inside a full requirement is not asked twice.
    assert {"path": "reinsert", "bits": 2} not in asked


def test_every_model_family_has_l2_schedules_without_optional_capabilities():
    schedules = capability_free("L2") + capability_free("L2", REAL_CATALOG)
    reached = {family_of(s) for s in schedules}
    assert set(coverage.MODEL_FAMILIES) <= reached, (
        f"no capability-free L2 schedule runs on {sorted(set(coverage.MODEL_FAMILIES) - reached)}")


def test_the_per_row_rollback_set_still_needs_it():
    # Coverage must come from new capability-free schedules, not from evening
    # out the schedules whose point is uneven rollback.
    for name in PER_ROW_ROLLBACK_SET:
        assert load(CATALOG / f"{name}.json").needs == ("per_row_rollback",), name


# -- the derivation: paths come from what the dry run does ------------------------------


def test_growth_is_the_batch_growing_not_a_row_that_starts_past_the_boundary(tmp_path):
    # near: 255 -> 256 -> 258 while long holds 300: the batch never grows past 256.
    requests = {"long": {"prompt_len": 300}, "near": {"prompt_len": 255}}
    events = [{"join": ["long", "near"]}, {"step": 1}, {"spec_round": {"k": 1}}]
    assert paths_of(probe(tmp_path, events, requests)) == ("join-into-empty",)
    # Without long, the same appends take the batch past 256.
    requests = {"near": {"prompt_len": 255}}
    events = [{"join": ["near"]}, {"step": 1}, {"spec_round": {"k": 1}}]
    assert paths_of(probe(tmp_path, events, requests)) == ("join-into-empty", "growth-past-256")


def test_trim_then_growth_needs_the_growth_after_the_trim(tmp_path):
    requests = {"a": {"prompt_len": 250}}
    grows_then_trims = [{"join": ["a"]}, {"step": 10}, {"trim": 2}, {"step": 1}]  # 260, 258, 259
    assert "trim-then-growth" not in paths_of(probe(tmp_path, grows_then_trims, requests))
    trims_then_grows = [{"join": ["a"]}, {"step": 3}, {"trim": 2}, {"step": 8}]  # 253, 251, 259
    assert paths_of(probe(tmp_path, trims_then_grows, requests)) == (
        "join-into-empty", "growth-past-256", "trim-then-growth")


def test_empty_batch_paths_follow_leaves_and_extracts(tmp_path):
    requests = {rid: {"prompt_len": 4} for rid in "abc"}
    events = [
        {"batched_join": ["a"]},  # into the empty batch
        {"extract": "a"},  # empties it
        {"batched_join": ["b"]},  # a refill
        {"reinsert": "a"},  # back after extract, into the running batch
        {"leave": ["b"]},
        {"join": ["c"]},  # into the running batch
        {"step": 1},
    ]
    assert paths_of(probe(tmp_path, events, requests)) == (
        "batched-prefill-into-empty", "extend", "reinsert", "refill")
    events = [{"join": ["a"]}, {"leave": ["a"]}, {"join": ["b", "c"]}, {"step": 1}]
    assert paths_of(probe(tmp_path, events, requests)) == ("join-into-empty", "refill")


def test_cells_carry_the_schedules_settings(tmp_path):
    schedule = probe(tmp_path, [{"join": ["a"]}, {"step": 1}], {"a": {"prompt_len": 3}},
                     kv={"bits": 5, "group_size": 32}, synthetic={"head_dim": 96, "dtype": "float16"})
    assert cells_of(schedule) == [coverage.Cell("join-into-empty", 5, 96, 32, "float16", 2, "equal")]


def test_cells_of_every_layer_at_its_key_dim_and_its_value_dim(tmp_path):
    layers = [{"kv_heads": 1, "key_dim": 192, "value_dim": 128}, {"head_dim": 512}]
    schedule = probe(tmp_path, [{"join": ["a"]}, {"step": 1}], {"a": {"prompt_len": 3}},
                     kv={"bits": 3, "group_size": 64}, synthetic={"layers": layers, "dtype": "float32"})
    cell = lambda dim, heads, kv_dims: coverage.Cell("join-into-empty", 3, dim, 64, "float32", heads, kv_dims)
    assert cells_of(schedule) == [cell(128, 1, "differ"), cell(192, 1, "differ"), cell(512, 2, "equal")]


# -- values: the integers members take at their edges ----------------------------------

# The cells the two bugs of issue 42 live in, and the one schedule that reaches each.
BOUNDARY_CELLS = {"prepare.longest-gap-1": "boundary-pads-by-one", "filter.shift-1": "boundary-pads-by-one",
                  "trim.empties-every-row": "boundary-rows-emptied",
                  "rollback.empties-a-row": "boundary-rollback-empties-a-row",
                  "merge.zero-token-row-first": "boundary-join-fresh-before-stored",
                  "merge.emptied-row": "boundary-extend-empty-side",
                  "extend.joiners-hold-no-tokens": "boundary-extend-empty-side"}


def values_reached(schedules):
    return {value for s in schedules for value in coverage.values_of(s)}


@lru_cache(maxsize=None)
def catalog_values():
    """Each L1 catalog schedule's name -> the value cells it reaches."""
    return {s.name: set(coverage.values_of(s)) for s in (load(p) for p in catalog_paths("L1"))}


def test_every_value_cell_is_reached_by_the_catalog():
    """CI fails on a value cell no L1 schedule reaches; those no optional
    capability needs are reached without one."""
    gaps = coverage.missing_values(set().union(*catalog_values().values()))
    assert not gaps, f"{len(gaps)} value cells are reached by no L1 schedule: {', '.join(gaps)}"
    free = coverage.missing_values(values_reached(capability_free()), capabilities=())
    assert not free, f"value cells reached only with an optional capability: {', '.join(free)}"


def test_each_value_cell_says_whether_mlx_lms_engine_makes_it():
    for name, value in coverage.VALUES.items():
        assert name.startswith(f"{value.member}."), name
        assert value.by in (coverage.ENGINE, coverage.PROTOCOL_ONLY) and value.why, name
    # Where mlx-lm's engine never calls: it never trims or rolls back a batch.
    assert {v.by for v in coverage.VALUES.values() if v.member in ("trim", "rollback")} == {coverage.PROTOCOL_ONLY}
    assert coverage.VALUES["prepare.no-gap"].by == coverage.PROTOCOL_ONLY
    assert coverage.VALUES["prepare.longest-gap-1"].by == coverage.ENGINE


def test_a_value_cell_is_asked_only_where_its_capability_ran():
    rollback = [n for n, v in coverage.VALUES.items() if v.needs == "per_row_rollback"]
    assert rollback and set(rollback) <= set(coverage.values_asked())
    assert not set(rollback) & set(coverage.values_asked(capabilities=()))


@pytest.mark.parametrize("cell, schedule", BOUNDARY_CELLS.items())
def test_removing_a_value_cells_schedule_leaves_it_unreached(cell, schedule):
    reached = catalog_values()
    assert cell in reached[schedule]
    assert not any(cell in values for name, values in reached.items() if name != schedule)


def test_the_run_counts_value_cells_among_the_models_requirements():
    judged = coverage.judged(capability_free())
    assert judged["requirements"] == len(requirements()) + len(coverage.values_asked(()))
    assert judged["missing"] == [] and judged["reached"] == judged["requirements"]
    emptied = ("boundary-rows-emptied", "boundary-extend-empty-side")  # the schedules whose batch holds no tokens
    without = coverage.judged(s for s in capability_free() if s.name not in emptied)
    assert "trim.empties-every-row" in without["missing"] and "nbytes.no-tokens" in without["missing"]


def test_paddings_of_one_come_from_the_rows_lengths(tmp_path):
    lengths = {"a": 6, "b": 5, "c": 4, "d": 2}
    requests = lambda *rids: {rid: {"prompt_len": lengths[rid]} for rid in rids}  # noqa: E731
    values = coverage.values_of(probe(tmp_path, [{"join": ["a", "b"]}, {"step": 1}, {"leave": ["a"]}],
                                      requests("a", "b")))
    assert {"merge.pad-1", "filter.shift-1"} <= set(values) and "merge.pad-more" not in values
    values = coverage.values_of(probe(tmp_path, [{"batched_join": ["a", "b"]}], requests("a", "b")))
    assert {"prepare.longest-gap-1", "merge.zero-token-rows"} <= set(values)
    assert "prepare.longest-gap-more" not in values
    values = coverage.values_of(probe(tmp_path, [{"batched_join": ["a", "b", "c", "d"]}], requests(*"abcd")))
    assert {"prepare.longest-gap-more", "prepare.gap-1-beside-more"} <= set(values)
    assert "prepare.longest-gap-1" not in values and "prepare.equal-gaps" not in values
    # A joiner one longer than the batch: the running rows' padding grows by one.
    values = coverage.values_of(probe(tmp_path, [{"join": ["b"]}, {"step": 1}, {"join": ["a"]}], requests("a", "b")))
    assert "extend.equal-widths" in values
    values = coverage.values_of(probe(tmp_path, [{"join": ["b"]}, {"step": 2}, {"join": ["a"]}], requests("a", "b")))
    assert "extend.joiners-pad-1" in values
    values = coverage.values_of(probe(tmp_path, [{"join": ["c"]}, {"step": 1}, {"join": ["a"]}], requests("a", "c")))
    assert "extend.existing-pad-1" in values


def test_rows_emptied_by_a_trim_and_what_is_read_of_them(tmp_path):
    requests = {"a": {"prompt_len": 4}, "b": {"prompt_len": 2}, "c": {"prompt_len": 3}}
    events = [{"join": ["a", "b"]}, {"trim": 2}, {"leave": ["a"]}, {"join": ["c"]}]
    values = set(coverage.values_of(probe(tmp_path, events, requests)))
    assert {"trim.more", "trim.empties-a-row", "extend.into-zero-token-rows", "nbytes.no-tokens"} <= values
    assert not {"trim.empties-every-row", "trim.one-row"} & values
    values = set(coverage.values_of(probe(tmp_path, [{"join": ["b"]}, {"trim": 2}], {"b": requests["b"]})))
    assert {"trim.empties-every-row", "trim.one-row", "nbytes.no-tokens", "size.no-tokens"} <= values


def test_rows_of_no_tokens_beside_rows_holding_tokens(tmp_path):
    """A batched join from a store merges a fresh row (no tokens) beside a
    stored prefix only where the store gives one some row's prompt; a row
    emptied by a trim and reinserted is merged alone, then extends the batch
    as a side of no tokens."""
    requests = {"a": {"prompt_len": 4}, "t": {"continues": "a", "new_tokens": 2}, "f": {"prompt_len": 1}}
    stored = [{"join": ["a"]}, {"store": {"into": "s", "requests": ["a"]}}, {"leave": ["a"]}]
    for rows, beside in ((["t", "f"], True), (["t"], False), (["f"], False)):  # both; every row from a prefix, from nothing
        values = set(coverage.values_of(probe(tmp_path, stored + [{"batched_join_stored": {"from": "s", "requests": rows}}],
                                              {rid: requests[rid] for rid in ["a"] + rows}, stores={"s": {}})))
        assert ("merge.zero-token-row-beside-tokens" in values) == beside, rows
    requests = {"a": {"prompt_len": 4}, "b": {"prompt_len": 2}}
    emptied = [{"join": ["a", "b"]}, {"trim": 2}, {"extract": "b"}, {"reinsert": "b"}]
    values = set(coverage.values_of(probe(tmp_path, emptied, requests)))
    assert {"merge.emptied-row", "extend.joiners-hold-no-tokens"} <= values
    values = set(coverage.values_of(probe(tmp_path, emptied[:1] + [{"trim": 1}] + emptied[2:], requests)))
    assert not {"merge.emptied-row", "extend.joiners-hold-no-tokens"} & values


def test_lengths_around_quantized_kv_start(tmp_path):
    requests = {"a": {"prompt_len": 4, "quantized_kv_start": 5}, "b": {"prompt_len": 6, "quantized_kv_start": 5}}
    assert set(coverage.values_of(probe(tmp_path, [{"join": ["a", "b"]}, {"step": 1}], requests))) >= {
        "merge.kv-start-one-below", "merge.kv-start-at", "merge.kv-start-one-above"}
    assert not {"merge.kv-start-one-below", "merge.kv-start-at"} & set(
        coverage.values_of(probe(tmp_path, [{"join": ["b"]}, {"step": 1}], {"b": requests["b"]})))


def test_a_model_row_rolls_back_only_what_it_generated(tmp_path):
    """At L1 a trim may go into the prompt (a row emptied); at L2 the prompt
    is the model's input, and the schedule is refused before anything runs."""
    from kvparity.suites.format.errors import ScheduleError

    requests = {"a": {"prompt_len": 2}}
    events = [{"join": ["a"]}, {"step": 1}, {"trim": 3}]
    assert "trim.empties-every-row" in coverage.values_of(probe(tmp_path, events, requests))
    doc = {"name": "probe", "levels": ["L1", "L2"], "requests": requests, "events": events}
    (tmp_path / "l2.json").write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match="past what it generated"):
        load(tmp_path / "l2.json")
    doc["levels"], doc["events"][-1] = ["L1"], {"trim": 4}
    (tmp_path / "l1.json").write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match=r"past what it holds \(3\)"):
        load(tmp_path / "l1.json")
