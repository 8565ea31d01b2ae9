"""Every guide can be found from every entry point a new user opens: README.md, the site's home
(docs/index.md), Getting started and Choosing a loss each link to every page of docs/guides/ (a new guide, say
a new loss's, fails here until those pages link to it). Links are read from the Markdown source, relative to
the page, as the site and GitHub resolve them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
ENTRY_POINTS = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    ROOT / "docs" / "getting-started.md",
    ROOT / "docs" / "guides" / "choosing.md",
]
#: a Markdown link's target: [text](target) or [text](target#anchor)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def linked_pages(page: Path) -> set[Path]:
    return {
        (page.parent / target).resolve() for target in LINK.findall(page.read_text()) if "://" not in target
    }


def test_the_guides_are_found():
    assert len(GUIDES) >= 10 and ROOT / "docs" / "guides" / "pylate.md" in GUIDES


@pytest.mark.parametrize("page", ENTRY_POINTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_an_entry_point_links_to_every_guide(page):
    linked = linked_pages(page)
    missing = [guide.name for guide in GUIDES if guide != page and guide.resolve() not in linked]
    assert not missing, f"{page.relative_to(ROOT)} links to no {missing}"


def test_the_check_can_fail(tmp_path):
    (tmp_path / "guides").mkdir()
    page = tmp_path / "index.md"
    page.write_text("[dense](guides/dense.md#x), [web](https://example.com/guides/gist.md)")
    assert linked_pages(page) == {(tmp_path / "guides" / "dense.md").resolve()}
