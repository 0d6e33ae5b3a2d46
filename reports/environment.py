"""The environment a run happened in, for report headers: the machine, the
git commit of the working directory, the implementation and the model."""

import subprocess

from kvparity.oracle.machine import environment


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


def describe(implementation=None, model=None, device=None) -> dict:
    env = {**environment(device), "git_commit": git_commit()}
    if implementation is not None:
        env["implementation"] = implementation.spec
        env["capabilities"] = implementation.capabilities
    if model is not None:
        env["model"] = model.name
        env["model_sha256"] = model.sha256
    return env
