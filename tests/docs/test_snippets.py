"""The Python snippets of README.md and the documentation pages run.

Each ```python block of README.md and docs/**/*.md is one test, run as written in a fresh namespace and a
temporary working directory, with three substitutions: the model names the snippets load (all-MiniLM-L6-v2, a
SPLADE checkpoint, ModernBERT, a decoder, a reranker) become tiny random models written offline
(``tests/support/tiny_model.py``), so nothing is downloaded and each snippet takes seconds. A page's YAML
blocks whose first line is ``# <name>.yaml`` are written to that file first (the configuration page's
``run.yaml``). A block preceded by ``<!-- snippet: skip (reason) -->`` is not run: the marker says why
(multi-process runs and Hub pushes, tested elsewhere). The API reference's examples are not collected:
they are the docstrings' own.

The Quickstart (README's, which getting-started repeats word for word) is the exception: a new user runs it
first, offline, as written, so it runs here on the real packaged all-MiniLM-L6-v2 with one change,
``num_train_epochs=1`` -> ``max_steps=1`` (``test_the_quickstart_runs_as_written``). So is the SigLIP
guide's first snippet, a fine-tuning start whose point is that it improves the packaged model: it runs as
written, whole, on the packaged model (``test_the_siglip_guide_start_improves_the_packaged_model``).

Run alone: ``python -m pytest tests/docs -q``.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- snippet: skip \((.+?)\) -->\s*$")


def _blocks(page: Path, language: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason) of every ``language`` block of ``page``."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        if match.group(1) != language:
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        out.append((text.count("\n", 0, match.start()) + 1, match.group(2), skip.group(1) if skip else None))
    return out


SNIPPETS = [
    pytest.param(page, code, skip, id=f"{page.relative_to(ROOT)}:{line}")
    for page in PAGES
    for line, code, skip in _blocks(page, "python")
]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Model name in the docs -> the folder of a tiny random model of the same kind."""
    from tests.support.tiny_model import (
        make_tiny_cross_encoder,
        make_tiny_decoder,
        make_tiny_model,
        make_tiny_multi_vector,
        make_tiny_splade,
    )

    root = tmp_path_factory.mktemp("docs_models")
    dense = make_tiny_model(root / "bert")
    dense.save_pretrained(str(root / "dense"))
    make_tiny_splade(root / "mlm").save_pretrained(str(root / "splade"))
    make_tiny_multi_vector(root / "mv_bert").save_pretrained(str(root / "multi_vector"))
    make_tiny_decoder(root / "decoder_raw").save_pretrained(str(root / "decoder"))
    make_tiny_cross_encoder(root / "reranker_raw").save_pretrained(str(root / "reranker"))
    return {
        "all-MiniLM-L6-v2": str(root / "dense"),
        "naver/splade-cocondenser-ensembledistil": str(root / "splade"),
        "answerdotai/ModernBERT-base": str(root / "multi_vector"),
        "path/to/decoder-embedding-model": str(root / "decoder"),
        "microsoft/MiniLM-L12-H384-uncased": str(root / "reranker"),
    }


def test_every_page_has_snippets_collected():
    """A fence this file's pattern misses (a changed info string) would silently drop a page's snippets."""
    pages = {page.relative_to(ROOT).as_posix() for page, *_ in (p.values for p in SNIPPETS)}
    for expected in (
        "README.md",
        "docs/getting-started.md",
        "docs/guides/dense.md",
        "docs/guides/gist.md",
        "docs/guides/siglip.md",
        "docs/guides/sparse.md",
        "docs/guides/multi-vector.md",
        "docs/guides/cross-encoder.md",
        "docs/configuration.md",
        "docs/functional.md",
    ):
        assert expected in pages, expected


def quickstart(page: Path) -> str:
    """The first Python block under a page's ``## Quickstart`` heading."""
    text = page.read_text()
    section = text[text.index("\n## Quickstart\n") :]
    match = FENCE.search(section)
    assert match is not None and match.group(1) == "python", page
    return match.group(2)


GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def test_readme_and_getting_started_share_one_quickstart():
    assert quickstart(ROOT / "README.md") == quickstart(GETTING_STARTED)


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path, monkeypatch):
    """README's Quickstart on the real packaged model (no model name swapped), offline, one step instead of the
    epoch: it trains without a "caching is off" warning and saves the model with a card naming the loss."""
    code = quickstart(ROOT / "README.md")
    assert code.count("num_train_epochs=1") == 1
    code = code.replace("num_train_epochs=1", "max_steps=1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace: dict = {"__name__": "__snippet__"}
        exec(compile(code, "README.md:quickstart", "exec"), namespace)
    caching_off = [
        str(w.message) for w in caught if re.search(r"caching (saves no memory|is off)", str(w.message))
    ]
    assert not caching_off, caching_off
    assert namespace["model"].get_embedding_dimension() == 384  # all-MiniLM-L6-v2, not a tiny model
    final = tmp_path / "output" / "quickstart" / "final"
    assert (final / "model.safetensors").is_file()
    assert "CachedMNRLoss" in (final / "README.md").read_text()


SIGLIP_GUIDE = ROOT / "docs" / "guides" / "siglip.md"


def first_snippet(page: Path) -> str:
    """The first Python block of a page."""
    return _blocks(page, "python")[0][1]


@pytest.mark.slow
def test_the_siglip_guide_start_improves_the_packaged_model(tmp_path, monkeypatch):
    """The SigLIP guide's first snippet (scale 20, bias -10: its start for fine-tuning a pretrained model),
    run as written, offline, on the packaged all-MiniLM-L6-v2 and the benchmark's standard-library pairs:
    retrieval on the held-out pairs improves (SigLIP's own start, 10 / -10, lowered it; issue 62)."""
    code = first_snippet(SIGLIP_GUIDE)
    assert "scale=20.0, bias=-10.0" in code and "get_model_path()" in code
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    namespace: dict = {"__name__": "__snippet__"}
    exec(compile(code, "siglip.md:first snippet", "exec"), namespace)
    assert namespace["model"].get_embedding_dimension() == 384  # all-MiniLM-L6-v2, not a tiny model
    assert namespace["after"] > namespace["before"] + 0.02, (namespace["before"], namespace["after"])


@pytest.mark.parametrize(("page", "code", "skip"), SNIPPETS)
def test_snippet_runs(page: Path, code: str, skip: str | None, tiny_models, tmp_path, monkeypatch):
    if skip is not None:
        pytest.skip(skip)
    if page.name in QUICKSTART_PAGES and code == quickstart(page):
        pytest.skip("test_the_quickstart_runs_as_written runs it, on the packaged model")
    if page == SIGLIP_GUIDE and code == first_snippet(page):
        pytest.skip("test_the_siglip_guide_start_improves_the_packaged_model runs it, on the packaged model")
    for name, path in tiny_models.items():
        code = code.replace(f'"{name}"', repr(path))
    for _, yaml_code, _ in _blocks(page, "yaml"):
        first = yaml_code.split("\n", 1)[0]
        target = re.fullmatch(r"# (\S+\.ya?ml)(?::.*)?", first)
        if target:
            (tmp_path / target.group(1).rstrip(":")).write_text(yaml_code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    if page.name not in QUICKSTART_PAGES:
        exec(compile(code, f"{page.name}:snippet", "exec"), {"__name__": "__snippet__"})
    else:  # a first run shows caching at work: no "caching saves no memory" / "caching is off" warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(code, f"{page.name}:snippet", "exec"), {"__name__": "__snippet__"})
        caching_off = [
            str(w.message) for w in caught if re.search(r"caching (saves no memory|is off)", str(w.message))
        ]
        assert not caching_off, caching_off
    assert os.getcwd() == str(tmp_path)


#: the pages whose snippets a new user runs first
QUICKSTART_PAGES = ("README.md", "getting-started.md")
