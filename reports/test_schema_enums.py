"""Every enum of the schemas equals the table it is generated from
(reports/schema_enums.py): a word is declared once, and a schema cannot
lag behind it."""

import json

from kvparity.reports import schema_enums


def test_the_schemas_enums_are_the_declared_tables():
    assert schema_enums.differences() == [], "run python -m kvparity.reports.schema_enums"


def test_every_enum_of_a_schema_is_generated_or_a_json_constant():
    """No enum is written by hand: each is in ENUMS, but JSON's own words for
    non-finite numbers and the matrix's column kinds (its own format)."""
    own = {("report.schema.json", "/$defs/real/oneOf/1"), ("matrix.schema.json", "/properties/columns/items/properties/kind")}
    found = set()

    def walk(name, doc, pointer):
        if isinstance(doc, dict):
            if "enum" in doc:
                found.add((name, pointer))
            for key, value in doc.items():
                walk(name, value, f"{pointer}/{key}")
        elif isinstance(doc, list):
            for i, value in enumerate(doc):
                walk(name, value, f"{pointer}/{i}")

    for path in schema_enums.SCHEMAS.glob("*.schema.json"):
        walk(path.name, json.loads(path.read_text()), "")
    assert found - own == set(schema_enums.ENUMS)


def test_a_schema_behind_its_table_is_caught(monkeypatch):
    key = ("report.schema.json", "/$defs/outcome")
    monkeypatch.setitem(schema_enums.ENUMS, key, [*schema_enums.ENUMS[key], "a new outcome"])
    ((name, pointer, written, declared),) = schema_enums.differences()
    assert (name, pointer) == key and declared[-1] == "a new outcome" and "a new outcome" not in written
