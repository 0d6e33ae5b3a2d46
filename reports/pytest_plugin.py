"""kvparity as a pytest plugin (the ``pytest11`` entry point ``kvparity``).

Wherever kvparity is installed, pytest gets its settings and fixtures::

    pytest --kvparity-impl mypkg.cache:Factory -m kvparity --pyargs kvparity

runs kvparity's suites (the catalog at each level, the generated schedules,
the negative-control self-check) against that class, and a team's own tests
can run schedules through ``kvparity_run`` and gate them with
``kvparity_assert``. Every test collected from kvparity's package carries the
``kvparity`` marker.

Each setting comes from the command line (``--kvparity-NAME``), else from
``[tool.kvparity]`` in the repository's pyproject.toml (``NAME``), else its
default, resolved by ``reports/settings.py`` as the ``kvparity`` commands
resolve theirs. Relative paths in the file are read from its folder, on the
command line from the current directory. The header of the run and its
junit properties name the class under test and where each setting came from.

The plugin loads in every pytest run where kvparity is installed: the
harness (and MLX with it) is imported only when a kvparity fixture runs.
"""

import sys
from pathlib import Path
from typing import Optional

import pytest

import kvparity.reports
import kvparity.suites
from kvparity.reports import settings

# The folders kvparity's tests are collected from.
TEST_FOLDERS = tuple(Path(p.__file__).resolve().parent for p in (kvparity.suites, kvparity.reports))
# In a checkout those folders sit beside pyproject.toml, and the harness's
# own tests run too; installed, only the suites that gate an implementation
# are collected (the rest test the harness on its sources).
CHECKOUT = (TEST_FOLDERS[0].parent / "pyproject.toml").is_file()
# The test modules that gate the implementation under test, and the level
# each runs (None: the levels of its schedules).
GATE_MODULES = {
    "test_l1_catalog": "L1", "test_l1_stateful": "L1", "test_negative_controls": "L1",
    "test_l2_catalog": "L2", "test_l2_stateful": "L2",
    "test_l3": "L3", "test_l3_controls": "L3",
    "test_schedule_dirs": None,
}
MARKERS = (
    "kvparity: a test of kvparity's own package (select them with -m kvparity)",
    "slow: long-running checks kept out of the default run (CI runs them separately)",
    "real_model: runs the real SmolLM2-135M model (slower; CI runs it in its own step)",
    "benchmark_suite: pytest-benchmark measurements (CI runs a short version)",
    "matrix: the matrix's reproduction scripts and published engines, each run where its package's version is "
    "installed (its row's environment); skipped elsewhere",
    "sweep: the sweep of every mlx-lm module at L2, L3 and L4 beyond CI's share (suites/test_sweep.py; about an "
    "hour on 2 cores)",
    "gqa_batched: drives mlx-lm's batched attention on a grouped-query model; skipped, naming the defect, where "
    "the installed mlx-lm's is wrong (oracle/mlx_lm_versions.py)",
)
SHOWN = 5  # divergences quoted in a failure
DEFAULT_EXAMPLES = 300  # generated L1 schedules


# The settings pytest takes as --kvparity-NAME, declared in reports/settings.py.
SETTINGS = {name: s for name, s in settings.SETTINGS.items() if s.plugin}
SETTINGS_KEY = pytest.StashKey[settings.Settings]()


def pytest_addoption(parser):
    group = parser.getgroup("kvparity", "kvparity: parity of a batched quantized KV cache")
    for s in SETTINGS.values():
        group.addoption(f"--kvparity-{s.name}", dest=s.dest, default=None, metavar=s.metavar,
                        help=f"{s.help} (default: {s.default})")


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    try:  # bad settings are refused before anything is collected
        config.stash[SETTINGS_KEY] = settings.Settings.of(settings.resolve(
            {name: config.getoption(s.dest) for name, s in SETTINGS.items()}, SETTINGS,
            start=config.invocation_params.dir))
    except settings.SettingsError as error:
        raise pytest.UsageError(str(error)) from None
    if stashed_settings(config).schedules is not None:
        config.stash[THEIR_SCHEDULES] = their_schedules(config)


def stashed_settings(config) -> settings.Settings:
    """The run's settings, resolved once (``pytest_configure``): the command line, [tool.kvparity],
    the environment, or the default."""
    return config.stash[SETTINGS_KEY]


def pytest_report_header(config):
    """What is under test and where each setting came from, where kvparity is configured."""
    if SETTINGS_KEY in config.stash and stashed_settings(config).impl is not None:
        return [f"kvparity {line}" for line in stashed_settings(config).configuration.lines()]
    return None


def in_package(path: Path) -> bool:
    return any(folder in Path(path).resolve().parents for folder in TEST_FOLDERS)


def pytest_ignore_collect(collection_path, config):
    """Installed, only the gate's modules are collected from kvparity's package."""
    if CHECKOUT or not in_package(collection_path) or collection_path.suffix != ".py":
        return None
    if collection_path.name.startswith("test_") and collection_path.stem not in GATE_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Mark kvparity's tests, deselect the gate's suites of levels not chosen,
    and skip the gqa_batched ones where the installed mlx-lm is defective."""
    skip_defective_gqa(items)
    chosen = stashed_settings(config).levels
    kept, dropped = [], []
    for item in items:
        path = Path(str(item.path))
        if not in_package(path):
            kept.append(item)
            continue
        item.add_marker(pytest.mark.kvparity)
        level = GATE_MODULES.get(path.stem)
        (dropped if level is not None and level not in chosen else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def skip_defective_gqa(items):
    """Tests marked gqa_batched drive mlx-lm's batched attention on a
    grouped-query model, which a defective mlx-lm gets wrong whatever the
    cache holds: there they are skipped, the defect as the reason. mlx-lm is
    asked only when such a test was collected."""
    marked = [item for item in items if item.get_closest_marker("gqa_batched") is not None]
    if not marked:
        return
    from kvparity.oracle.mlx_lm_versions import defects_for

    defects = defects_for(n_heads=4, n_kv_heads=2)
    if defects:
        skip = pytest.mark.skip(reason="; ".join(d.attribution() for d in defects))
        for item in marked:
            item.add_marker(skip)


THEIR_SCHEDULES = pytest.StashKey[list]()


def their_schedules(config) -> list:
    """(path, level) of each schedule file in the folders --kvparity-schedules
    names, at each chosen level that takes it; every file is checked before
    anything runs. A folder without schedule files is a usage error."""
    from kvparity.suites.format.errors import ScheduleError
    from kvparity.suites.runners import RUNNERS, load_schedule

    chosen, cases = stashed_settings(config).levels, []
    for folder in (Path(v) for v in stashed_settings(config).schedules.split(",")):
        paths = sorted(folder.glob("*.json"))
        if not paths:
            raise pytest.UsageError(f"--kvparity-schedules {folder}: no schedule files (*.json) there")
        for path in paths:
            try:
                schedule = load_schedule(path)
            except ScheduleError as error:
                raise pytest.UsageError(str(error)) from None
            cases += [(path, level) for level in chosen if RUNNERS[level].takes(schedule)]
    return cases


def pytest_generate_tests(metafunc):
    """``kvparity_schedule``: each (file, level) of ``their_schedules``."""
    if "kvparity_schedule" not in metafunc.fixturenames:
        return
    cases = metafunc.config.stash.get(THEIR_SCHEDULES, None)
    if cases is None:
        metafunc.parametrize("kvparity_schedule", [pytest.param(
            None, marks=pytest.mark.skip(reason="no schedule folders given (--kvparity-schedules)"))])
        return
    metafunc.parametrize("kvparity_schedule", [pytest.param(c, id=f"{c[0].stem}-{c[1]}") for c in cases])


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def implementation(pytestconfig, record_testsuite_property):
    """The implementation under test (``suites.adapter.Implementation``),
    once MLX's default device has passed its known-answer check."""
    from kvparity.oracle.known_answer import checked
    from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE
    from kvparity.suites.core.raised import ImplementationError
    from kvparity.suites.core.adapter import load_implementation

    chosen = stashed_settings(pytestconfig)
    spec = chosen.impl
    if spec is None:
        pytest.exit(f"kvparity: {settings.no_implementation(chosen.configuration, '--kvparity-impl')}",
                    returncode=4)
    for name, value in chosen.configuration.values.items():  # junit's <properties>
        record_testsuite_property(f"kvparity.{name}", value.value if value.value is not None else "(default)")
        record_testsuite_property(f"kvparity.{name}.from", value.source)
    answer = checked()
    record_testsuite_property("kvparity.known_answer", answer.summary)
    if not answer.passed:
        pytest.exit(f"kvparity: cannot judge here: {answer.summary}", returncode=EXIT_CANNOT_JUDGE)
    # As on the command line, the repository under test can import its own modules.
    if str(pytestconfig.rootpath) not in sys.path:
        sys.path.insert(0, str(pytestconfig.rootpath))
    try:
        return load_implementation(spec)
    except ImplementationError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def engine(pytestconfig) -> Optional[str]:
    """L3's engine, ``package.module:factory``; None for mlx-lm's BatchGenerator."""
    return stashed_settings(pytestconfig).engine


@pytest.fixture(scope="session")
def policy(pytestconfig):
    from kvparity.reports.policy import PolicyError, load_policy

    try:  # as on the command line: by default, the backend's
        return load_policy(stashed_settings(pytestconfig).policy)
    except PolicyError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def expectations(pytestconfig):
    from kvparity.reports.expectations import ExpectationsError, load_expectations

    path = stashed_settings(pytestconfig).expectations
    try:
        return None if path is None else load_expectations(path)
    except ExpectationsError as error:
        pytest.exit(str(error), returncode=4)


@pytest.fixture(scope="session")
def generated_examples(pytestconfig) -> int:
    """How many L1 schedules the generator runs (the examples setting: its option, the table, or
    KVPARITY_FUZZ_EXAMPLES)."""
    chosen = stashed_settings(pytestconfig)
    value = chosen.examples or str(DEFAULT_EXAMPLES)
    if not value.isdigit() or int(value) < 1:
        source = chosen.source("examples")
        where = "--kvparity-examples" if source == settings.COMMAND_LINE else f"examples (from {source})"
        raise pytest.UsageError(f"{where} {value!r}: expected a positive integer")
    return int(value)


@pytest.fixture(scope="module")
def smollm2():
    """The real model, fetched once; its suites skip, saying why, where it cannot be had."""
    from kvparity.oracle.models import ModelUnavailable, load_model

    try:
        return load_model("smollm2")
    except ModelUnavailable as error:
        pytest.skip(str(error))


def describe(judged) -> str:
    """A schedule run's verdict (``reports.verdicts.judge``) in words: each
    row that did not pass, and its first divergences."""
    from kvparity.suites.core.evidence import PASS

    result = judged.evidence
    lines = [f"{result.level} {result.schedule}: {judged.verdict} ({result.path})"]
    if result.reason:
        lines.append(f"  {result.reason}")
    for row in judged.rows:
        if row.verdict != PASS:
            divergences = sorted(row.evidence.divergences, key=lambda d: d.order)
            lines.append(f"  row {row.evidence.request!r}: {row.verdict}, {row.evidence.checks} comparisons"
                         + (f"; {row.reason}" if row.reason else ""))
            lines += [f"    {d.message()}" for d in divergences[:SHOWN]]
    return "\n".join(lines)


def assert_parity(judged):
    """Pass with evidence, skip as not supported, or fail saying why: a
    missing capability is never a pass, and neither is a run that compared
    nothing. Returns the verdict."""
    from kvparity.suites.core.evidence import EXPECTED_DIVERGENCE, NOT_SUPPORTED, PASS

    __tracebackhide__ = True  # a failure points at the test that asked
    if judged.verdict == NOT_SUPPORTED:
        pytest.skip(f"not supported: {judged.evidence.reason}")
    if judged.verdict not in (PASS, EXPECTED_DIVERGENCE):
        raise AssertionError(describe(judged))
    return judged


@pytest.fixture(scope="session")
def judged():
    """``judged(result, policy="cpu")``: the verdict of a run under a policy
    (a name, a file or a Policy), its evidence as ``.evidence``. The suites
    gather evidence; the verdict is the reports' business, handed to them here."""
    from kvparity.reports.policy import Policy, load_policy
    from kvparity.reports.verdicts import judge

    def verdict(result, under="cpu"):
        return judge(result, under if isinstance(under, Policy) else load_policy(under))

    return verdict


@pytest.fixture(scope="session")
def gate(policy, expectations):
    """``gate(result)``: ``assert_parity`` of the run judged under the
    policy; divergences the expectations declare do not gate."""
    from kvparity.reports.verdicts import judge

    def check(result, under=None):
        return assert_parity(judge(result, under or policy, expectations))

    return check


@pytest.fixture(scope="session")
def kvparity_run(implementation, engine, policy, expectations):
    """``kvparity_run(schedule, level="L1")``: run a schedule file (a path) or
    a schedule written as a dict on the implementation under test at that
    level; returns the verdict (``reports.verdicts.ScheduleVerdict``) under
    the policy and expectations, its evidence as ``.evidence``. A schedule
    the level does not take is a usage error before anything runs."""
    from kvparity.reports.verdicts import judge
    from kvparity.suites.runners import RUNNERS, RunOptions, load_schedule, schedule_of

    def run(schedule, level="L1"):
        if level not in RUNNERS:
            raise pytest.UsageError(f"kvparity_run: level {level!r}: expected one of {', '.join(RUNNERS)}")
        loaded = schedule_of(schedule, "<inline schedule>") if isinstance(schedule, dict) else load_schedule(schedule)
        runner = RUNNERS[level]
        if not runner.takes(loaded):
            raise pytest.UsageError(f"kvparity_run: {loaded.path or loaded.name}: not a schedule {level} runs")
        return judge(runner.run(loaded, implementation, RunOptions(engine=engine)), policy, expectations)

    return run


@pytest.fixture(scope="session")
def kvparity_assert():
    """``kvparity_assert(verdict)``: ``assert_parity``, for a team's own tests."""
    return assert_parity
