"""impl/ecosystem/rows.toml: the checked-in rows load, and a wrong file is an
error naming the file, the row and the field before any session runs."""

from pathlib import Path

import pytest

from kvparity.reports.ecosystem_rows import Row, RowsError, load_rows

ROWS = Path(__file__).parent.parent / "impl" / "ecosystem" / "rows.toml"

GOOD = '''[[row]]
name = "pkg-1.0"
implementation = "pkg BatchCache"
version = "1.0"
impl = "pkg.cache:BatchCache"
install = ["pkg==1.0", "mlx-lm==0.31.3"]
python = ">=3.10"
'''


def test_the_checked_in_rows_load_with_the_reference_on_each_mlx_lm_minor():
    rows = load_rows(ROWS)
    reference = {row.install for row in rows if row.impl == "kvparity.impl.batch_quantized:BatchQuantizedKVCache"}
    assert reference == {("mlx-lm==0.31.3",), ("mlx-lm==0.32.2",)}
    beam = next(row for row in rows if row.name.startswith("mlx-beam"))
    assert not beam.python_supported("3.11.7") and beam.python_supported("3.12.1")
    # mlx-lm's own server, dense and --kv-bits 4: every architecture, alone from one server with its cache off
    mlx_lm = [row for row in rows if row.server and row.server.startswith("python -m mlx_lm server")]
    assert len(mlx_lm) == 2 and all(row.models == "all" for row in mlx_lm)
    assert all(row.declares[-2:] == ("--prompt-cache-off", "--prompt-cache-size 0") for row in mlx_lm)


def test_a_good_row(tmp_path):
    path = tmp_path / "rows.toml"
    path.write_text(GOOD + 'install_no_deps = ["pkg-extra==2"]\nengine = "pkg.engine:Engine"\n')
    (row,) = load_rows(path)
    assert row == Row("pkg-1.0", "pkg BatchCache", "1.0", ("pkg==1.0", "mlx-lm==0.31.3"), ">=3.10",
                      impl="pkg.cache:BatchCache", install_no_deps=("pkg-extra==2",), engine="pkg.engine:Engine")


def test_a_server_row_and_its_mistakes(tmp_path):
    """An L4 row names a server command instead of a class, never both, and no engine."""
    path = tmp_path / "rows.toml"
    server = GOOD.replace('impl = "pkg.cache:BatchCache"\n', 'server = "pkg-serve --model {model} --port {port}"\n')
    path.write_text(server + 'declares = ["--kv-bits", "4"]\nmodels = "all"\n')
    (row,) = load_rows(path)
    assert row.server.startswith("pkg-serve") and row.impl is None and row.declares == ("--kv-bits", "4")
    assert row.under_test == row.server and row.models == "all"
    for text, says in ((GOOD + 'server = "pkg-serve {model} {port}"\n', "give 'impl'"),
                       (server.replace("server = ", "engine = \"pkg.engine:Engine\"\nserver = "), "no 'engine'")):
        path.write_text(text)
        with pytest.raises(RowsError, match=says):
            load_rows(path)


@pytest.mark.parametrize("text, says", [
    (GOOD.replace('python = ">=3.10"\n', ""), "row 1 ('pkg-1.0'): missing field(s) python"),
    (GOOD + 'kv_bits = "4"\n', "row 1 ('pkg-1.0'): unknown field(s) kv_bits"),
    (GOOD.replace('install = ["pkg==1.0", "mlx-lm==0.31.3"]', 'install = "pkg==1.0"'),
     "field 'install' must be a list of requirement strings"),
    (GOOD.replace('install = ["pkg==1.0", "mlx-lm==0.31.3"]', "install = []"), "field 'install' is empty"),
    (GOOD.replace('"pkg.cache:BatchCache"', '"pkg.cache.BatchCache"'), "field 'impl' must be package.module:Class"),
    (GOOD.replace('">=3.10"', '"three"'), "field 'python' is not a version specifier"),
    (GOOD.replace('"pkg-1.0"', '"Pkg 1"'), "row 1 ('Pkg 1'): field 'name' must be lower-case"),
    (GOOD + "\n" + GOOD, "row 2 ('pkg-1.0'): field 'name' repeats row 1's"),
    ("[row]\nname = 1\n", "expected [[row]] tables and nothing else"),
    ("[[row]\n", "rows.toml: "),
])
def test_a_wrong_file_names_the_file_row_and_field(tmp_path, text, says):
    path = tmp_path / "rows.toml"
    path.write_text(text)
    with pytest.raises(RowsError) as error:
        load_rows(path)
    assert str(error.value).startswith(str(path)) and says in str(error.value)


def test_each_rows_expectations_file_exists_and_loads():
    from kvparity.reports.expectations import load_expectations
    declared = [row for row in load_rows(ROWS) if row.expectations]
    assert declared, "rapid-mlx declares its designed differences"
    for row in declared:
        load_expectations(ROWS.parent.parent.parent / row.expectations)  # raises, naming the file


def test_a_row_that_cannot_install_writes_what_the_matrix_reads(tmp_path):
    import json

    from kvparity.reports import matrix
    from kvparity.reports.ecosystem_rows import CANNOT_INSTALL

    beam = next(row for row in load_rows(ROWS) if row.name.startswith("mlx-beam"))
    folder = tmp_path / beam.name
    folder.mkdir()
    (folder / CANNOT_INSTALL).write_text(json.dumps(beam.cannot_install("needs Python >=3.12", "ecosystem")))
    (row,) = matrix.gather([tmp_path])
    assert row.cannot_install["reason"] == "needs Python >=3.12" and row.cannot_install["version"] == "0.1.0a11"
