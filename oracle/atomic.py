"""Directories that appear complete or not at all.

Files are written into a hidden staging directory beside the destination;
on success the first free name is claimed with ``mkdir`` (which fails if the
name exists, so nothing is ever overwritten) and the staging directory
replaces that empty directory. On error the staging directory is removed.
A process killed before it could remove its staging directory leaves it
behind: the next one that stages beside it removes it, once the process
named in it is gone (never a live writer's).
"""

import os
import re
import shutil
import tempfile
from pathlib import Path

STAGING = ".partial-"
# Where output goes by default, relative to the working directory (the
# repository under test). Made by kvparity, it carries a .gitignore that
# ignores all of it: reports are never sources.
OUTPUT_ROOT = Path("reports", "out")
FOUND_DIR = OUTPUT_ROOT / "found"  # schedules the generated tests found failing
IGNORE_ALL = "# Made by kvparity: its reports and found schedules are output, not sources.\n*\n"
_OWNER = re.compile(re.escape(STAGING) + r"(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(parent: Path):
    """Staging directories in ``parent`` whose writer is no longer running."""
    for entry in parent.glob(STAGING + "*"):
        owner = _OWNER.match(entry.name)
        if owner and int(owner.group(1)) != os.getpid() and not _alive(int(owner.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def make_folder(path) -> Path:
    """``mkdir -p path``; the default output root, when this makes it, gets
    its .gitignore first."""
    path = Path(path)
    root = OUTPUT_ROOT.absolute()
    if not root.exists() and (path.absolute() == root or root in path.absolute().parents):
        root.mkdir(parents=True, exist_ok=True)
        (root / ".gitignore").write_text(IGNORE_ALL)
    path.mkdir(parents=True, exist_ok=True)
    return path


class AtomicDirectory:
    def __init__(self, parent, name=None):
        self.parent = Path(parent)
        self.name = name
        self.path = None  # where the directory landed

    def names(self):
        yield self.name

    def __enter__(self) -> Path:
        make_folder(self.parent)
        remove_stale(self.parent)
        self.staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=self.parent))
        return self.staging

    def __exit__(self, kind, error, trace):
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            return False
        for name in self.names():
            final = self.parent / name
            try:
                os.mkdir(final)
            except FileExistsError:
                continue
            # mkdtemp makes the staging directory owner-only; give it the mode
            # an ordinary directory gets under this umask.
            os.chmod(self.staging, os.stat(final).st_mode & 0o777)
            os.replace(self.staging, final)
            self.path = final
            return False
        shutil.rmtree(self.staging, ignore_errors=True)
        raise FileExistsError(f"{self.parent / self.name if self.name else self.parent}: exists, never overwritten")
