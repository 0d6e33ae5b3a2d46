"""The environment a run happened in, for report headers: the machine, the
git commit of the working directory, the implementation and the model."""

import subprocess
from importlib.metadata import PackageNotFoundError, packages_distributions, version

from kvparity.oracle import known_answer
from kvparity.oracle.machine import environment

# The run's environment names the model the L0 probes were shaped after;
# each schedule names its own, so a report's header does not name one for all.
MODEL_KEYS = ("model", "model_sha256")


def git_commit(directory="."):
    """The commit of the repository under test, when there is one."""
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


ADAPTERS = "kvparity.impl.ecosystem"  # protocol-only adapters: the version is the adapted package's


def implementation_distribution(spec, batch_class=None):
    """(name, version) of the installed distribution that provides the class
    under test: the module of ``spec`` (MODULE:FACTORY), or, for an adapter
    in impl/ecosystem/, the published class it adapts; (None, None) for a
    module from the working directory (the git commit says which)."""
    module = spec.split(":")[0]
    if batch_class is not None and module.startswith(ADAPTERS + "."):
        module = next((c.__module__ for c in batch_class.__mro__ if not c.__module__.startswith(ADAPTERS)), module)
    top = module.split(".")[0]
    for name in packages_distributions().get(top) or []:
        try:
            return name, version(name)
        except PackageNotFoundError:
            continue
    return None, None


def implementation_version(spec, batch_class=None):
    return implementation_distribution(spec, batch_class)[1]


def describe(implementation=None, model=None, device=None) -> dict:
    env = {**environment(device), "git_commit": git_commit(),
           "known_answer": known_answer.checked(device).to_json()}
    if implementation is not None:
        env["implementation"] = implementation.spec
        package, env["implementation_version"] = implementation_distribution(implementation.spec,
                                                                            implementation.batch_class)
        env["implementation_package"] = package
        env["capabilities"] = implementation.capabilities
    if model is not None:
        env["model"] = model.name
        env["model_sha256"] = model.sha256
    return env


def split_environment(environment: dict):
    """(the environment without a model, the probes' model or None)."""
    env = {k: v for k, v in environment.items() if k not in MODEL_KEYS}
    probe_model = {k: environment[k] for k in MODEL_KEYS if environment.get(k) is not None} or None
    return env, probe_model


def flatten(d, prefix=""):
    """Nested keys as dotted ones, for a header's key-value table."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
