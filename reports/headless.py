"""A page in a real headless browser, for the tests of the report and the
matrix pages: its DOM after layout, whether it fits a window's width, and a
screenshot (a page is read at 1280 px, a laptop's width)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1280
# Appended to a copy of the page: the layout's overflow, written where --dump-dom shows it.
MEASURE = ("<script>document.body.setAttribute('data-overflow', String(document.documentElement.scrollWidth - "
           "document.documentElement.clientWidth));</script>")


def browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip("no chromium binary found (CI installs Debian's chromium)")
    return found


def headless(binary, profile, *args):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={profile}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


def dom(binary, profile, page: Path, width: int = WIDTH) -> str:
    done = headless(binary, profile, f"--window-size={width},900", "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def overflow(binary, profile, page: Path, width: int = WIDTH) -> int:
    """How many pixels the page is wider than a window ``width`` wide (0: it fits)."""
    measured = page.with_name(f".measured-{page.name}")
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    try:
        found = re.search(r'data-overflow="(-?\d+)"', dom(binary, profile, measured, width))
    finally:
        measured.unlink()
    assert found, "the measuring script did not run"
    return int(found.group(1))


def screenshot(binary, profile, page: Path, shot: Path, width: int = WIDTH, height: int = 1000) -> Path:
    """The first screen of ``page`` at ``width`` as a PNG in ``shot``."""
    done = headless(binary, profile, f"--window-size={width},{height}", f"--screenshot={shot}", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot of {page.name} at {width} px: {shot}")
    return shot
