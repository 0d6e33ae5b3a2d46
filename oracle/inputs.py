"""Files kvparity reads from its user, read one way and refused in one line.

Schedules, arrivals files, expectations files, policies, report records to
merge, traces to compare and ``[tool.kvparity]`` of pyproject.toml are each
read by ``read_json`` or ``read_toml``. Before parsing, what is not a
regular file (a FIFO would block the read forever) or is larger than the
limit (``KVPARITY_MAX_INPUT_BYTES``, default ``MAX_BYTES``) is refused by its
size alone. In parsing, what Python's readers take silently or fail on deep
inside is refused: bytes that are not UTF-8, a key given twice in one object
(the last would silently win: a request disappears), NaN and Infinity (and
numbers too large for a float), integers of more than ``MAX_DIGITS``
digits, and nesting deeper than ``MAX_DEPTH``. Each refusal is
``error(message)``, the message one line naming the file and the reason.
"""

import json
import math
import os
import stat
from pathlib import Path

LIMIT_ENV = "KVPARITY_MAX_INPUT_BYTES"
# 64 MiB: a whole catalog's report.json is about 2 MB, a schedule a few kB.
MAX_BYTES = 64 * 2**20
MAX_DIGITS = 32  # an integer of a schedule or a record fits in 20 (2**64)
MAX_DEPTH = 64  # a report record nests 8 deep


class Refused(Exception):
    """The file's content is refused: the message says why."""


def max_bytes() -> int:
    """The size limit: ``KVPARITY_MAX_INPUT_BYTES`` where it is set, else ``MAX_BYTES``."""
    given = os.environ.get(LIMIT_ENV)
    if given is None:
        return MAX_BYTES
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if limit < 1:
        raise Refused(f"{LIMIT_ENV}={given!r}: expected a number of bytes, 1 or more")
    return limit


def read_text(path, error, shown=None) -> str:
    """The text of the regular file ``path``, refused before it is read if
    it is no regular file or is over the size limit, or if it is not UTF-8."""
    path = Path(path)
    shown = shown or path
    try:
        limit = max_bytes()
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the file's kind is then told by its descriptor.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except Refused as refused:  # the limit itself, not the file
        raise error(str(refused))
    except OSError as failure:
        raise error(f"{shown}: cannot read it ({failure.strerror or failure})")
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise error(f"{shown}: not a regular file ({_kind(found.st_mode)}); kvparity reads only regular files")
        if found.st_size > limit:
            raise error(f"{shown}: {found.st_size} bytes, more than the {limit} bytes kvparity reads "
                        f"(the limit is set by {LIMIT_ENV})")
        try:
            data = file.read(limit + 1)
        except OSError as failure:
            raise error(f"{shown}: cannot read it ({failure.strerror or failure})")
    if len(data) > limit:  # it grew while it was read
        raise error(f"{shown}: more than the {limit} bytes kvparity reads (the limit is set by {LIMIT_ENV})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as failure:
        line = data[:failure.start].count(b"\n") + 1
        raise error(f"{shown}: not UTF-8: byte {data[failure.start]:#04x} at offset {failure.start} (line {line})")


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a plain file"


def _object(pairs):
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise Refused(f"the key {key!r} is given twice in one object (the second would replace the first)")
        seen.add(key)
    return dict(pairs)


def _constant(name):
    raise Refused(f"{name} is not a number kvparity reads (no NaN or Infinity)")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Refused(f"the number {text[:40]} is too large for a float")
    return value


def check_values(doc):
    """Refuse nesting deeper than ``MAX_DEPTH``, non-finite floats and
    integers of more than ``MAX_DIGITS`` digits anywhere in ``doc`` (parsed
    JSON or TOML); iterative, so the depth itself cannot overflow the stack."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise Refused(f"nested more than {MAX_DEPTH} deep")
            stack.extend((inner, depth + 1) for inner in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise Refused(f"{value} is not a number kvparity reads (no NaN or Infinity)")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** MAX_DIGITS:
            raise Refused(f"an integer of more than {MAX_DIGITS} digits")


def read_json(path, error, shown=None):
    """The JSON document in ``path``: ``error(message)`` where it cannot be
    read, is over the size limit, is not UTF-8 or not JSON, gives a key twice,
    holds NaN or Infinity, an integer of more than ``MAX_DIGITS`` digits or
    nesting deeper than ``MAX_DEPTH``."""
    return _read(path, error, shown, "JSON", json.JSONDecodeError, lambda text: json.loads(
        text, object_pairs_hook=_object, parse_constant=_constant, parse_int=_integer, parse_float=_float))


def read_toml(path, error, shown=None) -> dict:
    """The TOML document in ``path``, refused as ``read_json`` refuses (TOML
    itself refuses a key given twice)."""
    try:
        import tomllib
    except ImportError:  # before Python 3.11, as pytest itself reads it
        import tomli as tomllib
    return _read(path, error, shown, "TOML", tomllib.TOMLDecodeError, tomllib.loads)


def _read(path, error, shown, language: str, malformed, parse):
    shown = shown or path
    text = read_text(path, error, shown)
    try:
        doc = parse(text)
        check_values(doc)
    except malformed as failure:
        raise error(f"{shown}: not {language}: {failure}")
    except Refused as refused:
        raise error(f"{shown}: {refused}")
    except RecursionError:
        raise error(f"{shown}: nested more than {MAX_DEPTH} deep")
    except ValueError as failure:  # an integer past Python's own digit limit (tomllib's int())
        raise error(f"{shown}: {failure}")
    return doc
