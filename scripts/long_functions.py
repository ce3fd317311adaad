"""List functions longer than a limit (the house rule: ~80 lines), largest first.

    python scripts/long_functions.py [--limit 80] [--count] [PATH ...]

PATH defaults to the project's Python sources (agentkv plugins harness_sdk bench examples
tests). A function's length is its ``def`` line to its last line, decorators excluded, nested
functions counted inside their parent and on their own. ``--count`` prints only the number.

A function whose length is deliberate carries a one-line reason directly above its ``def`` (or
above its first decorator): ``# long because: <reason>`` (a flat CLI option list, a table
renderer). Such functions are not listed; ``--show-excused`` lists them with their reasons.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

DEFAULT_PATHS = ("agentkv", "plugins", "harness_sdk", "bench", "examples", "tests")
EXCUSE = "# long because:"


def long_functions(
    paths: list[str], limit: int, excused: bool = False
) -> list[tuple[int, str, str]]:
    """Return (lines, file:line, qualified name) for every function over ``limit`` lines that
    carries no ``# long because:`` reason; with ``excused``, only those that do (the name then
    ends with the reason)."""
    found: list[tuple[int, str, str]] = []
    for root in paths:
        files = [Path(root)] if root.endswith(".py") else sorted(Path(root).rglob("*.py"))
        for path in files:
            if ".venv" in path.parts or "build" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text, str(path))
            found.extend(_visit(tree, path, "", limit, text.splitlines(), excused))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def _reason(node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> str | None:
    """The ``# long because:`` reason on the line above the def or its first decorator."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    for lineno in {first - 1, node.lineno - 1}:
        if lineno >= 1:
            line = source[lineno - 1].strip()
            if line.startswith(EXCUSE):
                return line[len(EXCUSE) :].strip()
    return None


def _visit(
    node: ast.AST, path: Path, prefix: str, limit: int, source: list[str], excused: bool
) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}."
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            reason = _reason(child, source)
            if lines > limit and (reason is not None) == excused:
                shown = f"{name[:-1]}  ({reason})" if reason is not None else name[:-1]
                out.append((lines, f"{path}:{child.lineno}", shown))
        out.extend(_visit(child, path, name, limit, source, excused))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS))
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--count", action="store_true")
    parser.add_argument(
        "--show-excused", action="store_true", help="list those with a '# long because:' reason"
    )
    args = parser.parse_args()
    rows = long_functions(args.paths, args.limit, excused=args.show_excused)
    if args.count:
        print(len(rows))
        return 0
    for lines, where, name in rows:
        print(f"{lines:5d}  {where}  {name}")
    excused = " with a '# long because:' reason" if args.show_excused else ""
    print(f"{len(rows)} functions over {args.limit} lines{excused}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
