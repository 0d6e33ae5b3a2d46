"""Install the repository under test, so that its cache imports as it does for its users.

The ``install`` input is a command run with bash in the repository's root
(``pip install -e '.[serve]'``, ``pip install -r requirements.txt && pip
install -e .``). ``auto`` (the default) installs the repository editable when
it has a ``pyproject.toml`` or ``setup.py`` (a ``src/`` layout included) and
otherwise leaves it to be imported from its root; ``none`` installs nothing.
It runs after kvparity is installed, so the versions your project pins are
the ones the gate judges against.

A command that fails is reported with its status and the gate does not run:
the action's ``exit-status`` is 125 (cannot judge here), never a parity verdict.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE
from workflow_commands import error, record_exit_status

PROJECT_FILES = ("pyproject.toml", "setup.py")


def install_command(spec: str, root: Path) -> Optional[str]:
    """The command the input asks for in ``root``; None to install nothing."""
    spec = spec.strip()
    if spec == "none":
        return None
    if spec in ("", "auto"):
        if any((root / name).is_file() for name in PROJECT_FILES):
            return f"{shlex.quote(sys.executable)} -m pip install -e ."
        return None
    return spec


def main() -> int:
    command = install_command(os.environ.get("KVPARITY_INSTALL", "auto"), Path.cwd())
    if command is None:
        print("nothing to install: the cache is imported from the repository's root")
        return 0
    print("+", command, flush=True)
    status = subprocess.run(["bash", "-c", command]).returncode
    if status == 0:
        return 0
    print(error("kvparity gate", f"your project did not install (exit {status}): {command}; "
                "set the action's input install to the command that installs it"))
    record_exit_status(EXIT_CANNOT_JUDGE)
    return EXIT_CANNOT_JUDGE


if __name__ == "__main__":
    sys.exit(main())
