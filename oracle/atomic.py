"""Directories that appear complete or not at all.

Files are written into a hidden staging directory beside the destination;
on success the first free name is claimed with ``mkdir`` (which fails if the
name exists, so nothing is ever overwritten) and the staging directory
replaces that empty directory. On error the staging directory is removed.
"""

import os
import shutil
import tempfile
from pathlib import Path


class AtomicDirectory:
    def __init__(self, parent, name=None):
        self.parent = Path(parent)
        self.name = name
        self.path = None  # where the directory landed

    def names(self):
        yield self.name

    def __enter__(self) -> Path:
        self.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.parent))
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
