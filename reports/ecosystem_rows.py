"""The conformance matrix's rows (``impl/ecosystem/rows.toml``): what each
row installs and runs. Read by ``noxfile.py`` (which loads this file by path:
standard library and ``packaging`` only) and by the matrix.

Where a session writes, under the output root, one directory per row:
``<root>/<name>/<stamp>/`` is a ``kvparity run`` report directory, and
``<root>/<name>/cannot-install.json`` ({"row": name, "reason": why}) says the
row could not be installed here; where present, it is the row's cell.
"""

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Tuple

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from kvparity.oracle.inputs import read_toml

CANNOT_INSTALL = "cannot-install.json"
# The checked-in rows: beside this package in a checkout and in the wheel (package data of kvparity.impl).
ROWS_FILE = Path(__file__).resolve().parent.parent / "impl" / "ecosystem" / "rows.toml"
CANNOT_INSTALL_FORMAT = "kvparity.cannot-install/1"  # reports/schema/cannot-install.schema.json

NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class RowsError(ValueError):
    """rows.toml is wrong: the message names the file, the row and the field."""


@dataclass(frozen=True)
class Row:
    name: str  # unique; the row's directory under the output root
    implementation: str  # what the matrix calls it
    version: str  # the implementation's version, as the matrix shows it
    install: Tuple[str, ...]  # exact pip requirements, as its users install it
    python: str  # PEP 440 specifier of the Pythons it supports
    impl: Optional[str] = None  # --impl: package.module:Class (a cache row)
    install_no_deps: Tuple[str, ...] = ()  # installed afterwards with --no-deps
    engine: Optional[str] = None  # --engine for L3
    expectations: Optional[str] = None  # --expectations: the row's declared divergences, from the repository root
    server: Optional[str] = None  # L4 --server: the command, found on the row environment's PATH (a server row)
    declares: Tuple[str, ...] = ()  # L4: what the server declares to kvparity (--kv-bits 4 ...)
    models: Optional[str] = None  # --models: the architecture axis (all: every architecture, on workers)

    @property
    def under_test(self) -> str:
        """The class, or the server's command."""
        return self.impl or self.server

    def python_supported(self, version: str) -> bool:
        return version in SpecifierSet(self.python)

    def pinned(self, distribution: str) -> Optional[str]:
        """The version the row pins ``distribution`` to (``name==X``), or None."""
        for requirement in self.install + self.install_no_deps:
            name, _, pinned = requirement.partition("==")
            if name.split("[")[0].strip().lower() == distribution:
                return pinned.strip() or None
        return None

    def cannot_install(self, reason: str, session: str) -> dict:
        """The row's cannot-install.json: its cell says why, never a gap."""
        package = self.install_no_deps[0] if self.install_no_deps else self.install[0]
        return {"format": CANNOT_INSTALL_FORMAT, "implementation": self.under_test, "package": package.split("==")[0],
                "version": self.version, "mlx_lm": self.pinned("mlx-lm"), "reason": reason,
                "command": " ".join(["uv pip install", *self.install]
                                    + (["&& uv pip install --no-deps", *self.install_no_deps] if self.install_no_deps else [])),
                "session": session}


REQUIRED = ("name", "implementation", "version", "install", "python")
LISTS = ("install", "install_no_deps", "declares")


def _row(path, index: int, entry) -> Row:
    if not isinstance(entry, dict):
        raise RowsError(f"{path}: row {index + 1}: expected a [[row]] table")
    name = entry.get("name")
    where = f"{path}: row {index + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
    known = {f.name for f in fields(Row)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise RowsError(f"{where}: unknown field(s) {', '.join(unknown)} (fields: {', '.join(sorted(known))})")
    missing = [f for f in REQUIRED if f not in entry]
    if missing:
        raise RowsError(f"{where}: missing field(s) {', '.join(missing)}")
    for field, value in entry.items():
        if field in LISTS:
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise RowsError(f"{where}: field {field!r} must be a list of requirement strings")
        elif not isinstance(value, str) or not value.strip():
            raise RowsError(f"{where}: field {field!r} must be a non-empty string")
    if not NAME.fullmatch(name):
        raise RowsError(f"{where}: field 'name' must be lower-case letters, digits, '.', '_' and '-'")
    if ("impl" in entry) == ("server" in entry):
        raise RowsError(f"{where}: give 'impl' (a cache class) or 'server' (an L4 server command), one of them")
    if "server" in entry and ("engine" in entry or "expectations" in entry):
        raise RowsError(f"{where}: a server row takes no 'engine' or 'expectations' (L4 runs the server's own)")
    for field in ("impl", "engine"):
        if field in entry and not SPEC.fullmatch(entry[field]):
            raise RowsError(f"{where}: field {field!r} must be package.module:Class, got {entry[field]!r}")
    if not entry["install"]:
        raise RowsError(f"{where}: field 'install' is empty: pin the package as its users install it")
    try:
        SpecifierSet(entry["python"])
    except InvalidSpecifier:
        raise RowsError(f"{where}: field 'python' is not a version specifier: {entry['python']!r}")
    return Row(**{**entry, **{f: tuple(entry[f]) for f in LISTS if f in entry}})


def load_rows(path) -> Tuple[Row, ...]:
    """Every row of ``path``, checked before anything runs."""
    path = Path(path)
    doc = read_toml(path, RowsError)
    if set(doc) != {"row"} or not isinstance(doc["row"], list) or not doc["row"]:
        raise RowsError(f"{path}: expected [[row]] tables and nothing else")
    rows = tuple(_row(path, i, entry) for i, entry in enumerate(doc["row"]))
    names = [row.name for row in rows]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RowsError(f"{path}: row {i + 1} ({name!r}): field 'name' repeats row {names.index(name) + 1}'s")
    return rows
