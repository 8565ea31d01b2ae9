"""build_loss: each loss built from the arguments with its settings; the dataset's columns checked before
training."""

from __future__ import annotations

import pytest

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE
from tests.support.tiny_model import make_tiny_model


@pytest.mark.parametrize(
    ("kwargs", "cls", "checks"),
    [
        ({"loss": "mnr", "scale": 30.0}, CachedMNRLoss, {"scale": 30.0, "symmetric": False}),
        (
            {"loss": "CachedCLIPLoss", "learnable_scale": True, "max_scale": 50.0},
            CachedCLIPLoss,
            {"learnable_scale": True, "max_scale": 50.0},
        ),
        (
            {"loss": "tiled", "symmetric": True, "tile_size": 64, "similarity": "dot"},
            CachedTiledLoss,
            {"symmetric": True, "tile_size": 64, "similarity": "dot"},
        ),
    ],
)
def test_build_loss(tmp_path, kwargs, cls, checks):
    model = make_tiny_model(tmp_path / "m")
    args = CachedLossTrainingArguments(**BASE, mini_batch_size=4, mask_duplicates=True, **kwargs)
    loss = build_loss(model, args)
    assert type(loss) is cls and loss.mini_batch_size == 4 and loss.mask_duplicates
    for name, value in checks.items():
        assert getattr(loss, name) == value


def test_dataset_with_too_few_columns_is_rejected_before_training():
    from datasets import Dataset

    args = CachedLossTrainingArguments(**BASE, loss="clip", per_device_train_batch_size=4, mini_batch_size=2)
    pairs = Dataset.from_dict({"anchor": ["a", "b"], "positive": ["c", "d"]})
    with pytest.warns(UserWarning, match="fewer than one global batch"):
        check_dataset_columns(pairs, args)
    one_text = Dataset.from_dict({"anchor": ["a", "b"], "label": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"CachedCLIPLoss.*1 text column.*at least two"):
        check_dataset_columns(one_text, args)
    with pytest.raises(ValueError, match=r"train_dataset\['b'\]"):
        check_dataset_columns({"a": pairs, "b": one_text}, args)


def test_build_loss_checks_the_dataset_it_is_given(tmp_path):
    from datasets import Dataset

    model = make_tiny_model(tmp_path / "m")
    args = CachedLossTrainingArguments(**BASE, loss="mnr", per_device_train_batch_size=2, mini_batch_size=1)
    one_text = Dataset.from_dict({"anchor": ["a", "b"], "score": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"CachedMNRLoss.*\['anchor'\].*at least two"):
        build_loss(model, args, train_dataset=one_text)
    triplets = Dataset.from_dict({"anchor": ["a", "b"], "positive": ["c", "d"], "negative": ["e", "f"]})
    assert isinstance(build_loss(model, args, train_dataset=triplets), CachedMNRLoss)
