"""Event kinds: each its own class, parsed by shared functions; shrinking
asks the event what it names and how it gets smaller, never its kind's name."""

import pytest

from kvparity.suites.format.events import KINDS, Event, Join, Step, Trim, parse_event
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.replay import Replay
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load, parse
from kvparity.suites.search.shrink import Shrinker

# One event of every kind, as a file holds it.
EVERY_KIND = [
    {"join": ["a", "b"]}, {"batched_join": ["c"]}, {"step": 2}, {"spec_round": {"k": 3, "accepted": {"a": 1}}},
    {"rollback": {"a": 1, "b": 2}}, {"trim": 2}, {"extract": "b"}, {"solo_step": {"b": 2}}, {"reinsert": "b"},
    {"leave": ["a", "c"]}, {"store": {"into": "s", "requests": ["a", "b"]}},
    {"join_stored": {"from": "s", "requests": ["b"]}}, {"batched_join_stored": {"from": "s", "requests": ["b", "c"]}},
]


def test_every_kind_is_its_own_class():
    assert {next(iter(doc)) for doc in EVERY_KIND} == set(KINDS)
    events = [parse_event("<t>", i, doc) for i, doc in enumerate(EVERY_KIND)]
    for event, doc in zip(events, EVERY_KIND):
        assert event.to_json() == doc
        # no kind inherits from another kind: only from Event or a shape of arguments
        assert all(base is Event or not base.kind for base in type(event).__mro__[1:-1]), type(event)
    kinds = [type(e) for e in events]
    assert not any(isinstance(e, other) for e in events for other in kinds if other is not type(e))
    assert not isinstance(Trim(0, 2), Step)


def test_replay_has_a_method_for_every_kind():
    assert [kind for kind in KINDS if not callable(getattr(Replay, f"_{kind}", None))] == []


def test_a_kind_refuses_bad_arguments_naming_the_event():
    with pytest.raises(ScheduleError, match=r"<t>: event #4 trim 0: trim must be an integer >= 1"):
        parse_event("<t>", 4, {"trim": 0})
    with pytest.raises(ScheduleError, match="unknown event 'hop'"):
        parse_event("<t>", 0, {"hop": 1})


def test_shrinking_asks_each_event():
    events = [parse_event("<t>", i, doc) for i, doc in enumerate(EVERY_KIND)]
    assert [e.to_json() for e in (e.without("b") for e in events) if e is not None] == [
        {"join": ["a"]}, {"batched_join": ["c"]}, {"step": 2}, {"spec_round": {"k": 3, "accepted": {"a": 1}}},
        {"rollback": {"a": 1}}, {"trim": 2}, {"leave": ["a", "c"]}, {"store": {"into": "s", "requests": ["a"]}},
        {"batched_join_stored": {"from": "s", "requests": ["c"]}}]
    assert {r for e in events for r in e.named} == {"a", "b", "c"}
    assert [s.to_json() for e in events for s in e.smaller()] == [
        {"step": 1}, {"spec_round": {"k": 2, "accepted": {"a": 1}}}, {"trim": 1}]
    assert list(Join(0, ("a",)).smaller()) == []


class _NeverRuns(Shrinker):
    def __init__(self, source):
        self.source = source


def test_shrinker_candidates_drop_requests_and_lower_counts():
    schedule = load(CATALOG / "rollback-then-join.json")
    doc = schedule.to_json()
    candidates = list(_NeverRuns(schedule.path).candidates(doc))
    without_b = {**doc, "requests": {r: x for r, x in doc["requests"].items() if r != "b"},
                 "events": [{"join": ["a"]}, {"spec_round": {"k": 3, "accepted": {"a": 3}}}, {"join": ["c"]},
                            {"step": 2}]}
    assert without_b in candidates
    assert {**doc, "events": doc["events"][:1] + [{"spec_round": {"k": 2, "accepted": {"a": 2, "b": 0}}}]
            + doc["events"][2:]} in candidates
    parse(without_b)  # each candidate is a schedule


def test_the_catalog_readme_example_is_the_file_it_names():
    import json
    import re

    text = (CATALOG / "README.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    assert f"`{example['name']}.json`" in text
    assert example == json.loads((CATALOG / f"{example['name']}.json").read_text())
