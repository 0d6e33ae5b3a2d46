"""The gate bites: every broken variant of the reference fails L1 on the
catalog under its policy, and the check named on the variant is among those
that catch it. Parity variants fail under the default policy; hygiene
variants are reported there and fail under ``strict``."""

import json

import pytest
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.impl import negative_controls
from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.suites.core.adapter import Implementation, load_implementation
from kvparity.suites.format.checks import CHECKS, HYGIENE_CHECKS
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load


@pytest.fixture(scope="module")
def catalog():
    return [load(p) for p in catalog_paths("L1")]


@pytest.mark.parametrize("variant", negative_controls.VARIANTS, ids=lambda v: v.__name__)
def test_broken_variant_is_caught(variant, catalog, judged):
    impl = load_implementation(f"kvparity.impl.negative_controls:{variant.__name__}")
    hygiene = variant.caught_by in HYGIENE_CHECKS
    gating = "strict" if hygiene else "cpu"
    runs, failed = [], []
    for schedule in catalog:
        runs.append(run_l1(schedule, impl))
        if judged(runs[-1], gating).verdict == FAIL:
            failed.append(runs[-1])
            # Caught by its check: the rest of the catalog could only add other
            # checks. A hygiene variant runs it all: no run may fail by default.
            if not hygiene and variant.caught_by in {d.check for d in runs[-1].divergences}:
                break
    assert failed, f"{variant.__name__} survived the whole L1 catalog"
    checks = {d.check for r in failed for d in r.divergences}
    assert checks <= set(CHECKS), f"checks not declared in suites/format/checks.py: {sorted(checks - set(CHECKS))}"
    assert variant.caught_by in checks, (
        f"{variant.__name__} was caught, but by {sorted(checks)}, not {variant.caught_by!r}"
    )
    if hygiene:  # reported, yet it does not fail the default gate
        default = [judged(r).verdict for r in runs]
        assert FAIL not in default and PASS in default


# Each store control and a schedule that stores rows the way it breaks.
STORE_CATCHES = [
    (negative_controls.ExtractLendsItsColumns, "prefix-hit-spec-rollback"),  # the source row rolls back
    (negative_controls.StoredRowTrimForgetsScales, "prefix-trim-longer"),  # the fetched copy is trimmed
    (negative_controls.StoredNbytesCountsPacked, "prefix-chat-turns"),  # any store
    (negative_controls.StoredCopySharesBuffers, "prefix-trim-longer"),  # the rest lands inside the copy
    (negative_controls.StoredNbytesSkipsBiases, "prefix-chat-turns"),  # any store
]


def test_every_store_variant_has_its_schedule():
    assert [variant for variant, _ in STORE_CATCHES] == negative_controls.STORE_VARIANTS


@pytest.mark.parametrize("variant, name", STORE_CATCHES, ids=lambda v: getattr(v, "__name__", v))
def test_store_variant_is_caught_naming_the_entry(variant, name, catalog, judged):
    """Each breaks only what a store does with a row: a schedule that stores
    rows catches it, by its check, in a message that names the stored entry,
    the request and the event."""
    impl = load_implementation(f"kvparity.impl.negative_controls:{variant.__name__}")
    result = run_l1(next(s for s in catalog if s.name == name), impl)
    assert judged(result, "cpu").verdict == FAIL
    caught = [d for d in result.divergences if d.check == variant.caught_by]
    assert caught, f"{variant.__name__} was caught by {sorted({d.check for d in result.divergences})}"
    message = caught[0].message()
    assert "stored entry '" in message and "row '" in message and "after event #" in message, message


def test_store_variants_pass_without_a_store(catalog, judged):
    """Nothing else is broken in them: a schedule without a store passes."""
    plain = next(s for s in catalog if s.name == "extract-decode-reinsert")
    for variant in negative_controls.STORE_VARIANTS:
        impl = load_implementation(f"kvparity.impl.negative_controls:{variant.__name__}")
        assert judged(run_l1(plain, impl)).verdict == PASS, variant.__name__


def test_every_variant_is_listed():
    # A class broken only when run as itself is listed with the subclass-sensitive ones.
    classes = {
        obj for obj in vars(negative_controls).values()
        if isinstance(obj, type) and hasattr(obj, "caught_by")
    }
    sensitive = {c for c in negative_controls.SUBCLASS_SENSITIVE if hasattr(c, "caught_by")}
    assert classes == set(negative_controls.VARIANTS) | sensitive | set(negative_controls.STORE_VARIANTS)
    assert len(negative_controls.VARIANTS) >= 6


# -- shapes of real models: keys apart from values, layers of their own dims -----------


def test_a_control_right_at_keys_equal_to_values_fails_where_they_differ(judged):
    impl = load_implementation("kvparity.impl.negative_controls:EmptyBatchSizesValuesLikeKeys")
    assert judged(run_l1(load(CATALOG / "batched-join-empty-bits-3-group-32.json"), impl)).verdict == PASS
    apart = run_l1(load(CATALOG / "batched-join-empty-k192-v128.json"), impl)
    assert judged(apart).verdict == FAIL
    assert {d.check for d in apart.divergences} == {"raised"}
    assert "update_and_fetch raised" in apart.first.message()


class ValuesApartFirstTokenZeroed(BatchQuantizedKVCache):
    """Right wherever keys and values share a dim; in a layer whose values
    have a dim of their own, the first value token is zeroed in place."""

    def update_and_fetch(self, keys, values):
        fetched = super().update_and_fetch(keys, values)
        if keys.shape[-1] != values.shape[-1]:
            self.values[0][..., :1, :] = 0
        return fetched


def test_a_divergence_in_one_layer_of_several_names_that_layer(tmp_path, judged):
    doc = {"name": "two-layers", "levels": ["L1"], "kv": {"bits": 4, "group_size": 32},
           "synthetic": {"layers": [{"head_dim": 64}, {"kv_heads": 1, "key_dim": 96, "value_dim": 64}]},
           "requests": {"a": {"prompt_len": 5}, "b": {"prompt_len": 3}},
           "events": [{"join": ["a", "b"]}, {"step": 2}]}
    path = tmp_path / "two-layers.json"
    path.write_text(json.dumps(doc))
    broken = Implementation("test:ValuesApartFirstTokenZeroed", ValuesApartFirstTokenZeroed)
    result = run_l1(load(path), broken)
    assert judged(result).verdict == FAIL
    assert {d.layer for d in result.divergences} == {1}
    assert "layer 1" in result.first.message() and "values" in result.first.message()
    assert judged(run_l1(load(path), load_implementation())).verdict == PASS


# -- a row of no tokens (the coverage model's boundary cells) ---------------------------


class ExtractsAnEmptyRowAsAFreshCache(BatchQuantizedKVCache):
    """Right: a row that holds no tokens comes back as mlx-lm's empty cache
    (keys and values None), as a published cache's extract does."""

    def extract(self, idx):
        row = super().extract(idx)
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits) if row.offset == 0 else row


class _RowWhoseStateRaises(QuantizedKVCache):
    @property
    def state(self):
        raise TypeError("'NoneType' object is not subscriptable")


class ExtractedRowStateRaises(BatchQuantizedKVCache):
    def extract(self, idx):
        row = super().extract(idx)
        raising = _RowWhoseStateRaises(group_size=row.group_size, bits=row.bits)
        raising.keys, raising.values, raising.offset = row.keys, row.values, row.offset
        return raising


def test_a_row_of_no_tokens_may_come_back_as_an_empty_cache_and_a_raising_row_is_extracts(judged):
    emptied = load(CATALOG / "boundary-rows-emptied.json")
    fresh = Implementation("test:ExtractsAnEmptyRowAsAFreshCache", ExtractsAnEmptyRowAsAFreshCache)
    assert judged(run_l1(emptied, fresh)).verdict == PASS
    # Reading a returned row's state is the cache's to survive: its FAIL, naming extract, not kvparity's error.
    raising = Implementation("test:ExtractedRowStateRaises", ExtractedRowStateRaises)
    result = run_l1(emptied, raising)
    assert judged(result).verdict == FAIL and result.raised_by == "extract"
    assert "TypeError" in result.first.message()
