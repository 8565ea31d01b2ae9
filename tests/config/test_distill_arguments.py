"""The arguments for the distillation losses: names (ours, aliases, sentence-transformers' class names), fields
from the command line into the loss, the temperature fields, refusals (a distillation field for another loss,
a dataset without negatives or teacher scores)."""

from __future__ import annotations

import pytest
from datasets import Dataset
from sentence_transformers.multi_vector_encoder.scoring import xtr_kd_scores, xtr_scores_pairwise
from sentence_transformers.util import pairwise_cos_sim

from st_cached_losses import CachedDistillKLDivLoss, CachedMarginMSELoss, CachedMultiVectorDistillKLDivLoss
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
    CachedMultiVectorEncoderTrainingArguments,
)
from tests.config.helpers import BASE, parse_cli
from tests.support.tiny_model import make_tiny_model, make_tiny_multi_vector


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("distill_args") / "bert")


def test_kl_loss_from_the_command_line(model):
    args = parse_cli(
        [
            "--loss", "distill_kl", "--similarity", "cosine", "--temperature", "2.0",
            "--teacher_temperature", "4.0", "--infonce_weight", "0.1", "--infonce_scale", "50",
            "--mini_batch_size", "4", "--gather_across_devices",
        ]
    )  # fmt: skip
    loss = build_loss(model, args)
    assert isinstance(loss, CachedDistillKLDivLoss)
    assert loss.similarity_fct is pairwise_cos_sim
    assert (loss.temperature, loss.student_temperature, loss.teacher_temperature) == (2.0, 2.0, 4.0)
    assert (loss.infonce_weight, loss.infonce_scale, loss.mini_batch_size) == (0.1, 50.0, 4)
    assert loss.gather_across_devices
    assert args.loss_settings()["infonce_weight"] == 0.1


def test_defaults_are_the_losses_own(model):
    loss = build_loss(model, CachedLossTrainingArguments(**BASE, loss="distill_kl", mini_batch_size=4))
    reference = CachedDistillKLDivLoss(model, mini_batch_size=4)
    assert loss.get_config_dict() == reference.get_config_dict()
    assert (loss.temperature, loss.infonce_weight, loss.infonce_scale) == (1.0, 0.0, 20.0)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("margin_mse", CachedMarginMSELoss),
        ("margin-mse", CachedMarginMSELoss),
        ("MarginMSELoss", CachedMarginMSELoss),
        ("DistillKLDivLoss", CachedDistillKLDivLoss),
        ("cacheddistillkldivloss", CachedDistillKLDivLoss),
    ],
)
def test_names(model, name, cls):
    assert isinstance(
        build_loss(model, CachedLossTrainingArguments(**BASE, loss=name, mini_batch_size=4)), cls
    )


def test_multi_vector_losses_from_the_arguments(tmp_path):
    mv = make_tiny_multi_vector(tmp_path / "mv")
    args = CachedMultiVectorEncoderTrainingArguments(
        **BASE,
        loss="MultiVectorDistillKLDivLoss",
        similarity="xtr",
        student_temperature=0.5,
        mini_batch_size=4,
    )
    loss = build_loss(mv, args)
    assert isinstance(loss, CachedMultiVectorDistillKLDivLoss)
    assert loss.similarity_fct is xtr_kd_scores and loss.student_temperature == 0.5
    margin = build_loss(
        mv,
        CachedMultiVectorEncoderTrainingArguments(**BASE, loss="multi_vector_margin_mse", similarity="xtr"),
    )
    assert margin.similarity_fct is xtr_scores_pairwise
    with pytest.raises(ValueError, match="similarity for loss='multi_vector_margin_mse' must be"):
        CachedMultiVectorEncoderTrainingArguments(**BASE, loss="multi_vector_margin_mse", similarity="cosine")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss": "mnr", "infonce_weight": 0.5}, "infonce_weight does not apply to loss='mnr'"),
        ({"loss": "margin_mse", "teacher_temperature": 2.0}, "teacher_temperature does not apply"),
        ({"loss": "distill_kl", "infonce_weight": -1.0}, "infonce_weight must be a finite number >= 0"),
        ({"loss": "distill_kl", "student_temperature": 0.0}, "student_temperature must be a positive finite"),
    ],
)
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedLossTrainingArguments(**BASE, **kwargs)


def test_a_dataset_without_negatives_or_scores_is_refused():
    args = CachedLossTrainingArguments(**BASE, loss="distill_kl", per_device_train_batch_size=2)
    good = Dataset.from_dict({"q": ["a", "b"], "p": ["c", "d"], "n": ["e", "f"], "label": [[1.0, 0.0]] * 2})
    check_dataset_columns(good, args)
    with pytest.raises(ValueError, match="no label column"):
        check_dataset_columns(Dataset.from_dict({"q": ["a"] * 2, "p": ["c"] * 2, "n": ["e"] * 2}), args)
    with pytest.raises(ValueError, match="needs \\(query, positive, negative_1"):
        check_dataset_columns(Dataset.from_dict({"q": ["a"] * 2, "p": ["c"] * 2, "label": [1.0, 0.0]}), args)


@pytest.mark.parametrize(
    ("loss", "cls"),
    [
        ("margin_mse", CachedLossTrainingArguments),
        ("multi_vector_margin_mse", CachedMultiVectorEncoderTrainingArguments),
    ],
)
@pytest.mark.parametrize("field", ["temperature", "scale"])
def test_a_margin_loss_refuses_a_scale_or_temperature(loss, cls, field):
    """The margin losses have neither a scale nor a temperature (issue 51: both were exempted as "every loss
    takes them", silently ignored, and reported by the model card): refused, naming the field."""
    with pytest.raises(ValueError, match=rf"{field} does not apply to loss={loss!r}"):
        cls(**BASE, loss=loss, **{field: 0.5})
    settings = cls(**BASE, loss=loss).loss_settings()
    assert "scale" not in settings and "temperature" not in settings


def test_the_kl_loss_takes_a_temperature_and_no_scale():
    """``temperature`` is the KL's, as sentence-transformers' DistillKLDivLoss; the InfoNCE term's scale is
    ``infonce_scale``: a ``scale`` field is refused, and the card lists the temperature alone."""
    args = CachedLossTrainingArguments(**BASE, loss="distill_kl", temperature=0.5, infonce_weight=0.1)
    assert args.loss_kwargs()["temperature"] == 0.5 and "scale" not in args.loss_kwargs()
    assert "scale" not in args.loss_settings() and args.loss_settings()["temperature"] == 0.5
    with pytest.raises(ValueError, match="scale does not apply to loss='distill_kl'"):
        CachedLossTrainingArguments(**BASE, loss="distill_kl", scale=20.0)
