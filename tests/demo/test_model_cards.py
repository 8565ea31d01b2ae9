"""The committed model cards (``model_cards/``, written by ``make model-cards``) say what the current code
writes, checked in seconds without training: the parts of a card that follow from a script's configuration
alone are rebuilt from its defaults (the command line ``make model-cards`` gives it) and compared with the
committed card. They are: the loss's class and its ``get_config_dict()`` as sentence-transformers prints them
("Loss: ... with these parameters", the loss built by ``build_loss`` on a tiny model of the same kind), the
loss's citation, and the "Loss settings" block of our "Cached loss training" section. A change of the losses'
configuration, of the arguments or of a script's defaults without ``make model-cards`` fails here; the
trained parts (metrics, times, widget examples) are not compared."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from st_cached_losses import (
    CachedCrossEncoderTrainingArguments,
    CachedLossTrainingArguments,
    CachedMultiVectorEncoderTrainingArguments,
    CachedSparseEncoderTrainingArguments,
    build_loss,
)
from st_cached_losses.config.cli import CachedLossArgumentParser
from st_cached_losses.config.model_card import loss_settings_block

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE_ARGS = ["--disable_tqdm", "true"]
#: card -> (the script that writes it, its arguments class, the tiny model kind to build the loss on, the
#: command line ``make model-cards`` gives the script beyond MAKEFILE_ARGS)
CARDS: dict[str, tuple[str, type, str, list[str]]] = {
    "demo.md": ("st_cached_losses/demo/app.py", CachedLossTrainingArguments, "dense", ["--loss_show_progress_bar", "false"]),
    "cached_mnr.md": ("examples/train_cached_mnr.py", CachedLossTrainingArguments, "dense", []),
    "cached_clip.md": ("examples/train_cached_clip.py", CachedLossTrainingArguments, "dense", []),
    "cached_tiled.md": ("examples/train_cached_tiled.py", CachedLossTrainingArguments, "dense", []),
    "cached_gist.md": ("examples/train_cached_gist.py", CachedLossTrainingArguments, "dense", []),
    "cached_siglip.md": ("examples/train_cached_siglip.py", CachedLossTrainingArguments, "dense", []),
    "cached_sparse.md": ("examples/train_cached_sparse.py", CachedSparseEncoderTrainingArguments, "sparse", []),
    "cached_multi_vector.md": (
        "examples/train_cached_multi_vector.py", CachedMultiVectorEncoderTrainingArguments, "multi_vector", []
    ),
    "cached_cross_encoder.md": (
        "examples/train_cached_cross_encoder.py", CachedCrossEncoderTrainingArguments, "cross_encoder", []
    ),
    "accelerate.md": ("examples/train_accelerate.py", CachedLossTrainingArguments, "dense", []),
    "negative_bank.md": ("examples/train_negative_bank.py", CachedLossTrainingArguments, "dense", []),
    "real_data.md": ("examples/train_real_data.py", CachedLossTrainingArguments, "dense", []),
    "cached_distill.md": (
        "examples/train_cached_distill.py", CachedLossTrainingArguments, "dense", ["--train_pairs", "64", "--eval_pairs", "128"]
    ),
}  # fmt: skip


def test_every_committed_card_is_checked():
    assert sorted(p.name for p in (ROOT / "model_cards").glob("*.md") if p.name != "README.md") == sorted(
        CARDS
    )


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Any]:
    from tests.support.tiny_model import (
        make_tiny_cross_encoder,
        make_tiny_model,
        make_tiny_multi_vector,
        make_tiny_splade,
    )

    root = tmp_path_factory.mktemp("card_models")
    dense = make_tiny_model(root / "dense")
    dense.save_pretrained(str(root / "dense_saved"))
    return {
        "dense": dense,
        "dense_path": str(root / "dense_saved"),
        "sparse": make_tiny_splade(root / "sparse"),
        "multi_vector": make_tiny_multi_vector(root / "mv"),
        "cross_encoder": make_tiny_cross_encoder(root / "ce"),
    }


def _script_arguments(script: str, cls: type, extra: list[str]) -> Any:
    """The arguments ``script`` trains with under ``make model-cards``: its defaults, then the Makefile's flags."""
    if script.startswith("st_cached_losses/"):
        from st_cached_losses.demo import app

        dataclasses, defaults = (app.DemoArguments, cls), app.DEMO_DEFAULTS
    else:
        spec = importlib.util.spec_from_file_location(f"card_example_{Path(script).stem}", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        dataclasses, defaults = (module.ExampleArguments, cls), module.DEFAULTS
    return CachedLossArgumentParser(dataclasses).parse_command_line(
        [*MAKEFILE_ARGS, *extra], defaults=defaults
    )[-1]


def _st_loss_parameters(loss: nn.Module) -> str:
    """The loss's config as sentence-transformers' model card prints it (``base/model_card.py``): a module
    value as its class name with its base model and its own config, then JSON with an indent of 4."""

    def value(v: Any) -> Any:
        if not isinstance(v, nn.Module):
            return v
        parts = [repr(v.model_card_data.base_model)] if hasattr(v, "model_card_data") else []
        if hasattr(v, "get_config_dict"):
            parts += [f"{k}={val!r}" for k, val in v.get_config_dict().items()]
        return f"{type(v).__name__}({', '.join(parts)})" if parts else type(v).__name__

    config = {k: value(v) for k, v in loss.get_config_dict().items()}
    text = json.dumps(config, indent=4)
    return "\n".join("  " + line for line in f"```json\n{text}\n```".splitlines())


@pytest.mark.parametrize("card", sorted(CARDS))
def test_the_committed_card_matches_what_the_code_writes(card, tiny_models):
    script, cls, kind, extra = CARDS[card]
    text = (ROOT / "model_cards" / card).read_text()
    fix = f"model_cards/{card} is stale: regenerate it with `make model-cards` (or the script's line there)"
    args = _script_arguments(script, cls, extra)

    # our section's loss settings (the guide's local path differs between machines)
    block = loss_settings_block(args)
    if args.guide_model is not None:
        block = block.replace(json.dumps(args.guide_model), '"<guide>"')
        text_block = text.replace(json.dumps(json.loads(_guide_in(text))), '"<guide>"')
    else:
        text_block = text
    assert block in text_block, f"{fix}: its 'Loss settings' differ from\n{block}"

    # the loss class and its config as sentence-transformers prints them, and its citation
    if args.guide_model is not None:
        args.guide_model = tiny_models["dense_path"]
    loss = build_loss(tiny_models[kind], args)
    cls_path = f"{type(loss).__module__}.{type(loss).__name__}"
    parameters = _st_loss_parameters(loss)
    expected = f"* Loss: <code>{cls_path}</code> with these parameters:\n{parameters}"
    assert expected in text, f"{fix}: expected\n{expected}"
    assert loss.citation.strip() in text, f"{fix}: its citation of {type(loss).__name__} differs"
    # a Hub visitor finds the project: the "Trained by" line links the repository (pyproject's address)
    assert f"[st_cached_losses]({_repository()})" in text, (
        f"{fix}: its 'Trained by' line does not link the repository"
    )


def _repository() -> str:
    """``Repository`` under ``[project.urls]`` in pyproject.toml, as the site reads it (docs/hooks.py)."""
    section = re.search(
        r"^\[project\.urls\]\n(.*?)(?=^\[)", (ROOT / "pyproject.toml").read_text(), re.M | re.S
    )
    assert section, "pyproject.toml has no [project.urls]"
    found = re.search(r'^Repository\s*=\s*"([^"]+)"', section.group(1), re.M)
    assert found, "pyproject.toml's [project.urls] has no Repository"
    return found.group(1)


def test_the_cards_read_the_repository_from_the_package_metadata():
    """The installed package's metadata carries pyproject's address (reinstall after changing it: make install)."""
    from st_cached_losses.config.model_card import project_url

    assert project_url() == _repository()


def _guide_in(text: str) -> str:
    """The JSON string of the guide_model setting in a card's Loss settings."""
    line = next(line for line in text.splitlines() if line.strip().startswith('"guide_model":'))
    return line.split(":", 1)[1].strip().rstrip(",")
