"""Rewrite the package's docstrings from reStructuredText into what the documentation site renders
(mkdocstrings: Markdown, with autorefs cross-references). Idempotent: a second run changes nothing.

What it converts, in docstrings, ``#:`` comments and the multi-line strings a class attribute's factory
call takes (``x = _option("x", '''its doc''')``, a property's doc), never in code or other strings:

* the roles ``:class:`` ``:func:`` ``:meth:`` ``:attr:`` ``:mod:`` ``:data:`` ``:exc:`` ``:obj:`` (with or
  without ``py:``, ``~`` and ``title <target>``) into ``[`name`][fully.qualified.identifier]``. A target is
  resolved as Python would from where the docstring is (its class, its module, the module's packages; a
  leading dot searches by suffix), and linked to the identifier under which the site documents it (its
  ``objects.inv``: where it is defined, or the alias a page documents it under). A target the site does not
  document (a private helper, torch, sentence-transformers) becomes plain code: ``[`x`][id]`` to a missing
  identifier would fail ``mkdocs build --strict``;
* grid tables (``+---+`` borders) into Markdown pipe tables;
* literal blocks (``::`` on its own line, or a paragraph ending in ``::``) into fenced code blocks
  (``python`` when the block parses as Python, ``text`` otherwise).

``double backticks`` are left alone: Markdown renders them as code.

Usage (from the repository root; re-run it after merging work that moved or added docstrings)::

    PYTHONPATH=$PWD .venv/bin/python tools/md_docstrings.py            # rewrite st_cached_losses/ in place
    PYTHONPATH=$PWD .venv/bin/python tools/md_docstrings.py --check    # exit 1 and list what is left

The identifiers come from ``--inventory site/objects.inv`` when given, otherwise from a (non-strict) build of
the site into a temporary folder (about a minute). Build the site again afterwards with ``--strict``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import io
import itertools
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "st_cached_losses"

ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|exc|obj):`([^`]+)`")
GRID_BORDER = re.compile(r"^(\s*)\+(?:[-=]+\+)+\s*$")
LITERAL_ALONE = re.compile(r"^(\s*)::\s*$")
LITERAL_END = re.compile(r"^(\s*)(\S.*?)::\s*$")
FENCE = re.compile(r"^\s*```")
CODE_SPAN = re.compile(r"``.+?``", re.DOTALL)


# ---------------------------------------------------------------- the site's identifiers


@dataclass
class Inventory:
    """The identifiers the site documents: ``primary`` where an object is rendered, ``secondary`` the aliases
    (``st_cached_losses.CachedMNRLoss``) autorefs also resolves."""

    primary: set[str] = field(default_factory=set)
    secondary: set[str] = field(default_factory=set)

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.primary or identifier in self.secondary

    @classmethod
    def read(cls, path: Path) -> Inventory:
        data = path.read_bytes()
        start = 0
        for _ in range(4):  # four header lines, then the zlib stream
            start = data.index(b"\n", start) + 1
        out = cls()
        for line in zlib.decompress(data[start:]).decode().splitlines():
            name, _domain, priority, *_ = line.split(" ")
            (out.primary if priority == "1" else out.secondary).add(name)
        return out


def build_inventory() -> Inventory:
    """Build the site (not strict) into a temporary folder and read its ``objects.inv``."""
    with tempfile.TemporaryDirectory() as site:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", site],
            cwd=ROOT,
            env=env,
            check=True,
        )
        return Inventory.read(Path(site) / "objects.inv")


# ---------------------------------------------------------------- resolving a role's target


def _import_path(path: str) -> tuple[Any, Any, str] | None:
    """``(object, owner, last name)`` for a dotted path: the longest importable module prefix, then
    attributes; None when it does not resolve."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that fails to import is no target
            return None
        owner: Any = None
        for part in parts[cut:]:
            # a class's own dict first: a property or a descriptor is documented as such, not its value
            if inspect.isclass(obj):
                found = next((vars(k)[part] for k in obj.__mro__ if part in vars(k)), _MISSING)
            else:
                found = getattr(obj, part, _MISSING)
            if found is _MISSING:
                return None
            owner, obj = obj, found
        return obj, owner, parts[-1]
    return None


_MISSING = object()


def _defined_path(obj: Any) -> str | None:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<locals>" not in qualname:
        return f"{module}.{qualname}"
    return None


def _candidates(obj: Any, owner: Any, name: str, written: str, inventory: Inventory) -> list[str]:
    """Identifiers that document this object, best first."""
    out = [written]
    if inspect.isclass(owner):
        out.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
        out += [f"{k.__module__}.{k.__qualname__}.{name}" for k in owner.__mro__ if name in vars(k)]
    elif isinstance(owner, types.ModuleType):
        out.append(f"{owner.__name__}.{name}")
    defined = _defined_path(obj)
    if defined is not None:
        out.append(defined)
    # anything else the site documents under the same name that is this very object
    for identifier in sorted(inventory.primary | inventory.secondary):
        if identifier.rsplit(".", 1)[-1] == name and identifier not in out:
            found = _import_path(identifier)
            if found is not None and found[0] is obj:
                out.append(identifier)
    return out


def _scopes(module: str, qualname: str | None) -> list[str]:
    """Where a name in a docstring is looked up: the enclosing classes, the module, its packages, the top."""
    scopes = []
    if qualname:
        parts = qualname.split(".")
        scopes += [f"{module}.{'.'.join(parts[:i])}" for i in range(len(parts), 0, -1)]
    parts = module.split(".")
    scopes += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return [*scopes, ""]


def _shared_parts(a: str, b: str) -> int:
    """How many leading dotted parts two paths share."""
    return next(
        (n for n, (x, y) in enumerate(zip(a.split("."), b.split("."))) if x != y),
        min(a.count("."), b.count(".")) + 1,
    )


def resolve(target: str, module: str, qualname: str | None, inventory: Inventory) -> str | None:
    """The site's identifier for a role's target, seen from a docstring in ``module`` (inside the class
    ``qualname``); None when the site documents no such object."""
    relative = target.startswith(".")
    target = target.lstrip(".")
    for scope in _scopes(module, qualname):
        written = f"{scope}.{target}" if scope else target
        found = _import_path(written)
        if found is None:
            continue
        obj, owner, name = found
        for identifier in _candidates(obj, owner, name, written, inventory):
            if identifier in inventory.primary:
                return identifier
        for identifier in _candidates(obj, owner, name, written, inventory):
            if identifier in inventory.secondary:
                return identifier
        if not relative:
            return None
    if relative:  # Sphinx's ``.name``: any documented object whose path ends with it, the nearest first
        matches = [i for i in inventory.primary if i.endswith(f".{target}")]
        if matches:
            return max(matches, key=lambda i: (_shared_parts(i, module), -len(i)))
    return None


# ---------------------------------------------------------------- converting one docstring's text


@dataclass
class Report:
    links: int = 0
    plain: list[str] = field(default_factory=list)
    tables: int = 0
    blocks: int = 0


def convert_roles(text: str, module: str, qualname: str | None, inventory: Inventory, report: Report) -> str:
    def replace(match: re.Match[str]) -> str:
        body = match.group(2).strip()
        explicit = re.fullmatch(r"(.*?)\s*<([^>]+)>", body)
        if explicit:
            title, target = explicit.group(1), explicit.group(2)
        else:
            short = body.startswith("~")
            target = body.lstrip("~")
            title = target.lstrip(".").rsplit(".", 1)[-1] if short else target.lstrip(".")
        identifier = resolve(target.lstrip("~"), module, qualname, inventory)
        if identifier is None:
            report.plain.append(f"{module}: {match.group(0)}")
            return f"`{title}`"
        report.links += 1
        return f"[`{title}`][{identifier}]"

    # a role quoted in a code span (``:class:`x` ``) is text about roles: left as written
    spans = [m.span() for m in CODE_SPAN.finditer(text)]
    return ROLE.sub(
        lambda m: m.group(0) if any(a <= m.start() < b for a, b in spans) else replace(m),
        text,
    )


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _table_row(cells: list[str], indent: str) -> str:
    return indent + "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def convert_grid_tables(lines: list[str], report: Report) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        border = GRID_BORDER.match(lines[i])
        if not border:
            out.append(lines[i])
            i += 1
            continue
        indent = border.group(1)
        start = i
        while i < len(lines) and lines[i].strip()[:1] in ("+", "|") and lines[i].strip():
            i += 1
        table = [line[len(indent) :].rstrip() for line in lines[start:i]]
        cuts = [j for j, char in enumerate(table[0]) if char == "+"]
        rows: list[list[str]] = []
        header_rows = 0
        current: list[list[str]] | None = None
        for line in table:
            if line.startswith("+"):
                if current:
                    rows.append([" ".join(part for part in cell if part) for cell in current])
                current = [[] for _ in cuts[:-1]]
                if "=" in line:
                    header_rows = len(rows)
                continue
            assert current is not None
            for k, (a, b) in enumerate(itertools.pairwise(cuts)):
                current[k].append(line[a + 1 : b].strip())
        header_rows = header_rows or 1
        header, body = rows[:header_rows], rows[header_rows:]
        # a Markdown table has one header row: several are joined cell by cell
        head = [" ".join(cell for cell in column if cell) for column in zip(*header)]

        out += [
            _table_row(head, indent),
            indent + "|" + "|".join("---" for _ in head) + "|",
            *(_table_row(r, indent) for r in body),
        ]
        report.tables += 1
    return out


def convert_literal_blocks(lines: list[str], report: Report) -> list[str]:
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        alone, end = LITERAL_ALONE.match(line), LITERAL_END.match(line)
        if in_fence or not (alone or end):
            out.append(line)
            i += 1
            continue
        # the block: the blank lines after the marker, then lines indented deeper than the paragraph
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= _indent(line):
            out.append(line)  # no block follows: not a literal block
            i += 1
            continue
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > _indent(line)):
            k += 1
        while not lines[k - 1].strip():
            k -= 1
        block = textwrap.dedent("\n".join(lines[j:k])).splitlines()
        try:
            ast.parse("\n".join(block))
            language = "python"
        except SyntaxError:
            language = "text"
        pad = " " * _indent(line)
        if end:
            out += [pad + end.group(2) + ":", ""]
        out += [f"{pad}```{language}", *((pad + b).rstrip() for b in block), f"{pad}```"]
        report.blocks += 1
        i = k
    return out


def convert_text(text: str, module: str, qualname: str | None, inventory: Inventory, report: Report) -> str:
    text = convert_roles(text, module, qualname, inventory, report)
    lines = text.split("\n")
    lines = convert_grid_tables(lines, report)
    lines = convert_literal_blocks(lines, report)
    return "\n".join(lines)


# ---------------------------------------------------------------- finding docstrings in a file


def _docstring_lines(tree: ast.Module) -> dict[int, str | None]:
    """First line of every docstring (module, class, function, attribute) -> the qualname of its class."""
    out: dict[int, str | None] = {}

    def visit(body: list[ast.stmt], qualname: str | None, in_class: bool) -> None:
        for index, node in enumerate(body):
            is_string = (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            )
            if is_string and (index == 0 or isinstance(body[index - 1], ast.Assign | ast.AnnAssign)):
                out[node.lineno] = qualname if in_class else _enclosing(qualname)
            if in_class and isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                # a property built by a factory: ``x = _option("name", """its docstring""")``
                for arg in [*node.value.args, *(k.value for k in node.value.keywords)]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "\n" in arg.value:
                        out[arg.lineno] = qualname
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{qualname}.{node.name}" if qualname else node.name, True)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, f"{qualname}.{node.name}" if qualname else node.name, False)

    visit(tree.body, None, False)
    return out


def _enclosing(qualname: str | None) -> str | None:
    """A function's docstring resolves names in its class (a method), not in the function itself."""
    return qualname.rsplit(".", 1)[0] if qualname and "." in qualname else None


def _class_at(tree: ast.Module, line: int) -> str | None:
    best: str | None = None

    def visit(body: list[ast.stmt], qualname: str | None) -> None:
        nonlocal best
        for node in body:
            if isinstance(node, ast.ClassDef) and node.lineno <= line <= (node.end_lineno or 0):
                best = f"{qualname}.{node.name}" if qualname else node.name
                visit(node.body, best)

    visit(tree.body, None)
    return best


def convert_source(source: str, module: str, inventory: Inventory, report: Report) -> str:
    tree = ast.parse(source)
    docstrings = _docstring_lines(tree)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits: list[tuple[int, int, str]] = []
    for token in tokens:
        (row, col), (end_row, end_col) = token.start, token.end
        if token.type == tokenize.STRING and row in docstrings:
            prefix = re.match(r"[rRuU]*", token.string).group(0)  # type: ignore[union-attr]
            quote = token.string[len(prefix) : len(prefix) + 3]
            quote = quote if quote in ('"""', "'''") else quote[0]
            inner = token.string[len(prefix) + len(quote) : -len(quote)]
            new = convert_text(inner, module, docstrings[row], inventory, report)
            if new != inner:
                edits.append(
                    (offsets[row - 1] + col, offsets[end_row - 1] + end_col, prefix + quote + new + quote)
                )
        elif token.type == tokenize.COMMENT and token.string.startswith("#:"):
            new = convert_roles(token.string, module, _class_at(tree, row), inventory, report)
            if new != token.string:
                edits.append((offsets[row - 1] + col, offsets[end_row - 1] + end_col, new))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return source


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inventory", type=Path, help="the site's objects.inv (default: build the site)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    parser.add_argument("paths", nargs="*", type=Path, help=f"files or folders (default: {PACKAGE}/)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    inventory = Inventory.read(args.inventory) if args.inventory else build_inventory()
    paths = args.paths or [ROOT / PACKAGE]
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    report = Report()
    changed = []
    for path in files:
        path = path.resolve()
        source = path.read_text()
        new = convert_source(source, module_name(path), inventory, report)
        if new != source:
            changed.append(path)
            if args.check:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        source.splitlines(keepends=True),
                        new.splitlines(keepends=True),
                        str(path.relative_to(ROOT)),
                        str(path.relative_to(ROOT)),
                        n=0,
                    )
                )
            else:
                path.write_text(new)
    for line in report.plain:
        print(f"not documented on the site, left as code: {line}", file=sys.stderr)
    print(
        f"{len(changed)} file(s) {'to change' if args.check else 'changed'}: {report.links} cross-reference(s), "
        f"{len(report.plain)} plain code, {report.tables} grid table(s), {report.blocks} literal block(s)",
        file=sys.stderr,
    )
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
