"""Sizes a reader can hold: no source file of the package or the tuner over `FILE_LINES` lines,
and no function over `FUNCTION_LINES`, so that a file has one job and a function reads in one
sitting. A CLI parser builder is exempt: it is a flat list of options, longer but no harder to
read. One is recognised by its name (`add_parser...`, `build_parser...`) or by its statements:
at least half of them are calls of `.add_argument`, each option one statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").is_file())
SOURCE_DIRS = (ROOT / "hf_selfspec", ROOT / "tuning")
FILE_LINES = 500
FUNCTION_LINES = 80
PARSER_BUILDER_PREFIXES = ("add_parser", "build_parser")


def is_parser_builder(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    if function.name.startswith(PARSER_BUILDER_PREFIXES):
        return True
    statements = [node for node in ast.walk(function) if isinstance(node, ast.stmt) and node is not function]
    options = [
        node
        for node in statements
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "attr", None) == "add_argument"
    ]
    return bool(statements) and 2 * len(options) >= len(statements)


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[tuple[str, int]]:
    """Each function (nested ones and methods too) over `limit` lines, decorators aside, with its
    length; parser builders left out."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
        and not is_parser_builder(node)
    ]


def _sources() -> list[Path]:
    return sorted(path for folder in SOURCE_DIRS for path in folder.rglob("*.py"))


def test_no_source_file_is_over_the_limit():
    lines = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in _sources()}
    over = [f"{path.relative_to(ROOT)}: {count} lines" for path, count in lines.items() if count > FILE_LINES]
    assert over == [], f"split these by job (at most {FILE_LINES} lines each):\n" + "\n".join(over)


def test_no_function_is_over_the_limit():
    over = [
        f"{path.relative_to(ROOT)}: {name}, {count} lines"
        for path in _sources()
        for name, count in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert over == [], f"split these by job (at most {FUNCTION_LINES} lines each):\n" + "\n".join(over)


def test_a_planted_long_function_is_found_and_a_parser_builder_is_not():
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    options = "".join(f"    parser.add_argument('--o{i}')\n" for i in range(5))
    source = (
        f"def long():\n{body}\n"
        f"def add_parser_for_tune(parser):\n{body}\n"
        f"def options(parser):\n    parser.set_defaults(x=1)\n{options}\n"
        f"def half(parser):\n{body}{options}\n"
        f"def short():\n    return 1\n"
    )
    assert long_functions(source, limit=4) == [("long", 6)]
