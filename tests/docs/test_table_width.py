"""The tables the SigLIP guide shows fit its text column at 1,400 px (issue 62): at most ``MAX_COLUMNS``
columns and no row longer than ``MAX_ROW_CHARS`` characters of text, checked on the Markdown with its
``--8<--`` snippets expanded (``benchmarks/results/siglip_quality*_compact.md``, written by
``benchmarks/siglip_quality.py``). A table inside a collapsed ``??? note`` block (the results' "All columns")
is not checked: it is hidden until opened, and scrolls sideways there.

Where the numbers come from (mkdocs-material 9.8's stylesheet and ``docs/stylesheets/extra.css``): at a
1,400 px window the root font is 20 px (125%, below 100em), the grid spans the window (extra.css lifts the
theme's 61rem cap), the two sidebars take 12.1rem (242 px) each and the content's margins 1.2rem (24 px) each,
so the text column is 1400 - 15 (a scrollbar) - 484 - 48 = 853 px. A table's text is 0.64rem (12.8 px), a
cell's padding 1.25em (16 px) a side, a header cell at least 5rem (100 px) wide. At about 0.55em (7 px) a
character (Roboto's digits are 0.56em), six columns' padding (192 px) and a row of 90 characters (634 px) take
826 px: every row fits without wrapping. A seventh column's 100 px minimum would leave too little.

Run alone: ``python -m pytest tests/docs/test_table_width.py -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "siglip.md"

#: columns of a table shown open on the guide: six 100 px minimum widths leave 253 px of the 853 px column
MAX_COLUMNS = 6
#: characters of text in one row (cells joined, markup removed): 90 x 7 px + 6 x 32 px of padding = 826 px
MAX_ROW_CHARS = 90

SNIPPET = re.compile(r'^(?P<indent>\s*)--8<-- "(?P<path>[^":]+)(?::(?P<section>[a-z][-_0-9a-z]*))?"\s*$')
SECTION = re.compile(r"--8<-- \[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]")


def expand(text: str) -> list[str]:
    """The lines of ``text`` with every ``--8<-- "path"`` / ``"path:section"`` line replaced by that file's
    lines (or its section's), indented as the snippet line, section markers dropped: as pymdownx.snippets
    does with ``base_path: ["."]``."""
    out = []
    for line in text.splitlines():
        m = SNIPPET.match(line)
        if not m:
            out.append(line)
            continue
        lines = (ROOT / m["path"]).read_text().splitlines()
        if m["section"]:
            marks = [i for i, x in enumerate(lines) if (s := SECTION.search(x)) and s["name"] == m["section"]]
            assert len(marks) == 2, (m["path"], m["section"], marks)
            lines = lines[marks[0] + 1 : marks[1]]
        out += [m["indent"] + x if x.strip() else x for x in lines if not SECTION.search(x)]
    return out


def open_tables(lines: list[str]) -> list[list[list[str]]]:
    """The tables (rows of cell texts, header first, without the separator row) outside code fences and
    collapsed ``???`` blocks."""
    tables: list[list[list[str]]] = []
    fence = False
    collapsed: int | None = None  # the indentation of the open "???" line
    previous = False
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if collapsed is not None and line.strip() and indent <= collapsed:
            collapsed = None
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and collapsed is None and re.match(r"\?\?\?(?!\+)", line.lstrip()):
            collapsed = indent
        row = not fence and collapsed is None and line.lstrip().startswith("|")
        if row and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            cells = [
                " ".join(c.replace("`", "").replace("**", "").split()) for c in line.strip()[1:-1].split("|")
            ]
            if not previous:
                tables.append([])
            tables[-1].append(cells)
        previous = row
    return tables


def too_wide(tables: list[list[list[str]]]) -> list[str]:
    """What breaks the limits: a table of more than ``MAX_COLUMNS`` columns, a row of more than
    ``MAX_ROW_CHARS`` characters."""
    problems = []
    for table in tables:
        if len(table[0]) > MAX_COLUMNS:
            problems.append(f"{len(table[0])} columns: {' | '.join(table[0])[:100]}")
        problems += [
            f"{sum(map(len, row))} characters: {' | '.join(row)[:100]}"
            for row in table
            if sum(map(len, row)) > MAX_ROW_CHARS
        ]
    return problems


def test_the_siglip_guides_open_tables_fit_1400_px():
    tables = open_tables(expand(GUIDE.read_text()))
    # its own scale and bias table and the three results' compact tables (run, start, MRR@10, ...)
    assert len(tables) == 4, [t[0] for t in tables]
    assert sum(t[0][:2] == ["run", "start: scale / bias"] for t in tables) == 3, [t[0] for t in tables]
    assert not too_wide(tables), "\n".join(too_wide(tables))


def test_the_full_tables_are_collapsed_and_the_check_can_fail():
    text = GUIDE.read_text()
    full = open_tables(expand('--8<-- "benchmarks/results/siglip_quality.md:all-columns"'))
    assert len(full) == 1 and len(full[0][0]) == 13, full[0][0]
    assert any(p.startswith("13 columns") for p in too_wide(full))
    assert any("characters" in p for p in too_wide([[["x" * (MAX_ROW_CHARS + 1)]]]))
    collapsed = open_tables(
        expand('??? note "All columns"\n\n    --8<-- "benchmarks/results/siglip_quality.md:all-columns"')
    )
    assert collapsed == []
    assert text.count(':all-columns"') == 3
