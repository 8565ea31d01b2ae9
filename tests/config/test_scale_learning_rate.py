"""The learnable scale's own learning rate: scale_learning_rate, its parameter group and learning_rate_mapping."""

from __future__ import annotations

import json

import pytest

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.registry import DEFAULT_SCALE_LEARNING_RATE
from st_cached_losses.config.training_args import (
    SCALE_PARAMETER_PATTERN,
    CachedLossTrainingArguments,
)
from tests.config.helpers import ARGS, BASE, parse_cli
from tests.support.tiny_model import make_tiny_model, random_texts


def _optimizer_groups(tmp_path, args, wrap=None):
    """The param groups of the optimizer the stock trainer builds for ``build_loss(model, args)``, as
    (learning rate, holds the loss's logit_scale, number of parameters); and the loss."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    model = make_tiny_model(tmp_path / "m")
    loss = build_loss(model, args)
    data = Dataset.from_dict({"anchor": random_texts(16, seed=0), "positive": random_texts(16, seed=1)})
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data, loss=wrap(model, loss) if wrap else loss
    )
    optimizer = trainer.create_optimizer()
    scale = getattr(loss, "logit_scale", None)
    groups = [
        (g["lr"], any(p is scale for p in g["params"]), len(g["params"]))
        for g in optimizer.param_groups
        if g["params"]
    ]
    return groups, loss


@pytest.mark.parametrize("loss_name", ["clip", "tiled"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_learnable_scale_gets_its_own_param_group_at_scale_learning_rate(tmp_path, loss_name, wrapped):
    """The trainer names the scale ``logit_scale`` (``loss.logit_scale`` inside MatryoshkaLoss): it is
    alone in a group at scale_learning_rate, every model parameter stays at learning_rate."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    args = CachedLossTrainingArguments(**ARGS, loss=loss_name, learnable_scale=True)
    assert args.scale_learning_rate == DEFAULT_SCALE_LEARNING_RATE == 1e-2
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 1e-2}
    wrap = (lambda model, loss: MatryoshkaLoss(model, loss, [32, 16])) if wrapped else None
    groups, _ = _optimizer_groups(tmp_path, args, wrap)
    assert [g for g in groups if g[1]] == [(1e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {1e-4}


def test_scale_pattern_matches_the_losses_scale_never_the_models():
    import re

    names = {
        "logit_scale": True,  # one loss
        "retrieval.logit_scale": True,  # a dict of losses
        "loss.logit_scale": True,  # MatryoshkaLoss(CachedCLIPLoss)
        "retrieval.loss.logit_scale": True,
        "model.0.model.logit_scale": False,  # a CLIP encoder's own scale
        "retrieval.model.0.model.logit_scale": False,
        "logit_scale_bias": False,
    }
    assert {name: bool(re.search(SCALE_PARAMETER_PATTERN, name)) for name in names} == names


def test_a_users_learning_rate_mapping_is_kept(tmp_path):
    user = {r"^model\.0\.": 2e-4}
    args = CachedLossTrainingArguments(**ARGS, loss="clip", learnable_scale=True, learning_rate_mapping=user)
    assert user == {r"^model\.0\.": 2e-4}  # the user's dict is not changed
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 1e-2, r"^model\.0\.": 2e-4}
    groups, _ = _optimizer_groups(tmp_path, args)
    assert [g for g in groups if g[1]] == [(1e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {2e-4}

    # a user's entry for the scale wins over scale_learning_rate, also given as a JSON string (the CLI)
    for mapping in ({"logit_scale": 5e-2}, json.dumps({"logit_scale": 5e-2})):
        args = CachedLossTrainingArguments(
            **ARGS, loss="clip", learnable_scale=True, learning_rate_mapping=mapping
        )
        assert args.learning_rate_mapping == {"logit_scale": 5e-2}
    groups, _ = _optimizer_groups(tmp_path, args)
    assert [g for g in groups if g[1]] == [(5e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {1e-4}


def test_saved_arguments_parsed_again_follow_their_scale_learning_rate(tmp_path):
    args = CachedLossTrainingArguments(**ARGS, loss="clip", learnable_scale=True)
    saved = {k: v for k, v in json.loads(args.to_json_string()).items() if k in {"learning_rate_mapping"}}
    (again,) = CachedLossArgumentParser().parse_dict(
        {**ARGS, "loss": "clip", "learnable_scale": True, "scale_learning_rate": 3e-2, **saved}
    )
    assert again.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 3e-2}
    (off,) = CachedLossArgumentParser().parse_dict(
        {**ARGS, "loss": "clip", "learnable_scale": False, **saved}
    )
    assert off.learning_rate_mapping == {}  # the trainer rejects a pattern matching no parameter


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": "clip", "learnable_scale": True, "scale_learning_rate": None},
        {"loss": "clip", "learnable_scale": True, "scale_learning_rate": 0.0},
        {"loss": "clip", "learnable_scale": False},
        {"loss": "mnr"},
    ],
)
def test_scale_learning_rate_disabled_or_no_learnable_scale(tmp_path, kwargs):
    args = CachedLossTrainingArguments(**ARGS, **kwargs)
    assert args.learning_rate_mapping == {}
    groups, loss = _optimizer_groups(tmp_path, args)  # builds: no pattern without a parameter to match
    assert {lr for lr, _, _ in groups} == {1e-4}
    assert any(has_scale for _, has_scale, _ in groups) == loss.learnable_scale


def test_scale_learning_rate_from_the_command_line():
    args = parse_cli(
        [
            "--loss",
            "clip",
            "--learnable_scale",
            "true",
            "--scale_learning_rate",
            "0.05",
            "--mini_batch_size",
            "4",
        ]
    )
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 0.05}
    args = parse_cli(
        [
            "--loss",
            "clip",
            "--learnable_scale",
            "true",
            "--scale_learning_rate",
            "0",
            "--mini_batch_size",
            "4",
        ]
    )
    assert args.learning_rate_mapping == {}


@pytest.mark.slow
def test_the_scale_moves_more_at_scale_learning_rate_than_at_learning_rate(tmp_path):
    """A few steps at a fine-tuning learning rate: the scale barely moves at learning_rate (20.00 ->
    20.03 in a reported run), and moves by about steps x scale_learning_rate in log space with its own rate."""
    import math

    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    data = Dataset.from_dict({"anchor": random_texts(64, seed=0), "positive": random_texts(64, seed=1)})
    moved = {}
    for rate in (None, DEFAULT_SCALE_LEARNING_RATE):
        model = make_tiny_model(tmp_path / "m")
        args = CachedLossTrainingArguments(
            **{**BASE, "output_dir": str(tmp_path / "out")},
            loss="clip",
            learnable_scale=True,
            scale_learning_rate=rate,
            per_device_train_batch_size=16,
            mini_batch_size=8,
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            max_steps=4,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        loss = build_loss(model, args)
        SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
        moved[rate] = abs(math.log(loss.scale / 20.0))
    assert moved[None] < 4 * 1e-4 * 1.5  # Adam: about the learning rate per step, at most
    assert moved[DEFAULT_SCALE_LEARNING_RATE] > 10 * moved[None]
    assert moved[DEFAULT_SCALE_LEARNING_RATE] > 4 * DEFAULT_SCALE_LEARNING_RATE * 0.5
