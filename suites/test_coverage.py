"""Coverage that does not hinge on optional capabilities.

An implementation without optional capabilities runs only the catalog
schedules whose ``needs`` is empty; the rest are "not supported". Every cell
of the coverage model (``suites/coverage.py``) must still be reached by one
of those at L1, and every model family by one of those at L2, or a bug that
only that cell or family reveals survives the whole catalog.

Data only: these tests read the schedule files and walk their dry runs,
they do not replay them on a cache.
"""

import json
from functools import lru_cache

import pytest

from kvparity.suites import coverage
from kvparity.suites.coverage import cells_of, family_of, meets, missing, name, paths_of, requirements
from kvparity.suites.schedule import BITS, CATALOG, REAL_CATALOG, catalog_paths, load

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
