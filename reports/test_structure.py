"""Imports run one way, read from the source with ``ast``: an import inside
a function counts as much as one at the top of a file.

* No cycle between files, the tests included.
* Between folders, the harness imports reports -> suites -> oracle, never
  back; impl only through suites/core/adapter.py (which loads an implementation by
  its name). Tests may name an implementation, and drive the command line
  from suites/, so they are held to the file rule only.
* impl/ imports only mlx, mlx-lm, numpy, the standard library and other impl
  modules: an implementation under test carries nothing of the harness.
* Inside suites/, each module lives in a room (a subpackage) or is one of its
  entry points, and a room imports only the rooms below it (``ROOMS``,
  docs/layout.md).
* No file is over ``LONGEST`` lines unless its docstring says why it stays
  whole: a reader finds a concern in a module named for it, not by scrolling.
* Only the command handlers read the parsed command line: a function that
  reads a parameter ``args`` as a namespace is a command's ``handle`` or the
  one resolver of the settings (``NAMESPACE_READERS``); the rest reads the
  immutable ``reports.settings.Settings``.
"""

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

import kvparity

ROOT = Path(kvparity.__file__).resolve().parent.parent  # the folders below, side by side
FOLDERS = ("impl", "oracle", "suites", "reports")
# Which folders each folder's harness modules may import (besides its own).
MAY_IMPORT = {"reports": {"suites", "oracle"}, "suites": {"oracle"}, "oracle": set(), "impl": set()}
ADAPTER = "kvparity.suites.core.adapter"  # the one module that may reach impl, by name
IMPL_MAY_IMPORT = {"mlx", "mlx_lm", "numpy"} | set(sys.stdlib_module_names)
ECOSYSTEM = "kvparity.impl.ecosystem"  # adapters, each importing its published package
# suites/'s rooms, lowest first, and the rooms each may import besides itself (docs/layout.md).
ROOMS = {
    "format": set(),
    "core": {"format"},
    "l1": {"format", "core"},
    "l2": {"format", "core"},
    "l3": {"format", "core"},
    "l4": {"format", "core", "l3"},
    "search": {"format", "core", "l1", "l2", "l3"},
    "calibration": {"format", "core", "l2"},
}
# suites/'s modules outside every room: the package, which runner each level uses, and the
# process protocol's server (``python -m kvparity.suites.process_server``). They may import any room.
ENTRY_POINTS = {"kvparity.suites", "kvparity.suites.runners", "kvparity.suites.process_server"}
LONGEST = 500  # lines of a file, tests included
STAYS_WHOLE = "stays whole"  # the words of a docstring that says why a longer file must
# The functions that read the parsed command line (besides each command's ``handle``).
NAMESPACE_READERS = {"kvparity.reports.commands.base.settings_of"}
COMMANDS = "kvparity.reports.commands."
MAPPING_METHODS = {"get", "items", "keys", "values"}  # an ``args`` that is a dict (an event's) reads these


def modules(root: Path) -> Dict[str, Path]:
    """Module name -> file, for every Python file of the harness and its tests."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            packages = path.relative_to(root / folder).parent.parts
            if not all((root / folder / Path(*packages[: i + 1]) / "__init__.py").exists()
                       for i in range(len(packages))):
                continue  # not a module of the package (an example script)
            dotted = ".".join(("kvparity", folder) + packages)
            found[dotted if path.stem == "__init__" else f"{dotted}.{path.stem}"] = path
    for path in sorted((root / "kvparity").glob("*.py")):
        found["kvparity" if path.stem == "__init__" else f"kvparity.{path.stem}"] = path
    if (root / "conftest.py").exists():
        found["conftest"] = root / "conftest.py"
    return found


def import_statements(path: Path, name: str):
    """(module, names) of each import in ``path`` (module ``name``), anywhere
    in the file; names are empty for ``import module``."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def imported(path: Path, name: str) -> Set[str]:
    """Every module ``path`` imports, ``from package import module`` read as
    the module too (a name that is no module is dropped by ``graph``)."""
    out = set()
    for module, names in import_statements(path, name):
        out.add(module)
        out |= {f"{module}.{n}" for n in names}
    return out


def graph(root: Path) -> Dict[str, Set[str]]:
    """Module -> the harness modules it imports."""
    files = modules(root)
    return {name: {m for m in imported(path, name) if m in files and m != name} for name, path in files.items()}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each strongly connected group of more than one node
    (Tarjan's algorithm, iterative), each as a path that returns to its start."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_a_cycle(edges, group) for group in groups]


def _a_cycle(edges, group) -> List[str]:
    """A path inside ``group`` from its first member back to itself."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(edges[node] & group):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                frontier.append(child)
    raise AssertionError(f"no cycle in {sorted(group)}")


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in FOLDERS else ""


def is_test(module: str) -> bool:
    return module == "conftest" or module.rpartition(".")[2].startswith("test_")


def wrong_way(edges: Dict[str, Set[str]]) -> List[str]:
    """Imports of a harness module against the folders' direction."""
    found = []
    for module, targets in sorted(edges.items()):
        here = folder_of(module)
        if not here or is_test(module):
            continue
        for target in sorted(targets):
            there = folder_of(target)
            if there == "impl" and here != "impl" and module != ADAPTER:
                found.append(f"{module} imports {target}: impl is reached only through {ADAPTER}")
            elif there not in ("", here, "impl") and there not in MAY_IMPORT[here]:
                found.append(f"{module} imports {target}: {here}/ may import only "
                             f"{', '.join(sorted(MAY_IMPORT[here])) or 'itself'}")
    return found


def room_of(module: str) -> str:
    """suites/'s room of a module ("" outside suites/ or for an entry point)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "suites" and parts[2] in ROOMS else ""


def out_of_place(edges: Dict[str, Set[str]]) -> List[str]:
    """suites/'s modules in no room that are not entry points, and imports of
    a room from a room it may not import (or from an entry point)."""
    found = []
    for module, targets in sorted(edges.items()):
        if folder_of(module) != "suites" or is_test(module):
            continue
        here = room_of(module)
        if not here and module not in ENTRY_POINTS:
            found.append(f"{module} is in no room of suites/ ({', '.join(ROOMS)}) and is no entry point")
            continue
        for target in sorted(targets):
            if folder_of(target) != "suites" or not here:
                continue
            there = room_of(target)
            if not there:
                found.append(f"{module} imports {target}: a room never imports an entry point")
            elif there != here and there not in ROOMS[here]:
                found.append(f"{module} imports {target}: {here}/ may import only "
                             f"{', '.join(sorted(ROOMS[here])) or 'itself'}")
    return found


def impl_imports_beyond_its_own(root: Path) -> List[str]:
    """Imports in impl/ of anything but mlx, mlx-lm, numpy, the standard
    library and impl's own modules; an adapter in impl/ecosystem/ imports its
    own published package too, and never the harness."""
    found = []
    for name, path in modules(root).items():
        if folder_of(name) != "impl":
            continue
        adapter = name.startswith(ECOSYSTEM + ".")
        for module in sorted({module for module, _ in import_statements(path, name)}):
            own = module == "kvparity.impl" or module.startswith("kvparity.impl.")
            top = module.split(".")[0]
            allowed = top in IMPL_MAY_IMPORT or (adapter and top != "kvparity")
            if not own and not allowed:
                found.append(f"{path.relative_to(root)} imports {module}")
    return found


# --- the repository ----------------------------------------------------------------------


def namespace_readers(root: Path) -> List[str]:
    """Each function of the harness, outside the command handlers and
    ``NAMESPACE_READERS``, that reads a parameter ``args`` as a namespace:
    ``args.NAME``, ``getattr(args, ...)`` or ``vars(args)``."""
    found = []
    for module, path in modules(root).items():
        if is_test(module) or folder_of(module) in (None, "impl"):  # impl/ is under test, not the harness
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if "args" not in [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]:
                continue
            name = f"{module}.{node.name}"
            if name in NAMESPACE_READERS or (module.startswith(COMMANDS) and node.name == "handle"):
                continue
            if any(reads_namespace(inner) for inner in ast.walk(node)):
                found.append(f"{name} reads the parsed command line (args): only a command's handle does")
    return found


def reads_namespace(node) -> bool:
    is_args = lambda n: isinstance(n, ast.Name) and n.id == "args"  # noqa: E731
    if isinstance(node, ast.Attribute) and is_args(node.value):
        return node.attr not in MAPPING_METHODS
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "vars")
            and bool(node.args) and is_args(node.args[0]))


def too_long(root: Path) -> List[str]:
    """Each Python file of the checkout over ``LONGEST`` lines whose docstring does not say why it stays whole."""
    paths = [*modules(root).values(), *sorted(root.glob("action/*.py")), *sorted(root.glob("noxfile.py"))]
    found = []
    for path in paths:
        text = path.read_text()
        lines = text.count("\n")
        if lines > LONGEST and STAYS_WHOLE not in (ast.get_docstring(ast.parse(text)) or ""):
            found.append(f"{path.relative_to(root)}: {lines} lines, over {LONGEST}; split it by what a reader looks "
                         f"for, or say in its docstring why it {STAYS_WHOLE}")
    return found


def test_no_import_cycle_between_files():
    found = cycles(graph(ROOT))
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_cycle_between_folders_and_each_imports_one_way():
    edges = graph(ROOT)
    assert wrong_way(edges) == []
    folders = {}
    for module, targets in edges.items():
        if folder_of(module) and not is_test(module):
            folders.setdefault(folder_of(module), set()).update(folder_of(t) for t in targets if folder_of(t))
    assert cycles({f: targets - {f} for f, targets in folders.items()}) == []


def test_each_module_of_suites_is_in_its_room_and_imports_only_the_rooms_below():
    assert out_of_place(graph(ROOT)) == []


def test_only_the_command_handlers_read_the_parsed_command_line():
    assert namespace_readers(ROOT) == []


def test_no_file_a_reader_must_scroll():
    assert too_long(ROOT) == []


def test_impl_imports_nothing_of_the_harness():
    assert impl_imports_beyond_its_own(ROOT) == []


def test_the_graph_reads_the_harness_as_it_is():
    edges = graph(ROOT)
    assert len(edges) > 40 and "kvparity.reports.verdicts" in edges["kvparity.reports.writer"]
    assert "kvparity.oracle.gguf" in edges["kvparity.oracle.models"]  # a relative import


# --- the checks fail where they should -----------------------------------------------------


def _tree(root: Path, files: Dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in FOLDERS:
        (root / folder).mkdir(exist_ok=True)
    return root


def test_a_cycle_between_files_is_found_through_an_import_inside_a_function(tmp_path):
    root = _tree(tmp_path, {
        "suites/a.py": "from kvparity.suites import b\n",
        "suites/b.py": "def f():\n    from kvparity.suites.c import g\n",
        "suites/c.py": "import kvparity.suites.a\n",
        "suites/d.py": "from kvparity.suites import a\n",  # into the cycle, not part of it
    })
    assert cycles(graph(root)) == [["kvparity.suites.a", "kvparity.suites.b", "kvparity.suites.c",
                                    "kvparity.suites.a"]]


def test_an_import_against_the_folders_direction_is_found(tmp_path):
    root = _tree(tmp_path, {
        "oracle/o.py": "def f():\n    from kvparity.suites.s import x\n",
        "suites/s.py": "from kvparity.oracle.o import f\nx = 1\n",
        "reports/r.py": "from kvparity.impl import i\n",
        "reports/test_r.py": "from kvparity.impl import i\n",  # a test may name an implementation
        "impl/i.py": "import numpy\n",
    })
    edges = graph(root)
    assert wrong_way(edges) == [
        "kvparity.oracle.o imports kvparity.suites.s: oracle/ may import only itself",
        "kvparity.reports.r imports kvparity.impl.i: impl is reached only through kvparity.suites.core.adapter"]
    assert cycles(edges) == [["kvparity.oracle.o", "kvparity.suites.s", "kvparity.oracle.o"]]


def test_a_flat_module_and_an_import_up_between_rooms_are_found(tmp_path):
    root = _tree(tmp_path, {
        "suites/__init__.py": "",
        "suites/format/__init__.py": "",
        "suites/format/schedule.py": "def f():\n    from kvparity.suites.core.replay import dry_run\n",
        "suites/core/__init__.py": "",
        "suites/core/replay.py": "from kvparity.suites.format.schedule import f\nfrom kvparity.suites import runners\n",
        "suites/runners.py": "from kvparity.suites.core.replay import f\n",
        "suites/loose.py": "x = 1\n",
        "suites/test_loose.py": "from kvparity.suites import loose\n",  # a test is in no room
    })
    assert out_of_place(graph(root)) == [
        "kvparity.suites.core.replay imports kvparity.suites.runners: a room never imports an entry point",
        "kvparity.suites.format.schedule imports kvparity.suites.core.replay: format/ may import only itself",
        "kvparity.suites.loose is in no room of suites/ (format, core, l1, l2, l3, l4, search, calibration) and "
        "is no entry point"]


def test_impl_importing_the_harness_or_another_package_is_found(tmp_path):
    root = _tree(tmp_path, {
        "impl/good.py": "import json\nimport mlx.core as mx\nfrom mlx_lm.models.cache import KVCache\n"
                        "from kvparity.impl.other import X\nfrom .other import Y\n",
        "impl/other.py": "X = Y = 1\n",
        "impl/bad.py": "def f():\n    from kvparity.suites.core.evidence import PASS\nimport requests\n",
    })
    assert impl_imports_beyond_its_own(root) == ["impl/bad.py imports kvparity.suites.core.evidence",
                                                 "impl/bad.py imports requests"]


def test_an_ecosystem_adapter_imports_its_package_but_never_the_harness(tmp_path):
    root = _tree(tmp_path, {
        "impl/__init__.py": "",
        "impl/ecosystem/__init__.py": "",
        "impl/ecosystem/good.py": "from mlx_vlm.models.cache import BatchQuantizedKVCache\n",
        "impl/ecosystem/bad.py": "from mlx_vlm.models.cache import X\nfrom kvparity.suites.core.adapter import Y\n",
        "impl/ecosystem/scripts/loose.py": "from kvparity.reports.cli import main\n",  # no package: not a module
    })
    assert "kvparity.impl.ecosystem.good" in modules(root)
    assert impl_imports_beyond_its_own(root) == ["impl/ecosystem/bad.py imports kvparity.suites.core.adapter"]


def test_a_function_reading_the_command_line_beside_the_handlers_is_found(tmp_path):
    root = _tree(tmp_path, {
        "reports/__init__.py": "",
        "reports/commands/__init__.py": "",
        "reports/commands/run.py": "def handle(args, settings):\n    return helper(args)\n\n"
                                   "def helper(args):\n    return args.impl\n",
        "reports/commands/base.py": "def settings_of(args):\n    return vars(args)\n",
        "reports/runs.py": "def select(args, files):\n    return getattr(args, 'level', None)\n",
        "suites/__init__.py": "",
        "suites/events.py": "def ids_of(where, args):\n    return args.get('ids')\n",  # an event's arguments
    })
    assert namespace_readers(root) == [
        "kvparity.reports.commands.run.helper reads the parsed command line (args): only a command's handle does",
        "kvparity.reports.runs.select reads the parsed command line (args): only a command's handle does"]


def test_a_long_file_is_found_unless_its_docstring_says_why_it_stays_whole(tmp_path):
    body = "x = 1\n" * LONGEST
    root = _tree(tmp_path, {
        "reports/__init__.py": "",
        "reports/long.py": '"""A module."""\n' + body,
        "reports/whole.py": f'"""A module that {STAYS_WHOLE}: one table."""\n' + body,
        "reports/test_long.py": body + "y = 2\n",  # a test module too
        "reports/short.py": "x = 1\n" * (LONGEST - 1),
    })
    assert [line.split(":")[0] for line in too_long(root)] == ["reports/long.py", "reports/test_long.py"]
