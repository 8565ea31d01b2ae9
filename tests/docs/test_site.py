"""The built documentation site reads as rendered text: no reStructuredText left in it.

The site is built once per test session (``mkdocs build --strict`` into a temporary folder, about a minute,
with this checkout first on the path so mkdocstrings reads these docstrings). Every page is then searched,
outside its code, for what Markdown does not render: a role (``:class:`X```, shown as ":class:" before the
name), a grid table (``+-----+`` borders), a literal-block marker (``::``); and the generated settings table
for Markdown read into its help texts (a regex's ``.*`` taken as emphasis). The docstrings' source is also
checked with ``tools/md_docstrings.py --check`` against the site's inventory, which names the file and line
of a role merged in since. The API reference shows no docstring of Python's built-in types (``str``'s under a
constant: ``docs/griffe_exports.py`` gives attributes their own words) and no parameter entry that documents two
arguments at once (rendered as one unknown, "required" argument). Wide tables fit (issue 54, looked at in headless
Chromium at 1,400 px): the settings table is two columns, a table of three or more columns on Configuration and
Choosing holds no long prose cell, and every page loads the stylesheet whose code blocks scroll instead of
wrapping to column 0.

Run alone: ``python -m pytest tests/docs/test_site.py -q``.
"""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# make install puts the docs tools in the environment; make test relies on this file for the site's build
pytest.importorskip(
    "mkdocs", reason="mkdocs is a dev extra (make install): the site build is part of make test"
)
pytest.importorskip("mkdocstrings", reason="mkdocstrings is a dev extra (make install)")

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "docs")]  # md_docstrings, hooks

ROLE = re.compile(r"(?<![\w:]):(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):(?!\w)")
GRID_TABLE = re.compile(r"\+[-=]{3,}\+")
LITERAL_MARKER = re.compile(r"::\s*</p>")
CODE = re.compile(r"<(pre|code)\b[^>]*>.*?</\1>", re.S)
TAG = re.compile(r"<[^>]+>")


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def _prose(page: Path) -> str:
    """A page's text outside code blocks and code spans (whose content is shown as written)."""
    return CODE.sub(" ", page.read_text())


def _where(text: str, match: re.Match[str]) -> str:
    return " ".join(html.unescape(TAG.sub("", text[max(0, match.start() - 80) : match.end() + 80])).split())


def test_the_site_was_built_from_this_checkout(site):
    """The build's environment imports this checkout's package (mkdocstrings renders these docstrings, not an
    installed copy's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    where = subprocess.run(
        [sys.executable, "-c", "import st_cached_losses; print(st_cached_losses.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).resolve().is_relative_to(ROOT), where
    assert (site / "objects.inv").is_file()


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("reStructuredText role", ROLE),
        ("grid table", GRID_TABLE),
        ("literal-block marker ::", LITERAL_MARKER),
    ],
)
def test_no_restructuredtext_left(site, name, pattern):
    found = []
    for page in _pages(site):
        text = _prose(page)
        found += [f"{page.relative_to(site)}: ...{_where(text, m)}..." for m in pattern.finditer(text)]
    assert not found, f"{len(found)} {name}(s) rendered as text:\n" + "\n".join(found[:20])


def test_the_checks_can_fail():
    """The patterns find what the old docstrings rendered as (a role before its code, a grid table's
    border, a literal block's marker), and nothing in what they render as now."""
    old = "<p>as :class:<code>CachedMNRLoss</code>'s</p><p>+-----+--------+\n| Texts |</p><p>::</p>"
    assert ROLE.search(CODE.sub(" ", old)) and GRID_TABLE.search(old) and LITERAL_MARKER.search(old)
    new = '<p>as <a href="#x"><code>CachedMNRLoss</code></a>\'s</p><pre><code>:class:`x`</code></pre>'
    assert not ROLE.search(CODE.sub(" ", new))


def test_docstrings_need_no_conversion(site):
    """``tools/md_docstrings.py --check`` finds nothing to convert: after a merge that brings a role or a grid
    table back, run the script (see its docstring)."""
    import md_docstrings

    assert md_docstrings.main(["--check", "--inventory", str(site / "objects.inv")]) == 0


def test_settings_table_shows_help_texts_as_written(site):
    """The help of ``scale_learning_rate`` holds a regex: its ``*`` are shown, not read as emphasis, and its
    backslashes are kept (Markdown took ``\\.`` for an escaped dot)."""
    import dataclasses

    from st_cached_losses import CachedLossTrainingArguments

    field = next(
        f for f in dataclasses.fields(CachedLossTrainingArguments) if f.name == "scale_learning_rate"
    )
    help_text = " ".join(field.metadata["help"].split())
    assert "*" in help_text and "\\" in help_text  # what the check is about
    page = (site / "configuration" / "index.html").read_text()
    row = re.search(r"<tr>\s*<td><code>scale_learning_rate</code>.*?</tr>", page, re.S)
    assert row, "the settings table has no scale_learning_rate row"
    assert "<em>" not in row.group(0)
    assert help_text in " ".join(html.unescape(TAG.sub("", row.group(0))).split())


def test_repository_url_is_one_setting(site):
    """The repository's address is written once, in pyproject.toml's [project.urls]: the site's header links
    to it, and README's clone line names the same address."""
    import hooks  # docs/hooks.py

    url = hooks.repository_url()
    assert url.startswith("https://")
    assert f'href="{url}"' in (site / "index.html").read_text()
    readme = (ROOT / "README.md").read_text()
    clones = re.findall(r"git clone (\S+)", readme)
    assert clones and set(clones) == {url}, clones
    for page in _pages(site):
        assert "<!-- repository-url -->" not in page.read_text(), page
    # a placeholder address is said to be one (README and the site's home), and a real one is not
    placeholder = "/OWNER/" in url
    assert ("`OWNER` is a placeholder" in readme) == placeholder
    assert ("is a placeholder" in _text(site / "index.html")) == placeholder


def _builtin_docstrings() -> set[str]:
    """The opening (60 characters, whitespace collapsed) of the docstring of every built-in type and of a few
    standard-library types whose instances are module constants (what inspection showed under a constant)."""
    import builtins
    import collections
    import functools
    import inspect
    import types

    out = set()
    for obj in [*vars(builtins).values(), functools.partial, re.Pattern, types.MappingProxyType]:
        if inspect.isclass(obj) and isinstance(obj.__doc__, str):
            text = " ".join(obj.__doc__.split())[:60]
            if len(text) >= 15:
                out.add(text)
    out.add(" ".join(collections.OrderedDict.__doc__.split())[:60])
    return out


def _text(page: Path) -> str:
    return " ".join(html.unescape(TAG.sub(" ", page.read_text())).split())


def test_the_api_reference_shows_no_builtin_docstring(site):
    """Inspection gave a constant its value's type's docstring (157 of them: ``str``'s "Create a new string
    object from the given object..." under ``equivalent_st_loss``, ``dict``'s under ``TIE_TOLERANCE``)."""
    openings = _builtin_docstrings()
    assert " ".join(str.__doc__.split())[:60] in openings  # what the check is about
    found = [
        f"{page.relative_to(site)}: {text!r}"
        for page in sorted((site / "api").rglob("*.html"))
        for text in openings
        if text in _text(page)
    ]
    assert not found, "built-in docstrings in the API reference:\n" + "\n".join(found[:20])
    # and the attributes that had them have their own words (a #: comment, a dataclass field's help)
    functional = _text(site / "api" / "functional" / "index.html")
    assert "Guide similarities within this of a row's threshold count as equal to it" in functional


PARAMETERS = re.compile(r'doc-section-title">Parameters:.*?</table>', re.S)
PARAMETER_ROW = re.compile(r'<tr class="doc-section-item">\s*<td>\s*<code>(.*?)</code>', re.S)


def test_each_parameter_entry_documents_one_argument(site):
    """An entry that documents two arguments (``document_regularizer / query_regularizer: ...``) is no argument
    of the signature: rendered as one unknown, untyped, "required" argument where both are optional."""
    names = [
        (page.relative_to(site), html.unescape(TAG.sub("", name)).strip())
        for page in sorted((site / "api").rglob("*.html"))
        for table in PARAMETERS.findall(page.read_text())
        for name in PARAMETER_ROW.findall(table)
    ]
    assert len(names) > 150  # the patterns find the parameter tables
    shared = [f"{page}: {name}" for page, name in names if not re.fullmatch(r"\*{0,2}[A-Za-z_]\w*", name)]
    assert not shared, "parameter entries naming several arguments:\n" + "\n".join(shared)


TABLE = re.compile(r"<table>(.*?)</table>", re.S)
CELL = re.compile(r"<t([dh])\b[^>]*>(.*?)</t[dh]>", re.S)
#: the longest cell text (characters) a table of three or more columns may hold: at 1,400 px such a cell made
#: its row ~1,000 px tall and pushed the columns after it off the page (the settings table had the meaning
#: column cut); a two-column table gives its prose the width
WIDE_TABLE_CELL = 200


def _tables(text: str) -> list[tuple[int, list[str]]]:
    """(columns, cell texts) of each table of an HTML text."""
    out = []
    for table in TABLE.findall(text):
        cells = CELL.findall(table)
        columns = sum(1 for kind, _ in cells if kind == "h")
        out.append((columns, [" ".join(html.unescape(TAG.sub(" ", cell)).split()) for _, cell in cells]))
    return out


def test_wide_tables_fit_and_code_keeps_its_indentation(site):
    configuration = (site / "configuration" / "index.html").read_text()
    columns, cells = _tables(configuration[configuration.index('class="settings-table"') :])[0]
    assert columns == 2 and len(cells) > 80, (columns, len(cells))  # the field; its help and losses
    for page in ("configuration", "guides/choosing"):
        tables = _tables((site / page / "index.html").read_text())
        assert tables, page
        for columns, cells in tables:
            longest = max(cells, key=len)
            assert columns < 3 or len(longest) <= WIDE_TABLE_CELL, (
                f"{page}: {columns} columns, {longest[:80]!r}"
            )
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    assert re.search(r"pre > code \{[^}]*white-space: pre;", css)
    unstyled = [page for page in _pages(site) if "stylesheets/extra.css" not in page.read_text()]
    assert not unstyled, unstyled[:5]


def test_the_table_check_can_fail():
    wide = (
        "<table><tr><th>a</th><th>b</th><th>c</th></tr><tr><td>x</td><td>"
        + "y " * 150
        + "</td><td>z</td></tr></table>"
    )
    ((columns, cells),) = _tables(wide)
    assert columns == 3 and len(max(cells, key=len)) > WIDE_TABLE_CELL


def test_the_siglip_guide_shows_compact_tables_and_collapses_the_full_ones(site):
    """Rendered: outside the collapsed "All columns" blocks (``<details>``) the SigLIP guide's tables have
    at most ``MAX_COLUMNS`` columns (tests/docs/test_table_width.py checks the Markdown and says why)."""
    from tests.docs.test_table_width import MAX_COLUMNS

    page = (site / "guides" / "siglip" / "index.html").read_text()
    details = re.findall(r"<details\b.*?</details>", page, re.S)
    shown = _tables(re.sub(r"<details\b.*?</details>", " ", page, flags=re.S))
    assert [columns for columns, _ in shown] == [5, 6, 6, 6], [columns for columns, _ in shown]
    assert all(columns <= MAX_COLUMNS for columns, _ in shown)
    assert sum("start: scale / bias" in cells for _, cells in shown) == 3
    full = [columns for block in details if "All columns" in block for columns, _ in _tables(block)]
    assert full == [13, 13, 13], full


def _text(page: Path) -> str:
    return " ".join(html.unescape(TAG.sub(" ", page.read_text())).split())


def test_a_loss_page_has_one_settings_table_and_no_setting_boilerplate(site):
    """A loss's settings are one table at the end of its entry (every constructor argument but the model),
    not one "The setting x (see the loss's settings class)" entry per setting; SigLIP's page lists no setting
    its constructor refuses (``learnable_scale``, ``temperature``)."""
    import inspect

    from st_cached_losses.losses.registry import losses

    boilerplate = [
        str(page.relative_to(site))
        for page in _pages(site)
        if "(see the loss's settings class)" in _text(page)
    ]
    assert not boilerplate
    pages = {
        page.relative_to(site).parent.name: page.read_text() for page in (site / "api").rglob("index.html")
    }
    for cls in set(losses().values()):
        anchor = f'id="{cls.__module__}.{cls.__name__}"'
        page = next((text for text in pages.values() if anchor in text), None)
        assert page is not None, cls.__name__
        entry = page[page.index(anchor) :]
        assert "Settings.</strong> Each is also an attribute of the loss" in entry, cls.__name__
        table = entry[entry.index("Settings.</strong>") :]
        table = table[: table.index("</table>")]
        shown = re.findall(r"<tr>\s*<td><code>(\w+)</code></td>", table)
        params = [
            p.name
            for p in list(inspect.signature(cls).parameters.values())[1:]
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]
        assert shown == params, cls.__name__
    siglip = pages["siglip"]
    for refused in ("learnable_scale", "temperature"):
        assert f'id="st_cached_losses.losses.cached_siglip.CachedSigLIPLoss.{refused}"' not in siglip


def test_citations_are_not_shown_as_raw_strings(site):
    """A loss's ``citations`` (BibTeX entries) are not rendered as a Python string with its ``\\n``s."""
    raw = [
        str(page.relative_to(site))
        for page in (site / "api").rglob("*.html")
        if re.search(r"@(?:article|inproceedings|misc)\{[^<]*\\n", page.read_text())
    ]
    assert not raw


def test_each_object_is_documented_once(site):
    """A class or function is documented under the module that defines it only: a module that re-exports it
    (``functional.sigmoid.loss``'s ``SigmoidOptions``) does not show it a second time."""
    import importlib

    ids = set()
    for page in (site / "api").rglob("*.html"):
        ids.update(re.findall(r'id="(st_cached_losses[\w.]*)"', page.read_text()))
    homes: dict[int, list[str]] = {}
    for identifier in sorted(ids):
        try:
            importlib.import_module(identifier)
            continue  # a module (functional.sigmoid, beside its module sigmoid.loss)
        except (ImportError, ValueError):
            pass
        module_name, _, name = identifier.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except (ImportError, ValueError):
            continue  # a member of a class, not of a module (or the package itself)
        obj = getattr(module, name, None)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            homes.setdefault(id(obj), []).append(identifier)
    twice = [places for places in homes.values() if len(places) > 1]
    assert not twice, twice
