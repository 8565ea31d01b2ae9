"""The package's lines as issue 33 counts them (``wc -l`` over ``st_cached_losses/**/*.py`` without ``demo/``
and the cross-encoder loss's own modules), by layer, split into code, docstrings, comments and blank lines.

Docstrings are the first string statement of a module, class or function (from the syntax tree); comments
are lines that hold only a comment; code is every other non-blank line (a message string split over lines
is code). ``python -m benchmarks.investigations.package_lines [PACKAGE_DIR] [--files]``; for another
revision, ``git archive REV st_cached_losses | tar -x -C DIR`` and pass ``DIR/st_cached_losses``.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

from benchmarks._common import ROOT

COLUMNS = ("lines", "code", "docstring", "comment", "blank")


def count(path: Path) -> dict[str, int]:
    """One module's lines by kind."""
    source = path.read_text()
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comment = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip().startswith("#")
    }
    blank = {i + 1 for i, line in enumerate(lines) if not line.strip()} - doc
    return {
        "lines": len(lines),
        "code": len(lines) - len(doc | comment | blank),
        "docstring": len(doc),
        "comment": len(comment),
        "blank": len(blank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("package", nargs="?", default=str(ROOT / "st_cached_losses"))
    parser.add_argument("--files", action="store_true", help="one row per module instead of per layer")
    args = parser.parse_args()
    package = Path(args.package)
    rows: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] == "demo" or "cross_encoder" in path.name:
            continue
        key = (
            str(relative) if args.files else (relative.parts[0] if len(relative.parts) > 1 else "(top level)")
        )
        for column, n in count(path).items():
            rows[key][column] += n
            rows["**package**"][column] += n
    print("| " + " | ".join(("module" if args.files else "layer", *COLUMNS)) + " |")
    print("|---" + "|---:" * len(COLUMNS) + "|")
    for key in sorted(rows, key=lambda k: (k == "**package**", -rows[k]["lines"])):
        print(f"| {key} | " + " | ".join(f"{rows[key][c]:,}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
