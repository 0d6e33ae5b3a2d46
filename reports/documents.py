"""JSON documents kvparity reads back (report records, expectations files,
a matrix row's cannot-install.json): read and parsed by the one input reader
(``oracle/inputs.py``) and checked against their schema in one way, every
error naming the file, the field and the reason in the words of the file."""

import json
from pathlib import Path

import jsonschema

from kvparity.oracle.inputs import read_json


def check_schema(doc, schema_path, path, error):
    """Raise ``error`` naming the field of ``doc`` (read from ``path``) that
    breaks the schema at ``schema_path``, and why."""
    schema = json.loads(Path(schema_path).read_text())
    found = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if found is not None:
        raise error(f"{path}: {where(found.absolute_path)}: {said(found)}")


def load_checked(path, schema_path, error, shown=None) -> dict:
    doc = read_json(path, error, shown)
    check_schema(doc, schema_path, path, error)
    return doc


def where(path) -> str:
    """``divergences[0].reason`` from a jsonschema error path."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or "the file"


def said(error) -> str:
    """A schema error in the words of the file: unknown and missing fields named."""
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        known = ", ".join(error.schema.get("properties", {}))
        return f"unknown field {unknown[0]!r} (known: {known})"
    if error.validator == "required":
        missing = [f for f in error.validator_value if f not in error.instance]
        return f"missing field {missing[0]!r}"
    return error.message
