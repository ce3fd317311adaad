"""List functions longer than a limit (the house rule: ~80 lines), largest first.

    python scripts/long_functions.py [--limit 80] [--count] [PATH ...]

PATH defaults to the project's Python sources (agentkv plugins harness_sdk bench examples
tests). A function's length is its ``def`` line to its last line, decorators excluded, nested
functions counted inside their parent and on their own. ``--count`` prints only the number.
A function with a ``# long because: <reason>`` comment on the line directly above its ``def``
(or above its first decorator) is skipped: the house rule allows a long function with a reason.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

DEFAULT_PATHS = ("agentkv", "plugins", "harness_sdk", "bench", "examples", "tests")


def long_functions(paths: list[str], limit: int) -> list[tuple[int, str, str]]:
    """Return (lines, file:line, qualified name) for every function over ``limit`` lines."""
    found: list[tuple[int, str, str]] = []
    for root in paths:
        files = [Path(root)] if root.endswith(".py") else sorted(Path(root).rglob("*.py"))
        for path in files:
            if ".venv" in path.parts or "build" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            excused = _excused_lines(text)
            tree = ast.parse(text, str(path))
            found.extend(row for row in _visit(tree, path, "", limit) if row[3] not in excused)
    return sorted(((n, where, name) for n, where, name, _ in found), key=lambda r: (-r[0], r[1]))


REASON = "# long because:"


def _excused_lines(text: str) -> set[int]:
    """The lines (1-based) right below a ``# long because:`` comment: a def or its first
    decorator there is excused."""
    lines = text.splitlines()
    return {i + 2 for i, line in enumerate(lines) if line.strip().startswith(REASON)}


def _visit(node: ast.AST, path: Path, prefix: str, limit: int) -> list[tuple[int, str, str, int]]:
    """(lines, file:line, qualified name, first line incl. decorators) of each long function."""
    out: list[tuple[int, str, str, int]] = []
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}."
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            if lines > limit:
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append((lines, f"{path}:{child.lineno}", name[:-1], first))
        out.extend(_visit(child, path, name, limit))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS))
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    rows = long_functions(args.paths, args.limit)
    if args.count:
        print(len(rows))
        return 0
    for lines, where, name in rows:
        print(f"{lines:5d}  {where}  {name}")
    print(f"{len(rows)} functions over {args.limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
