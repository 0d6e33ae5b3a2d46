"""What every command shares: the two refusals, the options they have in
common, and loading what a command names (an implementation, a model, a
policy, an expectations file, a device, an output path), each refused with
a clear error before any work."""

import argparse
import math
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from kvparity.oracle import known_answer
from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.oracle.models import (
    DEEP, DEFAULT_MODEL, MHA, ModelPathError, ModelUnavailable, available_models, is_model_path, path_exists,
    random_model,
)
from kvparity.oracle.models import load_model as load_registry_model
from kvparity.reports import git_bisect, settings
from kvparity.reports.settings import Settings
from kvparity.reports.expectations import ExpectationsError, load_expectations
from kvparity.reports.policy import PolicyError, load_policy
from kvparity.suites.core.raised import ImplementationError, ImplementationUnavailable
from kvparity.suites.core.adapter import load_implementation, split_spec
from kvparity.suites.l3.engines import EngineError, load_engine_factory
from kvparity.suites.l4.client import REQUEST_TIMEOUT
from kvparity.suites.l4.server import RUN_TIMEOUT
from kvparity.suites.format.levels import L2, L3, L4, LEVELS
from kvparity.suites.runners import model_set


class CannotRun(Exception):
    """Exit 125: nothing is wrong with parity, it cannot be judged here."""


class DeviceUntrusted(CannotRun):
    """Exit 125: the device failed its known-answer check (oracle/known_answer.py)."""


class UsageError(Exception):
    """Exit 129 (EXIT_USAGE): the command line, a setting or an input file is
    wrong; above 127, so that git bisect run aborts instead of blaming a commit."""


# The settings of a run of schedules (reports/settings.py), each with its option below.
RUN_SETTINGS = ("impl", "levels", "engine", "model", "device", "policy", "expectations")
GATE_SETTINGS = RUN_SETTINGS + ("generated", "generated_database")  # run and check: the catalog, then a generated budget

# -- options ---------------------------------------------------------------------------

IMPL_HELP = ("implementation under test as package.module:factory, or exec:COMMAND for a cache in a process of "
             "its own (default: impl in [tool.kvparity] of pyproject.toml; required)")
LEVEL_HELP = "L1 cache bytes, L2 model per row, L3 a real engine serving arrivals (default: %(default)s)"
LEVELS_HELP = ("levels that run: L1 cache bytes, L2 model per row, L3 a real engine serving arrivals; all, one, "
               "or a comma list (default: levels in [tool.kvparity], else all)")
DEVICE_HELP = "MLX device (default: MLX's default)"


def seconds(text: str) -> float:
    """An option's value in seconds: a finite number above 0 (argparse
    refuses anything else as a usage error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, a finite number above 0")
    return value


def model_help() -> str:
    return (f"run L2 and L3 on this model: one of {', '.join(available_models())} (smollm2 runs the real-model "
            f"schedules; a random model's name may end in {MHA} or {DEEP}), a local model directory in the layout "
            "mlx_lm.load reads, or a config.json (a tiny random twin of its architecture); default: each "
            "schedule's own, a seeded random model")


def common_options(command, levels=(*LEVELS, "all"), default_level=None):
    """--impl, --level, --repeat-oracle, --engine, --model, --device and
    --policy, as far as the command's levels use them. Without a
    ``default_level``, --level is the ``levels`` setting (checked in
    ``settings_of``); with one, the command's own choice of one level."""
    command.add_argument("--impl", metavar="MODULE:FACTORY", help=IMPL_HELP)
    if levels and default_level is None:
        command.add_argument("--level", metavar="LEVELS", help=LEVELS_HELP)
    elif levels:
        command.add_argument("--level", choices=levels, default=default_level, help=LEVEL_HELP)
    if levels is None or L2 in levels:
        command.add_argument("--repeat-oracle", action=argparse.BooleanOptionalAction, default=None,
                             help="run every solo trace twice and require equal bytes "
                             "(default: on when the device is a GPU)")
    if levels and L4 in levels:
        server_options(command)
    if levels and L3 in levels:
        command.add_argument("--engine", metavar="MODULE:FACTORY",
                             help="L3 engine as package.module:factory (default: mlx-lm's BatchGenerator)")
    command.add_argument("--model", metavar="NAME", help=model_help())
    if levels is None or L2 in levels:
        command.add_argument("--models", metavar="SET", default="default",
                             help="the architecture axis: the catalog schedules it names also run on these "
                             "architectures of mlx-lm's zoo: default (a hybrid, keys and values of different "
                             "widths, head_dim 256), all (every architecture; see kvparity models), none, or "
                             "names, comma-separated (default: %(default)s; not with --model or --schedule)")
    command.add_argument("--device", choices=("cpu", "gpu"), help=DEVICE_HELP)
    command.add_argument("--policy", metavar="NAME|FILE",
                         help="verdict policy: cpu, gpu, strict or a policy file (default: this backend's)")


def server_options(command):
    """L4: the server under test and what it declares."""
    group = command.add_argument_group("L4, a server over HTTP")
    group.add_argument("--server", metavar="COMMAND",
                       help="start this server for each L4 run, on a free loopback port: a command line with "
                       "{model} (the model directory) and {port}, e.g. 'python -m mlx_lm server --model {model} "
                       "--port {port}'")
    group.add_argument("--url", help="L4 against a server you run, on a loopback address (http://127.0.0.1:PORT); "
                       "it must serve the model kvparity model-dir writes")
    group.add_argument("--kv-bits", type=int, metavar="N",
                       help="the KV bits the server declares (as given in its command); none: a dense server")
    group.add_argument("--kv-group-size", type=int, default=64, metavar="N", help="with --kv-bits (default: 64)")
    group.add_argument("--quantized-kv-start", default="0", metavar="N|first",
                       help="with --kv-bits: the token from which the server converts its cache as mlx-lm's "
                       "kv_bits does (a dense prefill, then quantized), or first: quantized from the first token, "
                       "as BatchGenerator(kv_bits) and most batched servers do (default: 0)")
    group.add_argument("--prefill-step-size", type=int, default=2048, metavar="N",
                       help="the server's prefill chunk, which mlx-lm's solo run repeats (default: 2048, "
                       "mlx_lm.server's)")
    group.add_argument("--concurrency", type=int, default=8, metavar="N",
                       help="requests in flight at most (default: 8)")
    group.add_argument("--ready-timeout", type=seconds, default=300.0, metavar="SECONDS",
                       help="how long a started server may take to answer (default: 300)")
    group.add_argument("--request-timeout", type=seconds, default=REQUEST_TIMEOUT, metavar="SECONDS",
                       help="how long one request may take, whole (a stream to its end); one that takes longer is "
                       "the server's FAIL (default: %(default)g)")
    group.add_argument("--run-timeout", type=seconds, default=RUN_TIMEOUT, metavar="SECONDS",
                       help="how long one L4 schedule run's servers and requests may take together; the requests "
                       "still unanswered then are the server's FAIL (default: %(default)g)")
    group.add_argument("--prompt-cache-off", metavar="ARGS", default="",
                       help="what turns the server's prompt cache off, added to its command for the server that "
                       "answers each request alone, e.g. '--prompt-cache-size 0' for mlx_lm.server: then one server "
                       "answers them all, one at a time; without it, a fresh server per conversation")


def server_of(given):
    """L4's server from its options (``given``: the option's dest -> value), checked before anything runs;
    None without one."""
    from kvparity.suites.l4.server import FIRST, ServerUnderTest
    from kvparity.suites.l4.server_process import ServerUsageError, command_line, loopback_url

    command, url = given.get("server"), given.get("url")
    if command is None and url is None:
        return None
    if command is not None and url is not None:
        raise UsageError("--server and --url: give one (a server kvparity starts, or one you run)")
    off = given.get("prompt_cache_off", "")
    if off and url is not None:
        raise UsageError("--prompt-cache-off: with --server only (a server you run keeps the flags it was started with)")
    try:
        if command is not None:
            command_line(f"{command} {off}", "MODEL", 1)
        else:
            url = loopback_url(url)
    except ServerUsageError as error:
        raise UsageError(str(error))
    start = given["quantized_kv_start"]
    if start == FIRST:
        start = None
    elif not start.isdigit():
        raise UsageError(f"--quantized-kv-start {start}: expected a token index (0 or more) or {FIRST}")
    else:
        start = int(start)
    for name in ("kv_bits", "kv_group_size", "prefill_step_size", "concurrency"):
        value = given[name]
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: expected 1 or more")
    return ServerUnderTest(command, url, given["kv_bits"], given["kv_group_size"], start, given["prefill_step_size"],
                           given["concurrency"], given["ready_timeout"], given["request_timeout"],
                           given["run_timeout"], prompt_cache_off=off.strip(),
                           models_under=Path(given.get("out") or OUTPUT_ROOT))


def expectations_option(command):
    command.add_argument("--expectations", metavar="FILE",
                         help="declared divergences (JSON): what matches one is an expected divergence and does not "
                         "gate; every other check still gates (see docs/levels-and-checks.md)")


def models_of(given: str):
    """The architecture axis (``--models``) as model names."""
    try:
        return model_set(given)
    except ValueError as error:
        raise UsageError(str(error))


# -- the settings: command line, else [tool.kvparity], else the environment or the default --


def dest_of(name: str) -> str:
    """The argparse dest of a setting's option: --level is ``level``."""
    return settings.SETTINGS[name].option.lstrip("-").replace("-", "_")


def settings_of(args) -> Settings:
    """The command's settings, resolved once before its handler runs: each
    table setting it reads (``args.reads_settings``) from the command line,
    else [tool.kvparity], else the environment or the default
    (``settings.resolve``), and its own options beside them, each checked. A
    required setting missing everywhere is a usage error. With the
    handlers, the one reader of the parsed command line."""
    given, names = vars(args), args.reads_settings
    try:  # a command that reads none (merge, matrix) does not read the file either
        configuration = settings.resolve({n: given.get(dest_of(n)) for n in names}, names) if names else None
    except settings.SettingsError as error:
        raise UsageError(str(error))
    own = {}
    if "levels" not in names and "level" in given:  # a command's own choice of one level (bisect, fuzz)
        own.update(levels_said=given["level"])
    table = Settings.of(configuration, **own)  # then the command's own options, beside the table's
    chosen = replace(
        table,
        required_levels=required_levels(given.get("require_levels"),
                                        table.levels_said if "level" in given else None),
        models=models_of(given["models"]) if "models" in given and not table.model else (),
        on_device="device" in given, repeat_oracle=given.get("repeat_oracle"),
        server=server_of(given) if "server" in given else None, out=given.get("out"), shard=given.get("shard"),
        exit_first=bool(given.get("exit_first")), member_timeout=given.get("member_timeout"),
        argv=tuple(given.get("argv", ())),
    )
    if "impl" in args.requires_settings and chosen.impl is None and not chosen.judges_a_server_only:
        raise UsageError(settings.no_implementation(configuration))
    return chosen


def required_levels(given, levels_said) -> tuple:
    """--require-levels as level names, each among those --level runs
    (``levels_said``; None where the command has no --level); a usage error
    otherwise (before any work)."""
    if given is None:
        return ()
    named = tuple(v.strip() for v in given.split(",") if v.strip())
    unknown = [v for v in named if v not in LEVELS]
    if unknown or not named:
        raise UsageError(f"--require-levels {given!r}: expected some of {', '.join(LEVELS)}")
    outside = [v for v in named if levels_said is not None and v not in settings.levels_of(levels_said)]
    if outside:
        raise UsageError(f"--require-levels {given}: --level {levels_said} does not run {', '.join(outside)}")
    return named


def print_configuration(chosen: Settings, out=None, **resolved):
    """What is under test and where each setting came from, before the verdict."""
    if chosen.configuration is not None:
        lines = chosen.configuration.lines(resolved)
        if chosen.server is not None:  # L4: the server is under test (and a class, where one is named too)
            lines.insert(0, f"server under test: {chosen.server.name}")
            if chosen.judges_a_server_only:
                lines = [line for line in lines if not line.startswith("under test:")]
        print("\n".join(lines), file=out or sys.stdout)
    if chosen.on_device:  # the command runs on a device use_device checked
        print(f"device: {known_answer.checked().summary}", file=out or sys.stdout)


# -- what the options name ---------------------------------------------------------------


def check_impl_spec(spec):
    """The shape of --impl, checked before any work (the import is later)."""
    if spec is not None:
        try:
            split_spec("--impl", spec)
        except ImplementationError as error:
            raise UsageError(str(error))


def implementation(spec):
    """The implementation under test, or a refusal: a module that does not
    import here cannot be judged (125), unless a git bisection is running
    whose bad commit does not hold that module either: then it is a typo
    (or a package not installed) at every commit, a usage error that aborts
    the bisection rather than skipping every commit."""
    if spec is None:
        raise UsageError(settings.no_implementation(settings.resolve({}, ("impl",))))
    check_impl_spec(spec)
    # The repository under test is the working directory (as under git bisect run).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_implementation(spec)
    except ImplementationUnavailable as error:
        bad = git_bisect.bad_commit() if error.missing_module else None
        if bad is not None and not git_bisect.holds_module(bad, error.missing_module):
            raise UsageError(f"{error}; the bisection's bad commit {bad[:12]} has no {error.missing_module} "
                             "either: a typo in the module, or a package not installed")
        raise CannotRun(str(error))
    except ImplementationError as error:
        raise UsageError(str(error))


def check_engine(spec):
    try:
        load_engine_factory(spec)
    except EngineError as error:
        raise UsageError(str(error))


def check_model_name(name, what="--model"):
    """A name oracle.models.load_model knows: one of ``available_models`` or a random
    model's variant (``-mha``, ``-3layers``); or a model directory or a
    config.json, loaded here (once a process) so that one mlx-lm cannot
    read is refused before any work; ``what`` names where it was given."""
    if name is None:
        return
    if is_model_path(name):
        path = Path(name)
        if not path_exists(name):
            raise UsageError(f"{what} {name}: no such model directory or config.json")
        if path.is_dir() and not (path / "config.json").is_file():
            raise UsageError(f"{what} {name}: not a model directory (no config.json; expected the layout "
                             "mlx_lm.load reads)")
        if path.is_dir():
            check_weights_fit(path)
        try:
            load_registry_model(name)
        except ModelPathError as error:
            raise UsageError(str(error))
        except ModelUnavailable as error:  # mlx-lm cannot run it here (a backend, a package it needs)
            said = str(error)
            raise CannotRun(said if said.startswith(str(name)) else f"{name}: {said}")
        return
    if name not in available_models() and random_model(name) is None:
        raise UsageError(f"{what} {name!r}: unknown model (available: {', '.join(available_models())}; "
                         f"a random model's name may end in {MHA} or {DEEP}, or both in that order; or a model "
                         "directory or config.json by path)")


def load_model_or_refuse(name):
    """A model by name or path: an unknown name or a path mlx-lm cannot read
    is a usage error, one that cannot be fetched here cannot be judged."""
    check_model_name(name)
    try:
        return load_registry_model(name)
    except ModelUnavailable as error:
        raise CannotRun(str(error))


def check_weights_fit(directory: Path):
    """Refuse a model directory whose weights alone exceed the memory limit, before loading them."""
    from kvparity.oracle.model_path import read_config, weights_size
    from kvparity.suites.format.errors import ScheduleError
    from kvparity.suites.format.schedule import gib, memory_limit

    try:
        size = weights_size(directory, read_config(directory))
        limit, whence = memory_limit()
    except (ModelPathError, ScheduleError) as error:
        raise UsageError(str(error))
    if size.bytes > limit:
        raise UsageError(f"{directory}: {size.parameters / 1e6:.1f}M parameters, {gib(size.bytes)} of weights, over "
                         f"the limit of {gib(limit)} ({whence}): refused before loading")


def model_or_default(name):
    return load_model_or_refuse(name or DEFAULT_MODEL)


def use_device(name):
    """Run on ``name`` (None: MLX's default device), once it has passed its
    known-answer check: on a device that computes wrong numbers a batch and
    its solo run can agree, so nothing is judged there."""
    if name is not None:
        device = {"cpu": mx.cpu, "gpu": mx.gpu}[name]
        if not mx.is_available(device):
            raise CannotRun(f"--device {name}: this MLX build has no {name} backend")
        mx.set_default_device(device)
    answer = known_answer.checked()
    if answer.passed:
        return
    why = (f"{answer.summary}; a batch and its solo run could agree on wrong numbers here, so kvparity "
           "judges nothing on this device")
    if git_bisect.bad_commit() is not None:  # the same device at every commit: skipping them all helps no one
        raise UsageError(f"{why}; a git bisection cannot run here, so it is aborted")
    raise DeviceUntrusted(why)


def policy(chosen: Settings):
    """The policy the settings name, checked whole before anything runs."""
    try:
        return load_policy(chosen.policy)
    except PolicyError as error:
        raise UsageError(str(error))


def expectations(chosen: Settings):
    """The --expectations file, checked whole before anything runs; None without one."""
    path = chosen.expectations
    if path is None:
        return None
    try:
        return load_expectations(path)
    except ExpectationsError as error:
        raise UsageError(str(error))


def writable_directory(path, what, shown=None):
    """Refuse an --out that cannot be written, before any work. Tried, not
    inferred from permission bits (which say nothing for root, or for a
    read-only file system): a directory is made and removed where the output
    would go, or under the nearest folder that exists."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{what} {shown or path}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvparity-probe-", dir=existing))
    except OSError as error:
        where = "not writable" if existing == path else f"cannot create it under {existing}"
        raise UsageError(f"{what} {shown or path}: {where} ({error.strerror or error})")


def new_path(path, what):
    """Refuse an output path that exists or cannot be created, before any work."""
    path = Path(path)
    if path.exists():
        raise UsageError(f"{what} {path}: exists (never overwritten)")
    writable_directory(path.parent, what, shown=path)
