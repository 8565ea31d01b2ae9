"""A checkpoint written by the current release still loads: ``training_args.bin`` (the arguments pickled under
``st_cached_losses.training_args``) of three arguments classes, and ``LossStateCallback``'s negative-bank
file. The files in ``tests/fixtures/release_checkpoint/`` were written by the release's code
(``make_fixture.py`` there, run from a checkout of it); ``expected.json`` holds what it read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from st_cached_losses import (
    CachedLossTrainingArguments,
    CachedMNRLoss,
    CachedSparseEncoderTrainingArguments,
    LossStateCallback,
    build_loss,
)
from st_cached_losses.losses.callbacks import BANK_FILE
from tests.support.tiny_model import make_tiny_model, make_tiny_splade

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release_checkpoint"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    return {"dense": make_tiny_model(root / "dense"), "sparse": make_tiny_splade(root / "sparse")}


def _load(name: str):
    return torch.load(FIXTURE / f"training_args_{name}.bin", weights_only=False)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("clip", CachedLossTrainingArguments),
        ("distill", CachedLossTrainingArguments),
        ("sparse", CachedSparseEncoderTrainingArguments),
    ],
)
def test_the_release_s_training_args_load_and_build_their_loss(models, name, cls):
    args = _load(name)
    assert type(args) is cls
    assert args.loss == EXPECTED[name]["loss_settings"]["loss"]
    loss = build_loss(models["sparse" if name == "sparse" else "dense"], args)
    if name == "clip":
        assert type(loss).__name__ == "CachedCLIPLoss"
        assert loss.scale == pytest.approx(20.0) and loss.learnable_scale
        assert (loss.negative_bank_size, loss.negative_bank_max_age, loss.mini_batch_size) == (16, 3, 4)
    elif name == "distill":
        assert type(loss).__name__ == "CachedDistillKLDivLoss"
        assert (loss.temperature, loss.infonce_weight, loss.infonce_scale) == (0.5, 0.1, 20.0)
    else:
        assert type(loss).__name__ == "CachedSparseLoss"
        assert (loss.document_regularizer_weight, loss.query_regularizer_weight) == (3e-5, 5e-5)


def test_the_release_s_bank_file_restores_the_bank(tmp_path):
    model = make_tiny_model(tmp_path / "bert", hidden=8)
    loss = CachedMNRLoss(model, mini_batch_size=2, negative_bank_size=6)
    assert (FIXTURE / BANK_FILE.format(0)).is_file()
    LossStateCallback(loss).load_bank_state_dict(torch.load(FIXTURE / BANK_FILE.format(0), weights_only=True))
    assert loss.negative_bank.stats() == EXPECTED["bank"]["stats"]
    assert loss.negative_bank.step == EXPECTED["bank"]["step"]
    view = loss.negative_bank.view(torch.zeros(1, 8), with_anchors=False)
    torch.testing.assert_close(view.candidates, torch.tensor(EXPECTED["bank"]["rows"]))
