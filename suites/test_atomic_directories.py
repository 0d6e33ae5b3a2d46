"""Directories that appear complete or not at all, and what a killed writer
leaves behind: removed by the next writer once its process is gone, never
while it runs."""

import subprocess
import sys

import pytest

from kvparity.oracle.atomic import STAGING, AtomicDirectory


def finished_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_killed_writers_staging_is_removed_and_a_live_ones_is_kept(tmp_path):
    dead = tmp_path / f"{STAGING}{finished_pid()}-abc"
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f"{STAGING}{live_writer.pid}-def"
        for staging in (dead, live):
            staging.mkdir()
            (staging / "half-written").write_text("x")
        with AtomicDirectory(tmp_path, "entry") as staging:
            (staging / "done").write_text("y")
        assert not dead.exists() and live.exists()
        assert (tmp_path / "entry" / "done").read_text() == "y"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry", live.name])
    finally:
        live_writer.kill()
        live_writer.wait()


def test_a_writer_interrupted_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with AtomicDirectory(tmp_path, "entry") as staging:
            (staging / "half").write_text("x")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_the_default_output_root_kvparity_makes_ignores_itself(tmp_path, monkeypatch):
    """A user's repository gets reports/out/ with a .gitignore of its own, so
    `git status` stays clean; a folder given with --out is left as it is."""
    import subprocess

    from kvparity.oracle.atomic import IGNORE_ALL, OUTPUT_ROOT, make_folder

    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    make_folder(OUTPUT_ROOT / "found" / "worker-0")
    assert (OUTPUT_ROOT / ".gitignore").read_text() == IGNORE_ALL
    (OUTPUT_ROOT / "found" / "worker-0" / "a.json").write_text("{}")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True,
                            text=True, check=True).stdout
    assert status == "", status
    make_folder(tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere" / ".gitignore").exists()
