"""The settings of a kvparity run, declared once and resolved one way for
every entry point: the ``kvparity`` commands and the pytest plugin.

Each setting comes from the command line, else from ``[tool.kvparity]`` in
the repository's pyproject.toml (the nearest one from the current directory
upward, as pytest looks for its rootdir), else from its environment variable
where it has one, else its default. A resolved value remembers where it came
from, and every run says so: console, report, junit. ``Settings`` is what a
command was asked to do, resolved once and immutable: what every part of a
run reads.

The implementation under test has no default: with none given, a command
that needs one refuses (a usage error), naming both ways to give it.
kvparity's own checkout names its reference in its pyproject.toml.

A relative path in the file is read from the file's folder; on the command
line, from the current directory.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Tuple

from kvparity.oracle.inputs import read_toml
from kvparity.suites.format.levels import CACHE_LEVELS, LEVELS

if TYPE_CHECKING:  # a run's modules: the pytest plugin reads these settings without importing them
    from kvparity.suites.l4.server import ServerUnderTest
    from kvparity.suites.runners import RunOptions

COMMAND_LINE = "command line"
DEFAULT = "default"
TABLE = "[tool.kvparity]"
ALL_LEVELS = "all"
REFERENCE_HINT = "kvparity's own reference is kvparity.impl.batch_quantized:BatchQuantizedKVCache"

TEXT, LIST, PATH, PATHS, COUNT = "text", "list", "path", "paths", "count"
# Generated schedules kvparity run and check run after the catalog, by default: 8 to 10 s of CPU on the
# reference (docs/ci-and-bisect.md, "The generated budget").
GENERATED = 100


class SettingsError(Exception):
    """A setting that cannot be used: a usage error, before any work."""


@dataclass(frozen=True)
class Setting:
    name: str  # the key in [tool.kvparity]; pytest's --kvparity-NAME
    metavar: str
    help: str
    default: str  # the default in words (its value is None: the command's own meaning)
    kind: str = TEXT  # how a value is read from the file: TEXT, LIST, PATH, PATHS or COUNT
    option: Optional[str] = None  # the kvparity commands' option; None: the plugin's alone
    plugin: bool = True  # the pytest plugin reads it, as --kvparity-NAME
    environment: Optional[str] = None  # the variable read where neither the command line nor the file gives it

    @property
    def dest(self) -> str:  # pytest's dest; the commands' is the option's
        return f"kvparity_{self.name}"


SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    Setting("impl", "MODULE:FACTORY", "the batch cache class under test (a class, or a factory returning one), "
            "or exec:COMMAND, a cache in a process of its own (docs/process-protocol.md)",
            "none: required", option="--impl"),
    Setting("levels", ",".join(LEVELS), f"the levels that run: all ({', '.join(CACHE_LEVELS)}), or some of "
            f"{', '.join(LEVELS)} (L4 with a server)", "all", LIST,
            "--level"),
    Setting("engine", "MODULE:FACTORY", "L3: the engine serving arrivals", "mlx-lm's BatchGenerator",
            option="--engine"),
    Setting("model", "NAME", "the model L2 runs on", "each schedule's own", option="--model", plugin=False),
    Setting("device", "cpu|gpu", "the MLX device", "MLX's default", option="--device", plugin=False),
    Setting("policy", "NAME|FILE", "verdict policy: cpu, gpu, strict or a policy file", "this backend's",
            PATH, "--policy"),
    Setting("expectations", "FILE", "declared divergences (JSON) of the implementation: they do not gate",
            "none", PATH, "--expectations"),
    Setting("equivalents", "FILE", "kvparity mutate: the mutants of the cache no caller can observe, each with "
            "its reason (TOML)", "none", PATH, "--equivalents", plugin=False),
    Setting("schedules", "DIR[,DIR]", "folders of your own schedule files, run at their levels", "none", PATHS),
    Setting("examples", "N", "generated L1 schedules", "300", COUNT, environment="KVPARITY_FUZZ_EXAMPLES"),
    Setting("generated", "N", "generated L1 schedules kvparity run and check run after the catalog (0: none)",
            str(GENERATED), COUNT, "--generated", plugin=False),
    Setting("generated_database", "DIR", "a Hypothesis example database kept between runs: its saved failures "
            "are tried first", "none", PATH, "--generated-database", plugin=False),
)}


@dataclass(frozen=True)
class Value:
    value: Optional[str]  # None: the default
    source: str  # COMMAND_LINE, the pyproject.toml's path, "environment NAME", or DEFAULT


@dataclass(frozen=True)
class Configuration:
    """The resolved settings, each with where it came from."""

    values: Mapping[str, Value]
    pyproject: Optional[Path]  # the file looked in, None where there is none

    def __getitem__(self, name: str) -> Optional[str]:
        return self.values[name].value

    def source(self, name: str) -> str:
        return self.values[name].source

    def shown(self, name: str, resolved: Optional[str] = None) -> str:
        """``NAME VALUE (from SOURCE)``; a default in words (or as the
        command resolved it, e.g. the backend's policy)."""
        value = self.values[name]
        if value.value is not None:
            return f"{name} {value.value} ({'from ' if value.source != COMMAND_LINE else ''}{value.source})"
        default = SETTINGS[name].default
        return f"{name} {resolved} (default: {default})" if resolved else f"{name} {default} (default)"

    def lines(self, resolved: Optional[Mapping[str, str]] = None) -> list:
        """The console's two lines: the class under test, then the rest."""
        resolved = resolved or {}
        rest = [self.shown(n, resolved.get(n)) for n in self.values if n != "impl"]
        lines = [f"under test: {self.shown('impl')}"] if "impl" in self.values else []
        return lines + ([f"settings: {'; '.join(rest)}"] if rest else [])

    def to_json(self) -> dict:
        return {"pyproject": None if self.pyproject is None else str(self.pyproject),
                "settings": {n: {"value": v.value, "from": v.source} for n, v in self.values.items()}}


def find_pyproject(start=None) -> Optional[Path]:
    """The nearest pyproject.toml from ``start`` (the current directory) upward."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder / "pyproject.toml"
    return None


def read_table(path: Path) -> dict:
    """``[tool.kvparity]`` of ``path`` ({} without one), every key known."""
    doc = read_toml(path, SettingsError)
    table = doc.get("tool", {}).get("kvparity", {})
    if not isinstance(table, dict):
        raise SettingsError(f"{path}: {TABLE}: expected a table")
    unknown = sorted(set(table) - set(SETTINGS))
    if unknown:
        raise SettingsError(f"{path}: {TABLE}: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    return table


def from_file(setting: Setting, value, path: Path) -> str:
    """A value of the file as the command line would spell it."""
    where = f"{path}: {TABLE} {setting.name}"
    if setting.kind == COUNT:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SettingsError(f"{where}: expected a whole number, got {value!r}")
        return str(value)
    many = setting.kind in (LIST, PATHS)
    items = value if many and isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise SettingsError(f"{where}: expected {'a string or a list of strings' if many else 'a string'}, "
                            f"got {value!r}")
    if setting.kind in (PATH, PATHS):
        folder = path.parent
        items = [v if setting.name == "policy" and not v.endswith(".json") else str(folder / v) for v in items]
    return ",".join(v.strip() for v in items)


def check_levels(value: str, source: str) -> None:
    chosen = [v.strip() for v in value.split(",")]
    if value.strip() != ALL_LEVELS and not all(v in LEVELS for v in chosen):
        where = "" if source == COMMAND_LINE else f"{source}: {TABLE} "
        raise SettingsError(f"{where}levels {value!r}: expected some of {', '.join(LEVELS)}, or {ALL_LEVELS}")


def levels_of(value: Optional[str]) -> tuple:
    """The levels a ``levels`` value names (None or ``all``: every level)."""
    if value is None or value.strip() == ALL_LEVELS:
        return CACHE_LEVELS
    return tuple(dict.fromkeys(v.strip() for v in value.split(",")))


def resolve(given: Mapping[str, Optional[str]], names=None, start=None) -> Configuration:
    """The settings ``names`` (default: all): ``given`` on the command line
    (None where not given), else the pyproject.toml's, else the default."""
    names = tuple(SETTINGS if names is None else names)
    pyproject = find_pyproject(start)
    # The whole table is checked, also what the command line overrides: a bad file is bad input.
    table = {} if pyproject is None else {
        name: Value(from_file(SETTINGS[name], value, pyproject), str(pyproject))
        for name, value in read_table(pyproject).items()}
    if given.get("levels") is not None:
        check_levels(str(given["levels"]), COMMAND_LINE)
    if "levels" in table:
        check_levels(table["levels"].value, table["levels"].source)
    values = {name: Value(str(given[name]), COMMAND_LINE) if given.get(name) is not None
              else table.get(name) or from_environment(SETTINGS[name]) for name in names}
    return Configuration(values, pyproject)


def from_environment(setting: Setting) -> Value:
    """The setting's environment variable, where it has one and it is set; else the default."""
    value = os.environ.get(setting.environment, "").strip() if setting.environment else ""
    return Value(value, f"environment {setting.environment}") if value else Value(None, DEFAULT)


def no_implementation(configuration: Configuration, option="--impl") -> str:
    """Why a run without an implementation under test is refused, in one line."""
    where = (f"no pyproject.toml from {Path.cwd()} upward" if configuration.pyproject is None
             else f"{configuration.pyproject} has no {TABLE} impl")
    return (f"no implementation under test ({where}): name it with {option} package.module:factory, "
            f"or in pyproject.toml as {TABLE} impl = \"package.module:factory\"; {REFERENCE_HINT}")


@dataclass(frozen=True)
class Settings:
    """What one command was asked to do, resolved once before it starts
    (``kvparity.reports.commands.base.settings_of``: the command line, else
    ``[tool.kvparity]``, else the environment or the default; the server's
    options checked),
    and never changed after. Levels, runners, reports and the action read
    it; only the command handlers read the parsed command line. A field a
    command has no option for keeps its default."""

    configuration: Optional[Configuration] = None  # where each table setting came from; None: the command reads none
    impl: Optional[str] = None
    levels_said: str = ALL_LEVELS  # the levels as given (all, or a comma list): ``levels`` reads them
    required_levels: Tuple[str, ...] = ()  # --require-levels, each among ``levels``
    engine: Optional[str] = None
    model: Optional[str] = None
    models: Tuple[str, ...] = ()  # the architecture axis (--models); none where a model is forced
    device: Optional[str] = None
    on_device: bool = False  # the command runs on an MLX device it checks (it has --device)
    policy: Optional[str] = None
    expectations: Optional[str] = None
    equivalents: Optional[str] = None
    generated: Optional[str] = None  # as given: ``budget_of`` reads it as a count
    generated_database: Optional[str] = None
    repeat_oracle: Optional[bool] = None  # None: on where the device is a GPU
    server: Optional["ServerUnderTest"] = None  # L4: the server under test
    out: Optional[str] = None  # --out: the report directory (run, check, fuzz), a file (bisect, mutate)
    shard: Optional[str] = None  # --shard K/N as given
    exit_first: bool = False
    member_timeout: Optional[float] = None  # None: the command sets no limit
    argv: Tuple[str, ...] = ()  # the command line as given: a run on workers hands it on

    examples: Optional[str] = None  # the pytest plugin's: generated L1 schedules
    schedules: Optional[str] = None  # the pytest plugin's: folders of the user's schedule files

    @classmethod
    def of(cls, configuration: Optional[Configuration], **own) -> "Settings":
        """The table settings as ``configuration`` resolved them (each its
        field of the same name, ``levels`` as ``levels_said``; None: none),
        beside a command's ``own`` fields."""
        table = {} if configuration is None else {name: configuration[name] for name in configuration.values}
        if "levels" in table:
            table["levels_said"] = table.pop("levels") or ALL_LEVELS
        return cls(configuration=configuration, **{**table, **own})

    @property
    def levels(self) -> Tuple[str, ...]:
        """The levels the command runs, as level names."""
        return levels_of(self.levels_said)

    @property
    def level(self) -> str:
        """The one level of a command that runs one (replay, bisect, fuzz)."""
        return self.levels[0]

    def reads(self, name: str) -> bool:
        """The command reads the table setting ``name``."""
        return self.configuration is not None and name in self.configuration.values

    def source(self, name: str) -> str:
        """Where the table setting ``name`` came from."""
        return self.configuration.source(name) if self.reads(name) else COMMAND_LINE

    @property
    def judges_a_server_only(self) -> bool:
        """Every level the command runs judges the server given (L4): no class is under test."""
        return self.server is not None and all(LEVELS[name].needs_server for name in self.levels)

    def run_options(self, use_cache: bool = True) -> "RunOptions":
        """What each level's runner is told (``suites.runners``)."""
        from kvparity.suites.runners import RunOptions

        return RunOptions(model=self.model, engine=self.engine, repeat_oracle=self.repeat_oracle,
                          use_cache=use_cache, models=self.models, server=self.server)
