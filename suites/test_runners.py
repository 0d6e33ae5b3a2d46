"""One runner per level, and the real model's special case said once."""

from kvparity.suites.format import arrivals
from kvparity.suites.runners import RUNNERS, RunOptions, load_schedule
from kvparity.suites.format.levels import LEVELS
from kvparity.suites.format.schedule import CATALOG


def test_every_level_has_one_runner():
    assert set(RUNNERS) == set(LEVELS)
    assert all(level == runner.level for level, runner in RUNNERS.items())


def test_smollm2_selects_the_real_schedules_and_forces_no_model():
    real, forced = RunOptions(model="smollm2"), RunOptions(model="qwen3-h64-bf16")
    assert real.real_model and real.forced is None
    assert not forced.real_model and forced.forced == "qwen3-h64-bf16"
    assert {s.model for s in RUNNERS["L2"].catalog(real)} == {"smollm2"}
    assert all(s.model is None or s.model != "smollm2" for s in RUNNERS["L2"].catalog(RunOptions()))


def test_a_runner_takes_only_its_own_schedules_and_names_their_model():
    events = load_schedule(CATALOG / "rollback-uneven.json")
    served = load_schedule(CATALOG / "l3" / "staggered.json")
    assert isinstance(served, arrivals.ArrivalSchedule)
    assert RUNNERS["L3"].takes(served) and not RUNNERS["L3"].takes(events)
    assert not RUNNERS["L1"].takes(served) and not RUNNERS["L2"].takes(served)
    assert RUNNERS["L1"].model_name(events, RunOptions()) is None
    assert RUNNERS["L2"].model_name(events, RunOptions()) == f"llama-h{events.head_dim}-bf16"
    assert RUNNERS["L2"].model_name(events, RunOptions(model="qwen3-h64-f32")) == "qwen3-h64-f32"
    assert RUNNERS["L3"].model_name(served, RunOptions(model="smollm2")) == served.model
