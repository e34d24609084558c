"""The package's import structure, read from the source: no module imports one that imports it
back, the core stands without the bench, the Hub packaging and the tuner, no package reaches
into another's private names, the tuner takes from the core only the names it declares
(`hf_selfspec/tuner_api.py`), its rooms do not import each other in a circle, and tests and code
import the tuner by one path.

Imports inside functions and under `TYPE_CHECKING` count: they run later or never, but a circle
through them still ties two modules' designs together, and a private name read from another
package still breaks when that package changes what it keeps to itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").is_file())
# The tuner keeps its own folder but installs as hf_selfspec.tuning (pyproject.toml's package-dir).
LIBRARY_DIRS = {"hf_selfspec": ROOT / "hf_selfspec", "hf_selfspec.tuning": ROOT / "tuning"}
TESTS_DIRS = {"tests": ROOT / "tests"}
# `hf-selfspec package` copies the entry point beside the core modules, where its relative
# imports resolve (hf_selfspec/hub/package.py); where it lies it is never imported.
RELATIVE_TO = {"hf_selfspec.hub.generate_entry": "hf_selfspec"}
CORE = "hf_selfspec"
OUTSIDE_THE_CORE = ("hf_selfspec.bench", "hf_selfspec.hub", "hf_selfspec.tuning")
TUNER = "hf_selfspec.tuning"
TUNER_SURFACE = "hf_selfspec.tuner_api"
# Importing the tuner by its folder's name would load a second copy of every module under it.
FOLDER_PATH = "tuning"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    shown: str  # its path from the folder that holds its package's folder
    package: str  # the package it belongs to: itself for an `__init__.py`
    relative_to: str  # the package its relative imports start from


@dataclass(frozen=True)
class Import:
    importer: Module
    target: str  # a module, or a name `from` one that is not a module
    names: tuple[str, ...]  # the names `from target import ...` takes; empty for a module
    line: int

    def where(self) -> str:
        return f"{self.importer.shown}:{self.line}"


def find_modules(package_dirs: Mapping[str, Path], relative_to: Mapping[str, str] | None = None) -> dict[str, Module]:
    """Every `.py` file under each package's folder, by its dotted name once installed."""
    relative_to = relative_to or {}
    modules = {}
    for package, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_init = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_init else parts)))
            own_package = name if is_init else name.rpartition(".")[0]
            shown = path.relative_to(folder.parent).as_posix()
            modules[name] = Module(name, path, shown, own_package, relative_to.get(name, own_package))
    return modules


def imports_of(module: Module, known: Mapping[str, Module]) -> list[Import]:
    """What `module` imports, wherever in it: `from X import Y` imports module `X.Y` where that
    is a module, else the name `Y` from `X`."""
    found = []
    for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.relative_to.rsplit(".", node.level - 1)[0] if node.level > 1 else module.relative_to
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in known]
            names = tuple(alias.name for alias in node.names if f"{source}.{alias.name}" not in known)
            found += [Import(module, submodule, (), node.lineno) for submodule in submodules]
            if names:
                found.append(Import(module, source, names, node.lineno))
    return found


def import_graph(imports: list[Import], known: Mapping[str, Module]) -> dict[str, set[str]]:
    """Each module's imports among `known`, itself left out."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for found in imports:
        if found.target in known and found.target != found.importer.name:
            graph[found.importer.name].add(found.target)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import one another, as `[a, b, ..., a]`
    (Tarjan's strongly connected components, then a shortest way round within each)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                lowest[node] = min(lowest[node], lowest[successor])
            elif successor in stack:
                lowest[node] = min(lowest[node], index[successor])
        if lowest[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_way_round(graph, group) for group in groups]


def _way_round(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """A shortest way from the group's first module back to itself (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        reached = []
        for node in frontier:
            for successor in sorted(graph[node] & group):
                if successor not in came_from:
                    came_from[successor] = node
                    reached.append(successor)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def core_imports_outside(imports: list[Import], core: str, outside: tuple[str, ...]) -> list[str]:
    """Where a module of the `core` package itself imports from one of the `outside` packages."""
    return [
        f"{found.where()} imports {found.target}"
        for found in imports
        if found.importer.package == core and any(found.target == p or found.target.startswith(p + ".") for p in outside)
    ]


def private_imports_across_packages(imports: list[Import], library: Mapping[str, Module]) -> list[str]:
    """Where a module takes an underscore name from a library module of another package."""
    return [
        f"{found.where()} imports {name} from {found.target}"
        for found in imports
        if found.target in library and library[found.target].package != found.importer.package
        for name in found.names
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    ]


def declared_names(module: Module) -> set[str]:
    """The names a module lists in its `__all__`."""
    for node in ast.parse(module.path.read_text(encoding="utf-8"), str(module.path)).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return {element.value for element in node.value.elts}
    return set()


def core_imports_around_the_surface(
    imports: list[Import], library: Mapping[str, Module], tuner: str, core: str, surfaces: Mapping[str, set[str]]
) -> list[str]:
    """Where a module of the `tuner` imports a module of the `core` package other than one of the
    `surfaces`, or a name a surface does not declare."""
    found = []
    for each in imports:
        if not _inside(each.importer.name, tuner) or each.target not in library:
            continue
        if library[each.target].package != core:
            continue  # the bench's or the Hub packaging's: packages of their own
        if each.target not in surfaces:
            found.append(f"{each.where()} imports {each.target}")
            continue
        found += [f"{each.where()} imports {name} from {each.target}, undeclared"
                  for name in each.names if name not in surfaces[each.target]]  # fmt: skip
    return found


def names_taken_from(imports: Iterable[Import], target: str, importers: str) -> set[str]:
    """The names modules under `importers` take from `target`."""
    return {name for each in imports if each.target == target and _inside(each.importer.name, importers) for name in each.names}


def names_imported_by(imports: Iterable[Import], importer: str) -> set[str]:
    """The names one module takes from others (`from X import Y`, Y not a module)."""
    return {name for each in imports if each.importer.name == importer for name in each.names}


def rooms_graph(imports: list[Import], library: Mapping[str, Module], parent: str) -> dict[str, set[str]]:
    """Which of `parent`'s sub-packages (its rooms) import which, wherever in them."""
    def room(name: str) -> str | None:
        parts = name.split(".")
        depth = len(parent.split("."))
        candidate = ".".join(parts[: depth + 1])
        is_room = len(parts) > depth and candidate in library and library[candidate].path.name == "__init__.py"
        return candidate if is_room else None

    graph: dict[str, set[str]] = {name: set() for name in library if room(name) == name}
    for each in imports:
        importer, target = room(each.importer.name), room(each.target)
        if importer and target and importer != target:
            graph[importer].add(target)
    return graph


def imports_by_folder_path(imports: Iterable[Import], folder_path: str) -> list[str]:
    """Where a module imports a package by its folder's name rather than its installed name."""
    return [f"{each.where()} imports {each.target}" for each in imports if _inside(each.target, folder_path)]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _library_imports() -> tuple[dict[str, Module], list[Import]]:
    library = find_modules(LIBRARY_DIRS, RELATIVE_TO)
    return library, [found for module in library.values() for found in imports_of(module, library)]


def test_no_module_imports_one_that_imports_it_back():
    library, imports = _library_imports()
    found = [circle for circle in circles(import_graph(imports, library))]
    assert not found, "import circles: " + "; ".join(" -> ".join(circle) for circle in found)


def test_the_core_imports_neither_the_bench_nor_the_hub_packaging_nor_the_tuner():
    _, imports = _library_imports()
    assert core_imports_outside(imports, CORE, OUTSIDE_THE_CORE) == []


def test_no_package_and_no_test_imports_another_packages_private_names():
    library, imports = _library_imports()
    tests = find_modules(TESTS_DIRS)
    imports += [found for module in tests.values() for found in imports_of(module, {**library, **tests})]
    assert private_imports_across_packages(imports, library) == []


def _surfaces(library: Mapping[str, Module]) -> dict[str, set[str]]:
    return {name: declared_names(library[name]) for name in (CORE, TUNER_SURFACE)}


def test_the_tuner_takes_from_the_core_only_the_names_it_declares():
    library, imports = _library_imports()
    assert core_imports_around_the_surface(imports, library, TUNER, CORE, _surfaces(library)) == []


def test_the_tuners_surface_declares_what_the_tuner_takes_and_nothing_else():
    library, imports = _library_imports()
    declared = declared_names(library[TUNER_SURFACE])
    assert names_imported_by(imports, TUNER_SURFACE) == declared, "__all__ lists what it imports"
    assert names_taken_from(imports, TUNER_SURFACE, TUNER) == declared, "the tuner uses every declared name"


def test_the_tuners_rooms_do_not_import_each_other_in_a_circle():
    library, imports = _library_imports()
    graph = rooms_graph(imports, library, TUNER)
    assert {"hf_selfspec.tuning.costmodel", "hf_selfspec.tuning.studies", "hf_selfspec.tuning.training"} <= set(graph)
    assert circles(graph) == []


def test_tests_and_code_import_the_tuner_by_one_path():
    library, imports = _library_imports()
    tests = find_modules(TESTS_DIRS)
    imports += [found for module in tests.values() for found in imports_of(module, {**library, **tests})]
    assert imports_by_folder_path(imports, FOLDER_PATH) == []


def test_the_study_config_is_read_only_where_a_command_starts():
    """Read once into a `StudyConfig`, which the rest receives: nothing below the commands parses
    the file again."""
    _, imports = _library_imports()
    readers = {found.importer.name for found in imports if "load_study_config" in found.names}
    assert readers == {"hf_selfspec.tuning.cli", "hf_selfspec.tuning.optimize"}


def test_the_reading_covers_every_package_and_the_imports_inside_functions():
    library, imports = _library_imports()
    assert {"hf_selfspec.mixin", "hf_selfspec.bench.cli", "hf_selfspec.hub.package", "hf_selfspec.tuning.cli"} <= set(library)
    graph = import_graph(imports, library)
    # loading.py imports the embedded model's loader only inside load_model_and_tokenizer
    assert "hf_selfspec.embedded" in graph["hf_selfspec.loading"]
    # the packaged entry point imports the core beside which it is copied
    assert "hf_selfspec.mixin" in graph["hf_selfspec.hub.generate_entry"]


def _planted(tmp_path: Path, files: dict[str, str]) -> tuple[dict[str, Module], list[Import]]:
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    modules = find_modules({"pkg": tmp_path / "pkg", "tests": tmp_path / "tests"})
    return modules, [found for module in modules.values() for found in imports_of(module, modules)]


def test_a_planted_circle_through_a_function_level_import_is_found(tmp_path):
    modules, imports = _planted(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import run\n",
        "pkg/b.py": "def run():\n    from . import c\n",
        "pkg/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import x\n",
        "pkg/d.py": "from .a import run\n",
    })
    assert circles(import_graph(imports, modules)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def test_a_planted_core_import_of_the_tuner_is_found(tmp_path):
    _, imports = _planted(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core.py": "def tune():\n    from .tuning.study import run\n",
        "pkg/tuning/__init__.py": "from ..core import tune\n",
        "pkg/tuning/study.py": "",
    })
    assert core_imports_outside(imports, "pkg", ("pkg.tuning",)) == ["pkg/core.py:2 imports pkg.tuning.study"]


def test_a_planted_private_import_across_packages_is_found(tmp_path):
    modules, imports = _planted(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core.py": "from .bench import _helper\n",  # the package's __init__ is another package's
        "pkg/other.py": "from .core import _kept, __version__\n",  # same package: its own business
        "pkg/bench/__init__.py": "_helper = 1\n",
        "pkg/bench/run.py": "from ..core import public, _secret\n",
        "tests/test_run.py": "from pkg.bench.run import _step\nfrom helpers import _fixture\n",
    })
    assert sorted(private_imports_across_packages(imports, modules)) == [
        "pkg/bench/run.py:1 imports _secret from pkg.core",
        "pkg/core.py:1 imports _helper from pkg.bench",
        "tests/test_run.py:1 imports _step from pkg.bench.run",
    ]


def test_a_planted_import_around_the_surface_is_found(tmp_path):
    modules, imports = _planted(tmp_path, {
        "pkg/__init__.py": "__all__ = ['enable']\nfrom .core import enable\n",
        "pkg/core.py": "def enable(): ...\ndef inner(): ...\n",
        "pkg/surface.py": "from .core import enable\n__all__ = ['enable']\n",
        "pkg/bench/__init__.py": "",
        "pkg/tuning/__init__.py": "",
        "pkg/tuning/a.py": "from pkg.surface import enable\nfrom pkg import enable\nfrom pkg.bench import run\n",
        "pkg/tuning/b.py": "def f():\n    from pkg.core import inner\n    from pkg.surface import inner\n",
    })
    surfaces = {name: declared_names(modules[name]) for name in ("pkg", "pkg.surface")}
    assert core_imports_around_the_surface(imports, modules, "pkg.tuning", "pkg", surfaces) == [
        "pkg/tuning/b.py:2 imports pkg.core",
        "pkg/tuning/b.py:3 imports inner from pkg.surface, undeclared",
    ]
    assert names_taken_from(imports, "pkg.surface", "pkg.tuning") == {"enable", "inner"}


def test_a_planted_circle_between_rooms_and_a_folder_path_are_found(tmp_path):
    modules, imports = _planted(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/top.py": "from .rooms.a import x\n",
        "pkg/rooms/__init__.py": "",
        "pkg/rooms/a/__init__.py": "",
        "pkg/rooms/a/one.py": "from ..b.two import y\n",
        "pkg/rooms/b/__init__.py": "",
        "pkg/rooms/b/two.py": "def f():\n    from ..a import one\n",
        "pkg/rooms/c/__init__.py": "from ..a.one import x\n",
        "tests/test_x.py": "from rooms.a import one\nimport pkg.rooms.a\n",
    })
    graph = rooms_graph(imports, modules, "pkg.rooms")
    assert graph == {"pkg.rooms.a": {"pkg.rooms.b"}, "pkg.rooms.b": {"pkg.rooms.a"}, "pkg.rooms.c": {"pkg.rooms.a"}}
    assert circles(graph) == [["pkg.rooms.a", "pkg.rooms.b", "pkg.rooms.a"]]
    assert imports_by_folder_path(imports, "rooms") == ["tests/test_x.py:1 imports rooms.a"]
