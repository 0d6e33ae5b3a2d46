"""The documentation as users read it: a README of about 200 lines, and
every relative link in it, in docs/ and in workflows/README.md pointing at a
file (and heading) that exists. CI also builds the site with
``mkdocs build --strict``, which runs here where MkDocs is installed."""

import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "workflows" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 200


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc makes it (MkDocs's default)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def broken_links(page: Path, text: str) -> list:
    """``page``'s relative links (in ``text``) whose file or heading is not there."""
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page, page.read_text()) == []


def test_a_broken_link_is_caught():
    page = ROOT / "docs" / "index.md"
    text = "[a](protocol.md) [b](nowhere.md) [c](protocol.md#no-such-heading) [d](https://x.org/y) [e](#where-output-goes)"
    assert broken_links(page, text) == ["nowhere.md: no such file",
                                        "protocol.md#no-such-heading: no heading #no-such-heading in protocol.md"]


def test_the_docs_site_builds_strict(tmp_path):
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]'; .ci/run installs it)")
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "protocol" / "index.html").exists()
