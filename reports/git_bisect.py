"""What a running ``git bisect`` knows, for telling a commit that cannot be
judged (125: git skips it) from a command that is wrong at every commit (a
usage error: kvparity exits above 127 and git aborts the bisection)."""

import subprocess
from typing import Optional


def git(*args, directory=".") -> Optional[str]:
    """git's output, or None where git fails or is not there."""
    try:
        done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def bad_commit(directory=".") -> Optional[str]:
    """The commit a bisection running in ``directory``'s repository holds
    bad; None when none runs."""
    out = git("rev-parse", "--verify", "-q", "refs/bisect/bad", directory=directory)
    if out is None:
        return None
    return out.strip() or None


def module_files(module: str) -> tuple:
    """Where a module's source lives, relative to the folder it is imported from."""
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__init__.py"


def holds_module(commit: str, module: str, directory=".") -> bool:
    """Whether ``commit``'s tree has a file for ``module``, at its root or
    under a folder (a ``src/`` layout). Where git cannot say, True: the
    commit is then only skipped, never the bisection aborted on a guess."""
    out = git("ls-tree", "-r", "--full-tree", "--name-only", commit, directory=directory)
    if out is None:
        return True
    files = module_files(module)
    return any(line in files or line.endswith(tuple("/" + f for f in files)) for line in out.splitlines())
