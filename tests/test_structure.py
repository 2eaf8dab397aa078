"""The package's structure: no import cycle, no import that resolves only in the installed layout,
library modules that import no application (benchmarks, studies, the CLI), and shape-suffixed names
that follow the one legend of docs/conventions.md.

Both read the source files of the package as installed (`occult_hf` and the `package_dir`-mapped
`occult_hf.kernels`, `occult_hf.patches`, `occult_hf.eval`, wherever the install puts them), parse
them, and never import them.

An import inside a function counts: a lazy import that dodges a cycle is still a cycle (the modules
still depend on each other; fix the layering instead). Importing `occult_hf.a.b` counts as importing
`occult_hf.a` too (Python runs that package's `__init__` first), except for the importer's own
packages and the root `occult_hf`.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

#: the installed package and the subpackages setup.cfg maps from top-level folders
ROOT_PACKAGES = ("occult_hf", "occult_hf.kernels", "occult_hf.patches", "occult_hf.eval")


@functools.cache
def _package_files() -> dict[str, Path]:
    """`{module name: source file}` for every module of the installed package."""
    modules = {}
    for package in ROOT_PACKAGES:
        (location,) = importlib.util.find_spec(package).submodule_search_locations
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _runtime_imports(tree: ast.Module, at_import: bool = False):
    """Import statements that run (module level or inside functions), skipping `if TYPE_CHECKING:` blocks;
    `at_import=True`: only those that run when the module is imported (outside every function and class)."""
    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                yield from (i for stmt in child.orelse for i in visit_stmt(stmt))
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            if not (at_import and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))):
                yield from visit(child)

    def visit_stmt(stmt):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        yield from visit(stmt)

    yield from visit(tree)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache  # parsed once for every test here (read-only)
def import_graph(at_import: bool = False) -> dict[str, set[str]]:
    """`{module: modules of the package it imports}`; `from pkg import mod` counts as importing `pkg.mod`.
    `at_import=True`: only the imports that run when the module is imported (`_runtime_imports`)."""
    files = _package_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), at_import):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _absolute(module, is_package, node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            for target in targets:
                while target and target not in files:  # `import occult_hf.x.y` where y is a name
                    target = target.rpartition(".")[0]
                if not target.startswith("occult_hf"):
                    continue
                # importing occult_hf.a.b runs occult_hf.a's __init__ first: that is an edge too
                # (except to the root package and to the importer's own packages, already being imported)
                parts = target.split(".")
                for end in range(2, len(parts) + 1):
                    name = ".".join(parts[:end])
                    if name != module and not module.startswith(name + "."):
                        graph[module].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_the_package_has_no_import_cycle():
    """How to see a failure's cycle: the message lists each strongly connected set of modules and the
    imports among them (`import_graph()` in this file builds the graph)."""
    graph = import_graph()
    assert "occult_hf.kernels.layout" in graph and "occult_hf.patches.base" in graph  # mapped folders are read
    assert "occult_hf.patches" in graph["occult_hf.hf.apply"]  # and connected to their importers
    cycles = _cycles(graph)
    detail = "\n".join(
        " <-> ".join(c) + "\n" + "\n".join(f"    {a} -> {b}" for a in c for b in sorted(graph[a] & set(c))) for c in cycles
    )
    assert not cycles, f"import cycles (lazy imports inside functions count too):\n{detail}"


#: the most floors the package's rooms may stand on (issue 30: the token path readable, the house not tall)
MAX_FLOORS = 8


def _room(module: str) -> str:
    """The room a module stands in: its top-level subpackage (`occult_hf.dispatch`, `occult_hf.kernels`,
    `occult_hf.eval`: a folder is one room), or itself for a top-level module (`occult_hf.moe`)."""
    return ".".join(module.split(".")[:2])


def test_the_rooms_stand_on_at_most_eight_floors_with_no_cycle_between_them():
    """Between the package's rooms (top-level subpackages and modules) the imports form no cycle either, and the
    rooms stand on at most `MAX_FLOORS` floors: a room one floor above the highest room it imports when it is
    imported (the load order; an import inside a function runs later, and counts for the cycles above). The root
    package `occult_hf`, which only hands names on, is no floor of its own."""
    graph = import_graph()
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        rooms.setdefault(_room(module), set()).update(_room(name) for name in imported if _room(name) != _room(module))
    cycles = _cycles(rooms)
    assert not cycles, "rooms that import each other:\n" + "\n".join(
        f"{a} -> {b}: " + ", ".join(sorted(f"{m} -> {n}" for m, ns in graph.items() for n in ns if _room(m) == a and _room(n) == b))
        for c in cycles for a in c for b in sorted(rooms[a] & set(c))
    )  # fmt: skip
    loaded: dict[str, set[str]] = {}
    for module, imported in import_graph(at_import=True).items():
        loaded.setdefault(_room(module), set()).update(_room(name) for name in imported if _room(name) not in (_room(module), "occult_hf"))

    @functools.cache
    def floor(room: str) -> int:
        return 1 + max((floor(below) for below in loaded[room]), default=0)

    tallest = max(loaded, key=floor)
    chain = [tallest]
    while loaded[chain[-1]]:
        chain.append(max(loaded[chain[-1]], key=floor))
    assert floor(tallest) <= MAX_FLOORS, f"{floor(tallest)} floors: " + " -> ".join(chain)


def test_relative_imports_stay_inside_their_source_folder():
    """`from .kernels import x` in src/occult_hf/ works only installed (kernels/ is a top-level folder
    that setup.cfg maps into occult_hf); so does `from ..config import x` in patches/. Imports that
    cross a mapped folder use the absolute name (`occult_hf.kernels`, `occult_hf.config`)."""
    wrong = []
    for module, path in _package_files().items():
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            folder = path.parent
            for _ in range(node.level - 1):
                folder = folder.parent
            candidate = folder.joinpath(*node.module.split(".")) if node.module else folder
            if not (candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file()):
                wrong.append(f"{path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
    assert not wrong, "relative imports that resolve only in the installed layout:\n" + "\n".join(wrong)


#: the applications on top of the library: commands, benchmarks, studies, the lm-eval hook, the fine-tune
#: script. They may import the library and each other; no library module imports one of them.
APPLICATIONS = ("occult_hf.benchmarks", "occult_hf.scale", "occult_hf.eval.studies", "occult_hf.cli", "occult_hf.eval", "occult_hf.hf.finetune")


def _is_application(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in APPLICATIONS)


def test_library_modules_import_no_application():
    """A planner that reads a benchmark's table, or a metric that calls a study, makes the library depend
    on what is built on it: move what both need below both (e.g. `occult_hf.expert_shapes`, the model
    shapes that the benchmarks time and `placement.slowest` reads)."""
    graph = import_graph()
    assert "occult_hf.expert_shapes" in graph["occult_hf.placement.slowest"]  # the rule sees lazy and eager imports alike
    wrong = sorted(f"{module} -> {target}" for module, targets in graph.items() if not _is_application(module)
                   for target in targets if _is_application(target))  # fmt: skip
    assert not wrong, "library modules that import an application (" + ", ".join(APPLICATIONS) + "):\n" + "\n".join(wrong)


#: a shape-suffixed name: `x_TH`, `topk_ids_Tk`, `gate_up_proj_E2IH` (constants are all capitals: not matched)
_SHAPED_NAME = re.compile(r"\b[a-z][a-z0-9_]*?_([A-Z][A-Z0-9]*k?)\b")


def _legend_paragraph(text: str, files: dict[str, Path]) -> str:
    """A file's "Shape legend" paragraph, plus that of the module it points to (`see `occult_hf.x``)."""
    match = re.search(r"Shape legend(.*?)(?:\n\s*\n|\"\"\")", text, re.S)
    if not match:
        return ""
    paragraph = match.group(1)
    for ref in re.findall(r"see `(occult_hf[.\w]*)`", paragraph):
        if ref in files:
            paragraph += _legend_paragraph(files[ref].read_text(), files)
    return paragraph


def test_shape_letters_follow_the_one_legend():
    """Every capital letter in a shape suffix is one of docs/conventions.md's table, or one of the letters
    it leaves for local use and the file's own "Shape legend" says what it means there. (Whether a table
    letter means the table's thing is for review; a letter that is in no legend is caught here.)"""
    section = (Path(__file__).parents[1] / "docs" / "conventions.md").read_text().split("## Shape letters", 1)[1]
    table = set(re.findall(r"^\| `([A-Za-z])` \|", section, re.M))
    local = set(re.findall(r"`([A-Z])`", re.search(r"Letters left for a file's own use:([^;]*);", section).group(1)))
    assert {"T", "E", "D", "R", "O"} <= table and local and not local & table
    files = _package_files()
    paths = list(files.values()) + sorted(Path(__file__).parent.glob("*.py"))
    wrong = []
    for path in paths:
        text = path.read_text()
        legend = None
        for match in _SHAPED_NAME.finditer(text):
            for letter in sorted(set(re.sub(r"[0-9k]", "", match.group(1))) - table):
                legend = _legend_paragraph(text, files) if legend is None else legend
                if letter not in local or not re.search(rf"\b{letter}\b", legend):
                    wrong.append(f"{path}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)} ({letter})")
    assert not wrong, "shape letters in no legend (docs/conventions.md, or the file's own for F/K/Q/X):\n" + "\n".join(wrong)


def _imported_names(path: Path, module: str):
    """`(line, absolute source module, name)` of every `from ... import name` of `path` (module `module`)."""
    files = _package_files()
    is_package = path.name == "__init__.py"
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for alias in node.names:
                yield node.lineno, source, alias.name, f"{source}.{alias.name}" in files


def test_no_module_imports_its_own_package():
    """A submodule that imports its package's `__init__` (`from . import name` of a name defined there, or the
    package by its name) while that `__init__` imports the package's submodules closes a cycle (the import graph
    leaves these edges out, since Python runs the package first anyway). Import from the submodule that defines
    the name instead."""
    graph, files = import_graph(), _package_files()
    wrong = []
    for module, path in files.items():
        if path.name in ("__init__.py", "__main__.py"):  # a `__main__` runs after its package, never from it
            continue
        package = module.rpartition(".")[0]
        loads_submodules = any(target.startswith(package + ".") for target in graph.get(package, ()))
        for line, source, name, is_module in _imported_names(path, module):
            if source == package and not is_module and package != "occult_hf" and loads_submodules:
                wrong.append(f"{path}:{line}: from {source} import {name}")
    assert not wrong, "submodules importing their own package's __init__:\n" + "\n".join(wrong)


#: what `config` may import: the name registry, the input checks, the JSON reader and writer, the package's logger,
#: the words for a difference of placements, and the placement data class it parses
CONFIG_IMPORTS = {"occult_hf.registry", "occult_hf.utils", "occult_hf.utils.checks", "occult_hf.utils.strict_json",
                  "occult_hf.utils.atomic", "occult_hf.utils.logging", "occult_hf.utils.differences", "occult_hf.placement",
                  "occult_hf.placement.placement"}  # fmt: skip


def test_config_is_a_leaf():
    """`OccultConfig` validates names against `occult_hf.registry`'s declarations: it imports no dispatcher, expert
    backend, pruning policy, replica rule, kernel or the transformers wing."""
    extra = sorted(import_graph()["occult_hf.config"] - CONFIG_IMPORTS)
    assert not extra, f"occult_hf.config imports {extra}; it may import only {sorted(CONFIG_IMPORTS)}"


def test_no_module_imports_another_packages_private_names():
    """`from occult_hf.x import _name` outside the package `occult_hf.x` belongs to: a private name is the package's
    own; what another package needs, it makes public (or moves below both)."""
    wrong = []
    for module, path in _package_files().items():
        for line, source, name, is_module in _imported_names(path, module):
            if not source.startswith("occult_hf") or not name.startswith("_") or name.startswith("__"):
                continue
            owner = source if is_module or source in ROOT_PACKAGES else source.rpartition(".")[0]
            if not (module == owner or module.startswith(owner + ".")):
                wrong.append(f"{path}:{line}: from {source} import {name}")
    assert not wrong, "private names imported across packages:\n" + "\n".join(wrong)


def test_no_test_imports_another_test_file():
    """Shared test code lives in helper modules (`tiny_models`, `distributed`, `corpus_files`, ...), never in a
    `test_*.py` that another test file imports: pytest would collect its tests twice and the two files' fixtures and
    marks would mix."""
    wrong = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name}:{node.lineno}: imports {name}" for name in names if name.split(".")[0].startswith("test_")]
    assert not wrong, "test files importing test files:\n" + "\n".join(wrong)


def _module_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds when it is imported: definitions, assignments and imports outside every function and
    class body (inside `if`/`try` blocks too)."""
    names = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in child.names)
            elif isinstance(child, (ast.Assign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            visit(child)

    visit(tree)
    return names


def test_every_exported_name_exists():
    """Each name in a module's `__all__` is bound in it (modules with a lazy `__getattr__` aside): a name left there
    after its definition went makes `from module import *` raise AttributeError."""
    missing = []
    for module, path in _package_files().items():
        tree = ast.parse(path.read_text(), str(path))
        exported = [
            element.value
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            for element in getattr(node.value, "elts", ())
            if isinstance(element, ast.Constant)
        ]
        bound = _module_level_names(tree)
        if exported and "__getattr__" not in bound:
            missing += [f"{module}: {name}" for name in exported if name not in bound]
    assert not missing, "names in __all__ that the module does not define:\n" + "\n".join(missing)


def test_library_modules_point_at_no_file_outside_the_repository():
    """A user of the package has only the package: a library module's text names no file beside the repository (the
    project's development data, design notes). Applications may take such data as arguments or defaults."""
    wrong = [
        f"{path}:{number}: {line.strip()[:120]}"
        for module, path in _package_files().items()
        if not _is_application(module)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.\./shared\b|\bDESIGN\.md\b|\bBASELINES\.md\b", line)
    ]
    assert not wrong, "library modules that point outside the repository:\n" + "\n".join(wrong)
