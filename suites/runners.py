"""Which runner each level uses, declared once.

A level's runner says which schedules it takes (and its catalog), which
model a schedule needs, whether the schedule fits that model, and how one
schedule runs on an implementation. The command line's run, check, replay
and bisect all read ``RUNNERS``; a new level is its runner plus one entry.

``--model smollm2`` is the one special case: it selects the real model's
own schedules (each names its model) instead of forcing a model on all of
them. ``RunOptions.forced`` says it once.

The architecture axis (``catalog/architectures/axis.json``, data): the
catalog schedules it names run again on each model of the run's model set
(``RunOptions.models``: the axis's default architectures, or every
architecture of mlx-lm's zoo), each judged per layer as mlx-lm lays it out.
"""

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from kvparity.oracle.models import SMOLLM2, is_model_path, load_model, zoo_models
from kvparity.suites.format import arrivals
from kvparity.suites.l1 import run as l1
from kvparity.suites.l2 import run as l2
from kvparity.suites.l3 import run as l3
from kvparity.suites.l4 import run as l4
from kvparity.suites.l4.server import ServerUnderTest
from kvparity.suites.search.selection import select_for_model
from kvparity.suites.core.evidence import NOT_SUPPORTED, ScheduleResult
from kvparity.suites.format.levels import L1, L2, L3, L4
from kvparity.suites.format.schedule import CATALOG, REAL_CATALOG, catalog_paths, read_document
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import parse

# A label for the progress line and a run: implementation -> ScheduleResult.
Run = Tuple[str, Callable]


@dataclass(frozen=True)
class RunOptions:
    model: Optional[str] = None  # --model as given
    engine: Optional[str] = None  # L3: package.module:factory, None for mlx-lm's BatchGenerator
    repeat_oracle: Optional[bool] = None  # L2: None for the device's default
    use_cache: bool = True  # L2: reuse stored solo traces (bisect's variants do not)
    models: Tuple[str, ...] = ()  # the architecture axis's models (see ``model_set``)
    server: Optional[ServerUnderTest] = None  # L4: the server under test

    @property
    def real_model(self) -> bool:
        """The real model's schedules are asked for."""
        return self.model == SMOLLM2

    @property
    def forced(self) -> Optional[str]:
        """The model every schedule runs on, or None for each schedule's own."""
        return None if self.real_model else self.model

    @property
    def model_directory(self) -> bool:
        """A model directory is asked for: its catalog is the smallest set that covers it (``suites/search/selection.py``)."""
        return bool(self.model) and is_model_path(self.model) and Path(self.model).is_dir()


def schedule_of(doc, source: str):
    """A schedule document of either kind: events (L1, L2) or arrivals (L3)."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return (arrivals.parse if kind == arrivals.KIND else parse)(doc, source=source)


def load_schedule(path):
    """A schedule file of either kind."""
    return schedule_of(read_document(path), str(path))


def is_arrivals(schedule) -> bool:
    return isinstance(schedule, arrivals.ArrivalSchedule)


AXIS = CATALOG / "architectures" / "axis.json"
MODEL_SETS = ("default", "all")  # --models: the axis's own default, or every architecture of the zoo


@dataclass(frozen=True)
class ArchitectureAxis:
    default: Tuple[str, ...]  # the models a run adds by default
    schedules: Dict[str, Tuple[str, ...]]  # level -> catalog schedule names run on each model


@lru_cache(maxsize=None)
def architecture_axis(path=AXIS) -> ArchitectureAxis:
    doc = read_document(path)
    known = set(zoo_models())
    for model in doc["default"]:
        if model not in known:
            raise ScheduleError(f"{path}: default: {model!r} is no architecture of the zoo")
    return ArchitectureAxis(tuple(doc["default"]), {level: tuple(doc.get(level, ())) for level in (L2, L3, L4)})


def model_set(text: Optional[str]) -> Tuple[str, ...]:
    """``--models``: ``default`` (the axis's), ``all`` (the zoo), ``none``, or names, comma-separated."""
    if text in (None, "default"):
        return architecture_axis().default
    if text == "all":
        return tuple(zoo_models())
    if text == "none":
        return ()
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in zoo_models()]
    if unknown or not names:
        raise ValueError(f"--models {text!r}: {unknown[0] if unknown else 'no name'} is not "
                         f"{', '.join(MODEL_SETS + ('none',))} or an architecture of the zoo "
                         f"({', '.join(zoo_models())})")
    return names


class Runner:
    """A level of the event schedules (L1, L2); L3 overrides what differs."""

    level = ""

    def takes(self, schedule) -> bool:
        return not is_arrivals(schedule) and self.level in schedule.levels

    def catalog(self, options: RunOptions) -> List:
        return [load_schedule(p) for p in catalog_paths(folder=CATALOG)]

    def covering(self, schedules: List, options: RunOptions) -> List:
        """The catalog a run takes: on a model directory, the smallest set of
        this level's files that reaches every cell the model can express."""
        if not options.model_directory:
            return schedules
        loaded = load_model(options.model)
        mine = [s for s in schedules if self.takes(s)]
        return select_for_model(self.level, mine, loaded, lambda s: self.unfit(s, loaded))

    def model_name(self, schedule, options: RunOptions) -> Optional[str]:
        """The model the schedule needs; None when it needs none."""
        return None

    def unfit(self, schedule, model) -> Optional[str]:
        """Why the schedule cannot run on ``model`` (a usage error), or None."""
        return None

    def run(self, schedule, implementation, options: RunOptions):
        """One schedule, as it is, on ``implementation``: a ScheduleResult."""
        raise NotImplementedError

    def variants(self, schedule, options: RunOptions) -> List[Tuple[str, RunOptions]]:
        """(suffix, options) of each run of ``schedule``: as it is, then on
        every model of the run's axis that the axis runs it on."""
        out = [("", replace(options, models=()))]
        if schedule.name in architecture_axis().schedules.get(self.level, ()):
            out += [(f" on {model}", replace(options, model=model, models=())) for model in options.models]
        return out

    def unfit_for(self, schedule, variant: RunOptions) -> Optional[str]:
        """Why a run cannot run the schedule on its model (its group size does
        not divide the model's dims, a text prompt without a tokenizer), or
        None: a catalog file or an axis run is that run's "not supported",
        never left out and never a refusal of the rest (a file of the user's
        own is refused before, ``commands.runs.plan``)."""
        name = self.model_name(schedule, variant)
        if name is None:
            return None
        loaded = load_model(name)
        why = loaded.plan.nothing_to_judge()
        return f"cannot run on {loaded.name}: {why}" if why else self.unfit(schedule, loaded)

    def not_supported(self, schedule, name: str, model: str, why: str, implementation):
        result = ScheduleResult(name, self.level, implementation.name, [], path=schedule.path, model=model)
        for rid in schedule.requests:
            result.row(rid)
        result.stop(NOT_SUPPORTED, why)
        return result

    def runs(self, schedule, options: RunOptions) -> List[Run]:
        out = []
        for suffix, variant in self.variants(schedule, options):
            unfit = self.unfit_for(schedule, variant)

            def run(impl, variant=variant, suffix=suffix, unfit=unfit):
                if unfit:
                    return self.not_supported(schedule, schedule.name + suffix, variant.model, unfit, impl)
                result = self.run(schedule, impl, variant)
                result.schedule += suffix
                return result
            out.append((f"{self.level} {schedule.name}{suffix}", run))
        return out


class L1Runner(Runner):
    level = L1

    def run(self, schedule, implementation, options):
        return l1.run_l1(schedule, implementation)


class L2Runner(Runner):
    level = L2

    def catalog(self, options):
        return self.covering([load_schedule(p) for p in catalog_paths(folder=REAL_CATALOG if options.real_model
                                                                        else CATALOG)], options)

    def model_name(self, schedule, options):
        return l2.model_for(schedule, options.forced)

    def fit(self, schedule, model):
        """The schedule with its text prompts tokenized, and why it cannot
        run on ``model`` or None."""
        fitted, unfit = l2.fit_to_model(schedule, model)
        return fitted, unfit and f"{schedule.path}: cannot run on {model.name}: {unfit}"

    def unfit(self, schedule, model):
        return self.fit(schedule, model)[1]

    def run(self, schedule, implementation, options):
        return l2.run_l2(schedule, implementation, options.forced, use_cache=options.use_cache,
                         repeat_oracle=options.repeat_oracle)


class L3Runner(Runner):
    """An engine serving arrivals. A catalog schedule runs twice: each
    prompt prefilled alone, and the engine's own batched prefill."""

    level = L3

    def takes(self, schedule):
        return is_arrivals(schedule)

    def catalog(self, options):
        folder = arrivals.L3_REAL_CATALOG if options.real_model else arrivals.L3_CATALOG
        return self.covering([load_schedule(p) for p in arrivals.catalog_paths(folder)], options)

    def model_name(self, schedule, options):
        return options.forced or schedule.model

    def unfit(self, schedule, model):
        unfit = arrivals.check_fits(schedule, model.plan, model.vocab_size, model.tokenizer is not None)
        return unfit and f"cannot run on {model.name}: {unfit}"

    def run(self, schedule, implementation, options):
        return l3.run_l3(schedule, implementation, options.engine, options.forced)

    def runs(self, schedule, options):
        out = []
        for suffix, chosen in self.variants(schedule, options):
            unfit = self.unfit_for(schedule, chosen)
            for mode, variant in l3.prefill_modes(schedule).items():
                def serve(impl, s=variant, mode=mode, chosen=chosen, suffix=suffix, unfit=unfit):
                    if unfit:
                        return self.not_supported(s, f"{s.name} ({mode}){suffix}", chosen.model, unfit, impl)
                    result = self.run(s, impl, chosen)
                    result.schedule = f"{s.name} ({mode}){suffix}"
                    return result
                out.append((f"L3 {schedule.name} ({mode}){suffix}", serve))
        return out


class L4Runner(L3Runner):
    """A server over HTTP serving arrivals: its own catalog (arrival times in
    milliseconds, bursts up to the concurrency), each file once, then on each
    architecture of the run's axis (the server serving its model directory)."""

    level = L4

    def catalog(self, options):
        return [load_schedule(p) for p in arrivals.catalog_paths(L4_CATALOG)]

    def model_name(self, schedule, options):
        return SMOLLM2 if options.real_model else options.forced or schedule.model  # the catalog on the real model

    def unfit(self, schedule, model):  # the server declares its KV settings (l4.run_l4 fits them)
        unfit = arrivals.check_fits(schedule, model.plan, model.vocab_size, model.tokenizer is not None,
                                    group_sizes=False)
        return unfit and f"cannot run on {model.name}: {unfit}"

    def run(self, schedule, implementation, options):
        return l4.run_l4(schedule, options.server, self.model_name(schedule, options), use_cache=options.use_cache)

    def runs(self, schedule, options):
        return Runner.runs(self, schedule, options)


L4_CATALOG = CATALOG / "l4"
RUNNERS = {runner.level: runner for runner in (L1Runner(), L2Runner(), L3Runner(), L4Runner())}
