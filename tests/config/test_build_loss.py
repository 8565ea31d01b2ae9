"""build_loss: each loss built from the arguments with its settings; the dataset's columns checked before
training."""

from __future__ import annotations

import warnings

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


def _share_meeting_their_copy(rows: int, batch: int, span: int, trials: int = 200) -> float:
    """Simulated: the share of a second epoch's rows (reshuffled) whose first-epoch visit is at most ``span``
    steps earlier, i.e. whose positive a bank of ``span`` steps still holds."""
    import random

    steps, hits = rows // batch, 0
    for trial in range(trials):
        rng = random.Random(trial)
        first, second = list(range(rows)), list(range(rows))
        rng.shuffle(first), rng.shuffle(second)
        seen = {r: i // batch for i, r in enumerate(first)}
        hits += sum(steps + i // batch - seen[r] <= span for i, r in enumerate(second))
    return hits / (trials * rows)


def test_a_bank_holding_much_of_an_epoch_warns_in_a_run_of_several_epochs():
    """Issue 50's review: from the second epoch on, a row whose earlier visit the bank still holds meets its own
    positive among the negatives. 100 pairs, batch 4 (25 steps), a bank of 40 entries (10 steps): about 9%
    of the rows (the warning's estimate, checked by simulation)."""
    from datasets import Dataset

    pairs = Dataset.from_dict(
        {"anchor": [f"a{i}" for i in range(100)], "positive": [f"p{i}" for i in range(100)]}
    )

    def args(**kw):
        return CachedLossTrainingArguments(**BASE, per_device_train_batch_size=4, mini_batch_size=2, **kw)

    with pytest.warns(
        UserWarning,
        match=r"last 10 steps of an epoch of 25 per process, so from the second epoch on about 9%",
    ):
        check_dataset_columns(pairs, args(negative_bank_size=40, num_train_epochs=2))
    assert _share_meeting_their_copy(100, 4, 10) == pytest.approx(10 * 11 / (2 * 25 * 25), abs=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_dataset_columns(pairs, args(negative_bank_size=40, num_train_epochs=1))  # one epoch
        check_dataset_columns(pairs, args(negative_bank_size=40, num_train_epochs=2, negative_bank_max_age=2))
        check_dataset_columns(pairs, args(negative_bank_size=8, num_train_epochs=3))  # 2 steps: 0.5%
    with pytest.warns(UserWarning, match="about 100%"):  # a bank of two epochs: every row, every epoch
        check_dataset_columns(pairs, args(negative_bank_size=200, max_steps=60))


def test_a_run_that_max_steps_ends_within_its_first_epoch_does_not_warn():
    """Issue 58: ``max_steps`` overrides ``num_train_epochs`` (as in the trainer): 500 pairs at batch 4 are an
    epoch of 125 steps, and ``num_train_epochs=3, max_steps=10`` stops at step 10, never reaching a second
    epoch (the warning said it would). Past the epoch (``max_steps=130``, or 40 steps of 4 accumulated
    micro-batches: 160 loss calls) it warns."""
    from datasets import Dataset

    pairs = Dataset.from_dict(
        {"anchor": [f"a{i}" for i in range(500)], "positive": [f"p{i}" for i in range(500)]}
    )

    def args(**kw):
        return CachedLossTrainingArguments(
            **BASE, per_device_train_batch_size=4, mini_batch_size=2, negative_bank_size=400, **kw
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_dataset_columns(pairs, args(num_train_epochs=3, max_steps=10))
        check_dataset_columns(pairs, args(num_train_epochs=3, max_steps=125))  # exactly one epoch
        check_dataset_columns(pairs, args(num_train_epochs=1, max_steps=30, gradient_accumulation_steps=4))
    for kw in (
        {"num_train_epochs": 1, "max_steps": 130},
        {"max_steps": 40, "gradient_accumulation_steps": 4},
    ):
        with pytest.warns(UserWarning, match="from the second epoch on"):
            check_dataset_columns(pairs, args(**kw))
    with pytest.warns(UserWarning, match="from the second epoch on"):
        check_dataset_columns(pairs, args(num_train_epochs=2))
