"""Bad input is refused with a clear error before anything changes:
at the cache (the reference) and in schedule files."""

import json
import os

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.oracle.arrays import digest, owned_arrays
from kvparity.suites.format import arrivals
from kvparity.suites.format.schedule import CATALOG, memory_limit, save
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import load


def solo(length, bits=4, group_size=64, heads=2, head_dim=64, dtype=mx.bfloat16, seed=0):
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    if length:
        k = mx.random.normal((1, heads, length, head_dim), key=mx.random.key(seed)).astype(dtype)
        cache.update_and_fetch(k, k + 1)
    return cache


@pytest.fixture
def batch():
    return BatchQuantizedKVCache.merge([solo(5, seed=1), solo(9, seed=2)])


def unchanged(cache):
    """Snapshot a cache; calling the result asserts nothing moved since."""
    before = (digest(owned_arrays(cache)), cache.size(), cache.offset.tolist(), cache.left_padding.tolist())

    def check():
        after = (digest(owned_arrays(cache)), cache.size(), cache.offset.tolist(), cache.left_padding.tolist())
        assert after == before, "a refused call changed the cache"

    return check


@pytest.mark.parametrize(
    "rows, message",
    [
        ([solo(3, bits=4), solo(3, bits=8)], "row 1 is 8-bit group-64, row 0 is 4-bit group-64"),
        ([solo(3, group_size=64), solo(3, group_size=32)], "row 1 is 4-bit group-32"),
        ([solo(3, heads=2), solo(3, heads=4)], "row 1 has 4 kv heads, head_dim 64, mlx.core.bfloat16; the first filled row has 2 kv heads"),
        ([solo(3, head_dim=64), solo(3, head_dim=128)], "row 1 has 2 kv heads, head_dim 128, mlx.core.bfloat16; the first filled row has 2 kv heads, head_dim 64"),
        ([solo(3), solo(3, dtype=mx.float16)], "row 1 has 2 kv heads, head_dim 64, mlx.core.float16"),
        ([], "merge needs at least one row"),
    ],
)
def test_merge_refuses_rows_that_cannot_share_a_batch(rows, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        BatchQuantizedKVCache.merge(rows)


def test_merge_refuses_an_unquantized_row_as_not_supported():
    with pytest.raises(NotImplementedError, match="row 0 is an unquantized KVCache"):
        BatchQuantizedKVCache.merge([KVCache(), solo(3)])


@pytest.mark.parametrize("bits", [1, 7, 16])
def test_unsupported_bits(bits):
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        BatchQuantizedKVCache([0], bits=bits)


def test_group_size_must_divide_head_dim():
    batch = BatchQuantizedKVCache([0], group_size=128, bits=4)
    check = unchanged(batch)
    k = mx.zeros((1, 2, 1, 64))
    with pytest.raises(ValueError, match="group_size=128 does not divide head_dim=64"):
        batch.update_and_fetch(k, k)
    check()


def test_update_with_the_wrong_row_count(batch):
    check = unchanged(batch)
    k = mx.zeros((3, 2, 1, 64), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="got 3 rows but the batch holds 2"):
        batch.update_and_fetch(k, k)
    check()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda b: b.filter([0, 2]), r"filter indices \[0, 2\] out of range for 2 rows"),
        (lambda b: b.filter([1, 1]), "repeat a row"),
        (lambda b: b.filter([]), "must keep at least one row"),
        (lambda b: b.extract(2), r"extract\(2\) out of range for 2 rows"),
        (lambda b: b.rollback([1]), "rollback got 1 amounts for 2 rows"),
        (lambda b: b.rollback([6, 0]), "cannot roll back 6 tokens of row 0: it holds 5"),
        (lambda b: b.rollback([0, -1]), "cannot roll back -1 tokens of row 1"),
        (lambda b: b.trim(6), "cannot trim 6 tokens: the shortest row holds 5"),
        (lambda b: b.extend(BatchQuantizedKVCache.merge([solo(2, bits=8)])), "cannot extend a 4-bit group-64 batch with a 8-bit"),
        (lambda b: b.extend(BatchQuantizedKVCache.merge([solo(2, heads=4)])), "cannot extend a batch of 2 kv heads, head_dim 64, mlx.core.bfloat16 with one of 4 kv heads"),
    ],
)
def test_refused_calls_leave_the_cache_unchanged(batch, call, message):
    check = unchanged(batch)
    with pytest.raises(ValueError, match=message):
        call(batch)
    check()


def test_merge_leaves_its_sources_unchanged():
    rows = [solo(5, seed=1), solo(9, seed=2)]
    before = [digest(owned_arrays(r)) for r in rows]
    BatchQuantizedKVCache.merge(rows).update_and_fetch(*(2 * [mx.zeros((2, 2, 1, 64), dtype=mx.bfloat16)]))
    assert [digest(owned_arrays(r)) for r in rows] == before


# -- schedule files ----------------------------------------------------------------

GOOD = {
    "name": "t",
    "levels": ["L1"],
    "requests": {"a": {"prompt_len": 4}, "b": {"prompt_len": 2}},
    "events": [{"join": ["a"]}, {"step": 2}],
}


def with_changes(**changes):
    doc = json.loads(json.dumps(GOOD))
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    "doc, where, reason",
    [
        (with_changes(events=[{"leave": ["zz"]}]), 'event #0 leave ["zz"]', "unknown request 'zz'"),
        (with_changes(events=[{"join": ["a"]}, {"leave": ["b"]}]), "event #1 leave", "'b' is not in the batch (it has not joined)"),
        # A model's row rolls back only what it generated; at L1 alone, up to the whole row (its prompt too).
        (with_changes(levels=["L1", "L2"], events=[{"join": ["a", "b"]}, {"step": 1}, {"rollback": {"a": 2}}]),
         "event #2 rollback", "past what it generated (1)"),
        (with_changes(events=[{"join": ["a", "b"]}, {"step": 1}, {"rollback": {"a": 6}}]), "event #2 rollback",
         "past what it holds (5)"),
        (with_changes(kv={"bits": 4, "group_size": 128}), "kv", "group_size=128 does not divide head_dim=64"),
        (with_changes(kv={"bits": 7}), "kv", "bits=7 is not supported"),
        (with_changes(events=[{"jump": 1}]), "event #0", "unknown event 'jump'"),
        (with_changes(events=[{"join": ["a"]}, {"spec_round": {"k": 2, "accepted": {"a": 3}}}]), "event #1 spec_round", "accepts 3 of only k=2"),
        (with_changes(events=[{"join": ["a"]}, {"join": ["a"]}]), "event #1 join", "already joined"),
        (with_changes(events=[{"join": ["a"]}, {"solo_step": {"a": 1}}]), "event #1 solo_step", "'a' is not extracted"),
        (with_changes(events=[{"step": 1}]), "event #0 step", "step on an empty batch"),
        (with_changes(requests={"a": {"prompt_len": 0}}), "request 'a' prompt_len", "expected an integer >= 1"),
        (with_changes(requests={"a": {"prompt_len": 3, "kv_bits": 4}}), "request 'a'", "unknown field 'kv_bits'"),
        (with_changes(synthetic={"dtype": "int8"}), "synthetic.dtype", "'int8' is not one of"),
        # layer shapes: keys and values apart, several layers
        (with_changes(synthetic={"key_dim": 192}), "synthetic", "missing field 'value_dim'"),
        (with_changes(synthetic={"head_dim": 128, "value_dim": 64}), "synthetic.value_dim", "not both"),
        (with_changes(synthetic={"key_dim": 192, "value_dim": 96}), "kv.group_size",
         "group_size=64 does not divide value_dim=96 (synthetic)"),
        (with_changes(synthetic={"layers": [{"head_dim": 256}, {"key_dim": 128, "value_dim": 96}]}), "kv.group_size",
         "group_size=64 does not divide value_dim=96 (synthetic.layers[1])"),
        (with_changes(synthetic={"layers": [{"head_dim": 256}], "kv_heads": 2}), "synthetic.kv_heads",
         "with layers, each layer gives its own shape"),
        (with_changes(synthetic={"layers": []}), "synthetic.layers", "expected a non-empty list"),
        (with_changes(synthetic={"layers": [{"head_dim": 64, "dtype": "float16"}]}), "synthetic.layers[0]",
         "unknown field 'dtype'"),
        (with_changes(synthetic={"layers": [{"kv_heads": 0}]}), "synthetic.layers[0].kv_heads", "expected an integer >= 1"),
        (with_changes(levels=["L1", "L2"], synthetic={"key_dim": 192, "value_dim": 128}), "synthetic",
         "are L1 shapes: at L2 the model has its own"),
        (with_changes(requests={"a": {"prompt_len": 3, "quantized_kv_start": 5}}, events=[{"batched_join": ["a"]}]),
         "event #0 batched_join", "quantized_kv_start must be <= prompt_len"),
        # prompt-cache stores and chat turns
        (with_changes(events=[{"join": ["a"]}, {"store": {"into": "zz", "requests": ["a"]}}]),
         "event #1 store", "unknown store 'zz' (declared in stores: none)"),
        (with_changes(events=[{"join": ["a"]}, {"store": ["a"]}]), "event #1 store", '{"into": store, "requests"'),
        (with_changes(stores={"s": {}}, events=[{"store": {"into": "s", "requests": ["a"]}}]),
         "event #0 store", "'a' is not in the batch (it has not joined)"),
        (with_changes(stores={"s": {}}, requests={"a": {"prompt_len": 4, "quantized_kv_start": 9}},
                      events=[{"join": ["a"]}, {"store": {"into": "s", "requests": ["a"]}}]),
         "event #1 store", "'a' is not in the batch yet"),
        (with_changes(stores={"s": {"max_bytes": -1}}), "stores.s.max_bytes", "expected an integer >= 0"),
        (with_changes(stores={"s": {"max_items": 3}}), "stores.s", "unknown field 'max_items'"),
        (with_changes(requests={"a": {"prompt_len": 4}, "b": {"continues": "zz"}}), "request 'b' continues",
         "unknown request 'zz'"),
        (with_changes(requests={"a": {"prompt_len": 4, "keep": 2}}), "request 'a' keep", "only a request that continues"),
        (with_changes(stores={"s": {}}, requests={"a": {"prompt_len": 4}, "b": {"continues": "a", "new_tokens": 1}},
                      events=[{"join": ["a"]}, {"join_stored": {"from": "s", "requests": ["b"]}}]),
         "event #1 join_stored", "'b' continues 'a', which has not been stored yet"),
        (with_changes(stores={"s": {}}, requests={"a": {"prompt_len": 4}, "b": {"continues": "a", "keep": 9}},
                      events=[{"join": ["a"]}, {"store": {"into": "s", "requests": ["a"]}},
                              {"join_stored": {"from": "s", "requests": ["b"]}}]),
         "event #2 join_stored", "'b' keeps 9 tokens of 'a', which was stored with 4"),
        (with_changes(stores={"s": {}}, requests={"a": {"prompt_len": 4}, "b": {"continues": "a"}},
                      events=[{"join": ["a"]}, {"store": {"into": "s", "requests": ["a"]}}, {"join": ["b"]}]),
         "event #2 join", "'b' continues 'a': it joins through join_stored"),
        # a batched join from a store
        (with_changes(events=[{"batched_join_stored": {"from": "zz", "requests": ["a"]}}]),
         "event #0 batched_join_stored", "unknown store 'zz' (declared in stores: none)"),
        (with_changes(stores={"s": {}}, events=[{"batched_join_stored": ["a"]}]), "event #0 batched_join_stored",
         '{"from": store, "requests"'),
        (with_changes(stores={"s": {}}, levels=["L1", "L2"], events=[{"batched_join_stored": {
            "from": "s", "requests": ["a"]}}]), "event #0 batched_join_stored", "is an L1 event"),
        (with_changes(stores={"s": {}}, requests={"a": {"prompt_len": 3, "quantized_kv_start": 5}},
                      events=[{"batched_join_stored": {"from": "s", "requests": ["a"]}}]),
         "event #0 batched_join_stored", "quantized_kv_start must be <= prompt_len"),
    ],
)
def test_bad_schedule_is_refused_naming_file_event_and_reason(tmp_path, doc, where, reason):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ScheduleError) as error:
        load(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ")
    assert where in message and reason in message, message


def test_layer_shapes_round_trip(tmp_path):
    """A schedule written out reads back with the same shapes: one, keys
    apart from values, several layers."""
    for synthetic in ({"kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"},
                      {"kv_heads": 1, "key_dim": 192, "value_dim": 128, "dtype": "float16"},
                      {"layers": [{"kv_heads": 2, "head_dim": 256}, {"kv_heads": 1, "key_dim": 512, "value_dim": 256}],
                       "dtype": "float32"}):
        path = tmp_path / "shapes.json"
        path.write_text(json.dumps(with_changes(synthetic=synthetic, requests={"a": {"prompt_len": 4}})))
        schedule = load(path)
        assert schedule.to_json()["synthetic"] == synthetic
        save(schedule, path)
        assert load(path).shapes == schedule.shapes


def test_unreadable_schedule_files(tmp_path):
    with pytest.raises(ScheduleError, match="cannot read"):
        load(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ScheduleError, match="broken.json: not JSON"):
        load(tmp_path / "broken.json")


def test_state_round_trip(batch):
    """state and meta_state rebuild the same batch, as mlx-lm's caches do."""
    copy = BatchQuantizedKVCache.from_state(batch.state, batch.meta_state)
    assert digest(owned_arrays(copy)) == digest(owned_arrays(batch))
    assert (copy.size(), copy.bits, copy.group_size) == (batch.size(), batch.bits, batch.group_size)
    assert copy.nbytes == batch.nbytes


# -- files beyond the machine: refused before anything runs ----------------------------

TWO_ROWS = {"a": {"prompt_len": 5}, "b": {"prompt_len": 9}}


@pytest.mark.parametrize("doc, field", [
    ({"requests": {"a": {"prompt_len": 50_000_000}}, "events": [{"join": ["a"]}]}, "request 'a'"),
    ({"synthetic": {"kv_heads": 100_000, "head_dim": 64}, "requests": TWO_ROWS,
      "events": [{"join": ["a", "b"]}, {"step": 3}]}, "synthetic"),
    ({"requests": TWO_ROWS, "events": [{"join": ["a", "b"]}, {"step": 10_000_000}]},
     "event #1 step 10000000"),
])
def test_a_schedule_beyond_the_machine_is_refused_naming_the_field(tmp_path, monkeypatch, doc, field):
    monkeypatch.setenv("KVPARITY_MAX_MEMORY", str(16 << 30))  # a 16 GiB machine, whatever this one has
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"name": "big", "levels": ["L1"], **doc}))
    with pytest.raises(ScheduleError) as refused:
        load(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: {field}: would need about ") and "estimated before anything runs" in message
    assert "over the limit of 16.0 GiB (KVPARITY_MAX_MEMORY)" in message


def test_the_default_memory_limit_is_the_machine_s(monkeypatch):
    monkeypatch.delenv("KVPARITY_MAX_MEMORY", raising=False)
    limit, whence = memory_limit()
    assert limit == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert whence == "this machine's memory; KVPARITY_MAX_MEMORY sets it"


def test_the_memory_limit_is_settable_and_checked(monkeypatch):
    path = CATALOG / "join-empty.json"
    monkeypatch.setenv("KVPARITY_MAX_MEMORY", "4096")
    with pytest.raises(ScheduleError, match=r"over the limit of 0\.0 GiB \(KVPARITY_MAX_MEMORY\)"):
        load(path)
    monkeypatch.setenv("KVPARITY_MAX_MEMORY", "lots")
    with pytest.raises(ScheduleError, match="KVPARITY_MAX_MEMORY='lots': expected a number of bytes"):
        load(path)
    monkeypatch.delenv("KVPARITY_MAX_MEMORY")
    load(path)


def test_an_arrivals_file_beyond_the_machine_is_refused_naming_the_field(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    monkeypatch.setenv("KVPARITY_MAX_MEMORY", str(16 << 30))
    path.write_text(json.dumps({"kind": "arrivals", "name": "big", "requests": {
        "a": {"arrival": 0, "prompt_len": 4, "max_tokens": 90_000_000}}}))
    with pytest.raises(ScheduleError, match=r": request 'a' max_tokens: would need about .* GiB"):
        arrivals.load(path)
