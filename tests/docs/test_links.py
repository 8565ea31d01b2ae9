"""Every guide can be found from every entry point a new user opens: README.md, the site's home
(docs/index.md), Getting started and Choosing a loss each link to every page of docs/guides/ (a new guide, say
a new loss's, fails here until those pages link to it). Links are read from the Markdown source, relative to
the page, as the site and GitHub resolve them. And every loss the package exports is named where a user picks
one: README's "Which loss" table, Choosing a loss, Switching, and the API reference's top-level and losses
tables (a new loss fails here until they name it)."""

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


#: the pages (and for README, the section) where a user picks a loss
LOSS_TABLES = {
    "README.md": "\n## Which loss\n",
    "docs/guides/choosing.md": None,
    "docs/guides/switching.md": None,
    "docs/api/index.md": None,
    "docs/api/losses.md": None,
}


def exported_losses() -> list[str]:
    import torch

    import st_cached_losses

    return [
        name
        for name in st_cached_losses.__all__
        if isinstance(obj := getattr(st_cached_losses, name), type) and issubclass(obj, torch.nn.Module)
    ]


def section(text: str, heading: str | None) -> str:
    """``text`` from ``heading`` to the next heading of its level (all of it for None)."""
    if heading is None:
        return text
    start = text.index(heading) + 1
    level = heading.strip().split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end >= 0 else None]


def test_the_losses_are_found():
    assert {"CachedMNRLoss", "CachedDistillKLDivLoss", "CachedCrossEncoderLoss"} <= set(exported_losses())


@pytest.mark.parametrize(("page", "heading"), LOSS_TABLES.items())
def test_every_loss_is_named_where_a_user_picks_one(page, heading):
    text = section((ROOT / page).read_text(), heading)
    missing = [name for name in exported_losses() if not re.search(rf"\b{name}\b", text)]
    assert not missing, f"{page} names no {missing}"


def test_a_section_ends_at_the_next_heading():
    text = "# T\n## Which loss\nCachedMNRLoss\n### sub\nx\n## Next\nCachedTiledLoss\n"
    assert section(text, "\n## Which loss\n") == "## Which loss\nCachedMNRLoss\n### sub\nx"
