"""The solo-run cache never changes a verdict (oracle/sealed.py).

A cache is filled by a clean run of L2 and L3, then every entry is damaged
in one way at a time: a bit flipped in each of its files, a manifest key
renamed, an offset or a token changed, entries swapped, files truncated,
the seal removed, a stray file added, an entry replaced by a file. Each
time the reference still exits 0 and a known-broken control still exits 1,
with the same counts as on the clean cache; every damaged entry is dropped
and recomputed, none is read back and none becomes "oracle cannot run".
"""

import json
import random
import shutil
from pathlib import Path

import pytest

from kvparity.oracle.generation import GENERATION_FILE
from kvparity.oracle.sealed import LEDGER, SEAL, Unproven, seal, verify
from kvparity.reports.cli import EXIT_BROKEN, EXIT_OK, main
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load

# Every test runs L2 and L3 on a grouped-query model.
pytestmark = pytest.mark.gqa_batched

CONTROL = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
SCHEDULES = {
    "L2": str(CATALOG / "join-longer-joiner.json"),
    "L3": str(CATALOG / "l3" / "staggered.json"),
}


def entries(cache: Path):
    """Every entry of the cache: the L2 traces and the L3 generations."""
    return sorted([p for p in cache.iterdir() if p.name != "l3"] + list((cache / "l3").iterdir()))


def flip_a_bit_in(name):
    def damage(entry, rng):
        path = entry / name
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    return damage


def edit_manifest(entry, rng):
    """A change that leaves valid JSON: an offset or a token one more."""
    path = entry / "manifest.json"
    doc = json.loads(path.read_text())
    if "snapshots" in doc:
        first = next(iter(doc["snapshots"].values()))
        first["offset"] += 1
    else:
        doc["tokens"][0] += 1
    path.write_text(json.dumps(doc))


def rename_manifest_key(entry, rng):
    path = entry / "manifest.json"
    path.write_text(path.read_text().replace('"sha256"', '"sha257"'))


def truncate(entry, rng):
    for path in entry.iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def remove_seal(entry, rng):
    (entry / SEAL).unlink()


def add_a_file(entry, rng):
    (entry / "stray.json").write_text("{}")


def replace_by_a_file(entry, rng):
    shutil.rmtree(entry)
    entry.write_text("not an entry")


def reseal_altered(entry, rng):
    """An entry altered and sealed again under its own key: the seal holds,
    the trace's own per-tensor hashes do not."""
    path = entry / ("trace.safetensors" if (entry / "trace.safetensors").exists() else GENERATION_FILE)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (entry / SEAL).unlink()
    seal(entry, entry.name)


def swap_entries(cache: Path) -> int:
    """Entries' files exchanged in pairs, in each folder; how many were."""
    swapped = 0
    for folder in (cache, cache / "l3"):
        group = sorted(p for p in folder.iterdir() if p.name != "l3")
        for a, b in zip(group[::2], group[1::2]):
            a.rename(folder / "swapping")
            b.rename(a)
            (folder / "swapping").rename(b)
            swapped += 2
    return swapped


EVERY_ENTRY = {
    "bit flip in seal": flip_a_bit_in(SEAL),
    "bit flip in manifest": flip_a_bit_in("manifest.json"),
    "offset or token changed": edit_manifest,
    "manifest key renamed": rename_manifest_key,
    "truncated": truncate,
    "seal removed": remove_seal,
    "stray file": add_a_file,
    "entry is a file": replace_by_a_file,
    "altered and resealed": reseal_altered,
}
DAMAGE = [*EVERY_ENTRY, "entries swapped"]


def damage(cache: Path, how: str, seed: int = 0) -> int:
    """Damage the cache's entries; how many were damaged."""
    if how == "entries swapped":
        return swap_entries(cache)
    rng = random.Random(seed)
    for entry in entries(cache):
        EVERY_ENTRY[how](entry, rng)
    return len(entries(cache))


def headlines(capsys, cache, monkeypatch):
    """Exit status and headline of the reference and the control at L2 and L3."""
    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(cache))
    out = {}
    for level, schedule in SCHEDULES.items():
        for impl in (None, CONTROL):
            args = ["check", "--level", level, "--schedule", schedule] + (["--impl", impl] if impl else [])
            status = main(args)
            printed = capsys.readouterr().out
            assert "oracle cannot run" not in printed
            out[level, impl] = status, printed.strip().splitlines()[-1]
    return out


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache filled by the clean runs, and what they said."""
    cache = tmp_path_factory.mktemp("filled") / "oracle"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPARITY_ORACLE_CACHE", str(cache))
        statuses = {}
        for level, schedule in SCHEDULES.items():
            for impl in (None, CONTROL):
                statuses[level, impl] = main(["check", "--level", level, "--schedule", schedule]
                                             + (["--impl", impl] if impl else []))
    assert statuses == {(level, impl): EXIT_OK if impl is None else EXIT_BROKEN
                        for level in SCHEDULES for impl in (None, CONTROL)}
    return cache


@pytest.mark.parametrize("how", DAMAGE)
def test_no_damage_to_the_cache_changes_a_verdict(how, filled, tmp_path, capsys, monkeypatch):
    clean = tmp_path / "clean"
    shutil.copytree(filled, clean)
    expected = headlines(capsys, clean, monkeypatch)
    assert {k: status for k, (status, _) in expected.items()} == {
        k: EXIT_OK if k[1] is None else EXIT_BROKEN for k in expected}

    damaged = tmp_path / "damaged"
    shutil.copytree(filled, damaged)
    damaged_entries = damage(damaged, how)
    before = len(LEDGER.dropped)
    assert headlines(capsys, damaged, monkeypatch) == expected
    # Every damaged entry was dropped once (then recomputed and stored sound); the
    # control's runs found the recomputed entries sound.
    assert len(LEDGER.dropped) - before == damaged_entries, LEDGER.dropped[before:]
    for entry in entries(damaged):
        verify(entry, entry.name)


@pytest.mark.slow  # every bit of an entry, about 16 s on 2 cores (the README's test command stays near 2 min)
def test_every_single_bit_flip_of_an_entry_is_refused(filled, tmp_path):
    """All bits of the seal and the manifest and a sample of the tensors'."""
    trace = next(p for p in entries(filled) if (p / "trace.safetensors").exists())
    verify(trace, trace.name)
    rng = random.Random(1)
    flips = 0
    for name in (SEAL, "manifest.json", "trace.safetensors"):
        path = trace / name
        original = path.read_bytes()
        positions = range(len(original) * 8) if name != "trace.safetensors" else \
            rng.sample(range(len(original) * 8), 2000)
        try:
            for bit in positions:
                data = bytearray(original)
                data[bit // 8] ^= 1 << (bit % 8)
                path.write_bytes(bytes(data))
                with pytest.raises(Unproven):
                    verify(trace, trace.name)
                flips += 1
        finally:
            path.write_bytes(original)
    assert flips > 2000


def test_an_entry_answers_only_to_its_own_key(filled):
    a, b = [p for p in entries(filled) if p.parent == filled][:2]
    with pytest.raises(Unproven, match="is not the key"):
        verify(a, b.name)


def test_the_report_counts_what_was_dropped(filled, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "oracle"
    shutil.copytree(filled, cache)
    damage(cache, "truncated")
    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(cache))
    out = tmp_path / "reports"
    assert main(["run", "--level", "L2", "--schedule", SCHEDULES["L2"], "--out", str(out)]) == EXIT_OK
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("solo-run cache:")]
    assert len(said) == 1 and "did not prove whole and were recomputed" in said[0]  # once, not per entry
    (report,) = out.iterdir()
    (result,) = json.loads((report / "report.json").read_text())["results"]
    requests = len(load(SCHEDULES["L2"]).requests)
    assert result["solo_cache"]["dropped"] == result["solo_cache"]["computed"] == requests
    assert len(result["solo_cache"]["reasons"]) == requests
    again = tmp_path / "again"
    assert main(["run", "--level", "L2", "--schedule", SCHEDULES["L2"], "--out", str(again)]) == EXIT_OK
    assert "solo-run cache:" not in capsys.readouterr().out
    (result,) = json.loads((next(again.iterdir()) / "report.json").read_text())["results"]
    assert result["solo_cache"] == {"reused": requests, "computed": 0, "dropped": 0, "reasons": []}
