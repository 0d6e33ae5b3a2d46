"""The class under test runs as itself. The harness counts its members' calls
and names what they raise through wrappers it puts in the class's own
namespace for a run, and leaves the class exactly as it found it: after a
pass, a failure, or a run interrupted from inside a member."""

import pytest

from kvparity.impl import negative_controls
from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.suites.core.adapter import Implementation, load_implementation
from kvparity.suites.core.raised import MemberRaised
from kvparity.suites.format.arrivals import parse as parse_arrivals
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.l1.run import run_l1
from kvparity.suites.l2.run import run_l2
from kvparity.suites.l3.judging import explain
from kvparity.suites.l3.run import run_l3
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

CONTROLS = "kvparity.impl.negative_controls"
SENSITIVE = negative_controls.SUBCLASS_SENSITIVE


def control(cls) -> Implementation:
    return load_implementation(f"{CONTROLS}:{cls.__name__}")


def assert_namespace_is(cls, before: dict):
    """``cls``'s own namespace holds exactly ``before``: the same names, each
    bound to the very same object."""
    after = dict(cls.__dict__)
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())
    assert [name for name in before if after[name] is not before[name]] == []


@pytest.fixture(scope="module")
def catalog():
    return [load(p) for p in catalog_paths("L1")]


# -- classes that behave differently when subclassed ---------------------------------


@pytest.mark.parametrize("cls", SENSITIVE, ids=lambda c: c.__name__)
def test_subclass_sensitive_control_on_the_l1_catalog(cls, catalog, judged):
    runs = [judged(run_l1(s, control(cls))) for s in catalog]
    verdicts = {r.verdict for r in runs}
    if cls.expected_outcome == PASS:
        assert verdicts == {PASS}, [(r.evidence.schedule, r.verdict, r.evidence.reason) for r in runs
                                    if r.verdict != PASS]
    else:
        assert FAIL in verdicts, f"{cls.__name__} survived the whole L1 catalog"
        assert cls.caught_by in {d.check for r in runs for d in r.evidence.divergences}


@pytest.mark.parametrize("cls", SENSITIVE, ids=lambda c: c.__name__)
def test_a_subclass_of_the_control_gets_the_other_verdict(cls, judged):
    # What the controls prove: a harness that judged a subclass of the class
    # under test would reach the wrong verdict on each of them.
    subclass = type(cls.__name__, (cls,), {"__module__": cls.__module__})
    result = run_l1(load(CATALOG / "join-longer-joiner.json"), Implementation(f"{CONTROLS}:{cls.__name__}", subclass))
    assert judged(result).verdict == (FAIL if cls.expected_outcome == PASS else PASS), result.reason


@pytest.mark.parametrize("cls", SENSITIVE, ids=lambda c: c.__name__)
@pytest.mark.gqa_batched
def test_subclass_sensitive_control_at_l2(cls, judged):
    result = run_l2(load(CATALOG / "join-longer-joiner.json"), control(cls))
    assert judged(result).verdict == cls.expected_outcome, result.reason


@pytest.mark.parametrize("cls", SENSITIVE, ids=lambda c: c.__name__)
@pytest.mark.gqa_batched
def test_subclass_sensitive_control_at_l3(cls, judged):
    schedule = parse_arrivals({
        "kind": "arrivals", "name": "staggered-pair", "model": "llama-h64-bf16", "kv": {"bits": 4, "group_size": 64},
        "requests": {"a": {"arrival": 0, "prompt_len": 6, "max_tokens": 4},
                     "b": {"arrival": 1, "prompt_len": 3, "max_tokens": 5, "seed": 1}}}, source="<staggered-pair>")
    result = judged(run_l3(schedule, control(cls)))
    assert result.verdict == cls.expected_outcome, explain(result)
    assert result.evidence.members  # counted on the class itself, as BatchGenerator called it


# -- the class is left as it was found -----------------------------------------------


@pytest.mark.parametrize("cls, verdict", [(negative_controls.BreaksItsSubclasses, PASS),
                                          (negative_controls.MaskRightOnlyInSubclasses, FAIL)])
def test_a_run_leaves_the_class_and_its_bases_as_they_were(cls, verdict, judged):
    before, base = dict(cls.__dict__), dict(BatchQuantizedKVCache.__dict__)
    assert "update_and_fetch" not in before  # inherited: must be deleted again, not left as a copy
    assert judged(run_l1(load(CATALOG / "join-longer-joiner.json"), control(cls))).verdict == verdict
    assert_namespace_is(cls, before)
    assert_namespace_is(BatchQuantizedKVCache, base)


class Interrupted(BatchQuantizedKVCache):
    """update_and_fetch notes the class it runs as, and what its class holds
    under its name; the third call raises KeyboardInterrupt."""

    seen = []

    def update_and_fetch(self, keys, values):
        self.seen.append((type(self), type(self).__dict__["update_and_fetch"]))
        if len(self.seen) == 3:
            raise KeyboardInterrupt
        return super().update_and_fetch(keys, values)


def test_an_interrupted_run_leaves_the_class_as_it_was():
    Interrupted.seen.clear()
    before, base = dict(Interrupted.__dict__), dict(BatchQuantizedKVCache.__dict__)
    implementation = Implementation(f"{__name__}:Interrupted", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_l1(load(CATALOG / "join-longer-joiner.json"), implementation)
    assert len(Interrupted.seen) == 3
    assert {cls for cls, _ in Interrupted.seen} == {Interrupted}  # the class itself, never a subclass
    assert all(installed is not before["update_and_fetch"] for _, installed in Interrupted.seen)  # watched
    assert implementation.calls["update_and_fetch"] == 3
    assert_namespace_is(Interrupted, before)
    assert_namespace_is(BatchQuantizedKVCache, base)


# -- every kind of member, on the class under test only --------------------------------


class Forbidding(type):
    """A metaclass whose hooks the harness must not trigger."""

    def __setattr__(cls, name, value):
        raise AssertionError(f"the metaclass hook ran for {name}")

    def __delattr__(cls, name):
        raise AssertionError(f"the metaclass hook ran for {name}")


class Base:
    def trim(self, n):
        return n

    @property
    def nbytes(self):
        return 7


class Kinds(Base, metaclass=Forbidding):
    def __init_subclass__(cls, **kwargs):
        raise AssertionError("subclassed")

    @classmethod
    def merge(cls, rows):
        return cls()

    @staticmethod
    def size():
        return 3

    @property
    def state(self):
        return self._state

    @state.setter
    def state(self, value):
        self._state = value

    def extract(self, idx):
        raise ValueError(f"no row {idx}")

    def filter(self, indices):
        raise NotImplementedError("filter")


def test_every_kind_of_member_is_counted_and_named_on_the_class_itself():
    before, base = dict(Kinds.__dict__), dict(Base.__dict__)
    implementation = Implementation("kinds", Kinds)
    with implementation.watching():
        batch = Kinds.merge([])
        assert type(batch) is Kinds
        batch.state = 5
        assert batch.state == 5 and batch.size() == 3 and Kinds.size() == 3
        assert batch.trim(2) == 2 and batch.nbytes == 7  # inherited, wrapped on Kinds alone
        assert "trim" in Kinds.__dict__ and "nbytes" in Kinds.__dict__
        assert_namespace_is(Base, base)
        with pytest.raises(MemberRaised) as raised:
            batch.extract(1)
        assert raised.value.member == "extract" and isinstance(raised.value.error, ValueError)
        with pytest.raises(MemberRaised) as raised:
            batch.filter([0])
        assert raised.value.member == "filter" and raised.value.refused
    assert implementation.calls == {"merge": 1, "state": 2, "size": 2, "trim": 1, "nbytes": 1,
                                    "extract": 1, "filter": 1}
    assert_namespace_is(Kinds, before)
    batch.trim(1)  # not watched any more
    assert implementation.calls["trim"] == 1


def test_a_run_inside_a_run_wraps_once_and_restores_at_the_outermost_end():
    before = dict(Kinds.__dict__)
    outer, other = Implementation("kinds", Kinds), Implementation("kinds again", Kinds)
    with outer.watching():
        installed = dict(Kinds.__dict__)
        with outer.watching(), other.watching():
            assert_namespace_is(Kinds, installed)  # not wrapped twice
            Kinds.merge([])
        assert_namespace_is(Kinds, installed)  # the inner runs did not restore too early
        Kinds.merge([])
    assert_namespace_is(Kinds, before)
    assert outer.calls["merge"] == 2 and other.calls["merge"] == 1  # a counter watching twice counts once


class Child(Base):
    def extract(self, idx):
        return idx


def test_a_class_and_its_base_watched_together_count_apart():
    base_run, child_run = Implementation("base", Base), Implementation("child", Child)
    with base_run.watching(), child_run.watching():
        Child().trim(1)
        Base().trim(1)
    assert child_run.calls == {"trim": 1} and base_run.calls == {"trim": 1}
    assert "trim" not in Child.__dict__ and "extract" in Child.__dict__
