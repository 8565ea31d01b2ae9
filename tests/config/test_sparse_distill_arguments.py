"""The arguments route of sparse distillation: ``loss: sparse_distill_kl`` / ``sparse_margin_mse`` (and
sentence-transformers' class names) build CachedSparseLoss with SparseDistillKLDivLoss / SparseMarginMSELoss as
its base loss, from a dict, YAML or the command line; the built loss equals the hand-built one in its value and
parameter gradients on a tiny random SPLADE model; the fields it does not take are refused (the InfoNCE term
with its own message); the dataset check; a short SparseEncoderTrainer run."""

from __future__ import annotations

import sys

import pytest
import torch
from datasets import Dataset
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseDistillKLDivLoss,
    SparseMarginMSELoss,
    SpladeLoss,
)
from sentence_transformers.util import pairwise_cos_sim, pairwise_dot_score

from st_cached_losses import (
    CachedLossArgumentParser,
    CachedLossTrainingArguments,
    CachedSparseEncoderTrainingArguments,
    CachedSparseLoss,
)
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from tests.config.helpers import BASE
from tests.config.test_sparse_multi_vector_arguments import _parsed
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.tiny_model import make_tiny_splade, random_texts

WEIGHTS = {"document_regularizer_weight": 0.8, "query_regularizer_weight": 0.5}
KL_FIELDS = {
    "loss": "sparse_distill_kl",
    **WEIGHTS,
    "temperature": 0.5,
    "teacher_temperature": 3.0,
    "mini_batch_size": 3,
}
MARGIN_FIELDS = {"loss": "sparse_margin_mse", **WEIGHTS, "similarity": "cosine", "mini_batch_size": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sparse_distill_args")
    make_tiny_splade(base / "bert").save(str(base / "splade"))
    return str(base / "splade")


def load(path: str):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(path, device="cpu")


def _args(**fields) -> CachedSparseEncoderTrainingArguments:
    return CachedSparseEncoderTrainingArguments(**BASE, **fields)


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_kl_loss_from_the_arguments(tmp_path, model_dir, source):
    """SparseDistillKLDivLoss as the base loss, its temperatures from the KL route's fields (``temperature`` is
    the dense KL loss's field, not a twin), the FLOPS regularisers from the sparse route's."""
    args = _parsed(tmp_path, source, KL_FIELDS)
    assert (args.loss, args.model_kind) == ("sparse_distill_kl", "SparseEncoder")
    loss = build_loss(load(model_dir), args)
    assert type(loss) is CachedSparseLoss and type(loss.loss) is SparseDistillKLDivLoss
    base = loss.loss
    assert (base.temperature, base.student_temperature, base.teacher_temperature) == (0.5, 0.5, 3.0)
    assert base.similarity_fct is pairwise_dot_score  # theirs by default
    assert (loss.document_regularizer_weight, loss.query_regularizer_weight) == (0.8, 0.5)
    assert isinstance(loss.document_regularizer, FlopsLoss) and isinstance(loss.query_regularizer, FlopsLoss)
    assert (loss.mini_batch_size, loss.mask_duplicates) == (3, False)
    settings = args.loss_settings()
    assert settings["teacher_temperature"] == 3.0 and "infonce_weight" not in settings
    assert "mask_duplicates" not in settings and "tile_size" not in settings


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_margin_loss_from_the_arguments(tmp_path, model_dir, source):
    args = _parsed(tmp_path, source, MARGIN_FIELDS)
    loss = build_loss(load(model_dir), args)
    assert type(loss) is CachedSparseLoss and type(loss.loss) is SparseMarginMSELoss
    assert loss.loss.similarity_fct is pairwise_cos_sim
    assert "teacher_temperature" not in args.loss_settings()


def _config(loss: CachedSparseLoss) -> dict:
    """The loss's configuration, its base loss (a module there) as its class and its own configuration."""
    base = loss.loss
    return {**loss.get_config_dict(), "loss": (type(base), base.get_config_dict())}


def test_defaults_are_sentence_transformers_own(model_dir):
    """Without temperature the KL base loss has SparseDistillKLDivLoss's 2.0 (not the dense loss's 1.0); the
    built loss's configuration is the hand-built one's."""
    model = load(model_dir)
    args = _args(loss="sparse_distill_kl", document_regularizer_weight=3e-5, mini_batch_size=4)
    assert args.loss_scale is None  # no InfoNCE scale: the KL base loss's temperature is its own setting
    loss = build_loss(model, args)
    assert (loss.loss.temperature, loss.loss.student_temperature, loss.loss.teacher_temperature) == (2.0,) * 3
    by_hand = CachedSparseLoss(
        model, SparseDistillKLDivLoss(model), document_regularizer_weight=3e-5, mini_batch_size=4
    )
    assert _config(loss) == _config(by_hand)
    margin = build_loss(
        model, _args(loss="sparse_margin_mse", document_regularizer_weight=3e-5, mini_batch_size=4)
    )
    by_hand = CachedSparseLoss(
        model, SparseMarginMSELoss(model), document_regularizer_weight=3e-5, mini_batch_size=4
    )
    assert _config(margin) == _config(by_hand)
    assert margin.loss.similarity_fct is pairwise_dot_score


def _batch(model, n_rows: int = 7, n_cols: int = 4, seed: int = 0):
    texts = [random_texts(n_rows, seed=seed + 17 * k) for k in range(n_cols)]
    labels = torch.randn(n_rows, n_cols - 1, generator=torch.Generator().manual_seed(seed)) * 3
    return [model.preprocess(t) for t in texts], labels


def _run(model, loss_fn, features, labels):
    model.zero_grad(set_to_none=True)
    parts = loss_fn(features, labels)
    torch.stack(list(parts.values())).sum().backward()
    return {k: v.detach() for k, v in parts.items()}, flat_grads(model).clone()


@pytest.mark.parametrize(
    ("fields", "by_hand"),
    [
        (KL_FIELDS, lambda m: SparseDistillKLDivLoss(m, temperature=0.5, teacher_temperature=3.0)),
        (MARGIN_FIELDS, lambda m: SparseMarginMSELoss(m, similarity_fct=pairwise_cos_sim)),
    ],
    ids=["kl", "margin"],
)
def test_built_loss_equals_the_hand_built_one(model_dir, fields, by_hand):
    """Loss components and parameter gradients of the loss the arguments build equal those of
    CachedSparseLoss(model, base(model, ...)) built by hand with the same settings, and (the oracle)
    sentence-transformers' non-cached SpladeLoss with that base loss."""
    model = load(model_dir)
    features, labels = _batch(model)
    ours = build_loss(model, _args(**fields))
    parts, grads = _run(model, ours, features, labels)
    hand = CachedSparseLoss(model, by_hand(model), **WEIGHTS, mini_batch_size=3)
    hand_parts, hand_grads = _run(model, hand, features, labels)
    oracle_parts, oracle_grads = _run(model, SpladeLoss(model, by_hand(model), **WEIGHTS), features, labels)
    assert parts.keys() == hand_parts.keys() == oracle_parts.keys()
    assert parts["base_loss"] > 0
    for key in parts:
        torch.testing.assert_close(parts[key], hand_parts[key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(parts[key], oracle_parts[key], rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, hand_grads)
    assert_grads_close(grads, oracle_grads)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sparse_distill_kl", "sparse_distill_kl"),
        ("sparse-distill-kl", "sparse_distill_kl"),
        ("SparseDistillKLDivLoss", "sparse_distill_kl"),
        ("sparse_margin_mse", "sparse_margin_mse"),
        ("Sparse-Margin-MSE", "sparse_margin_mse"),
        ("SparseMarginMSELoss", "sparse_margin_mse"),
        ("CachedSparseLoss", "sparse"),  # our class name stays the ranking loss's
        ("CachedSpladeLoss", "sparse"),
    ],
)
def test_names(name, expected):
    assert _args(loss=name, document_regularizer_weight=3e-5).loss == expected


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"loss": "sparse_distill_kl", "infonce_weight": 0.1},
            r"^infonce_weight does not apply to loss='sparse_distill_kl' \(CachedSparseLoss with SparseDistillKLDivLoss "
            r"as its base loss does not take infonce_weight\): infonce_weight applies to loss='distill_kl', "
            r"loss='margin_mse', loss='multi_vector_distill_kl', loss='multi_vector_margin_mse' or loss='embed_distill'\. Remove infonce_weight",
        ),
        (
            {"loss": "sparse_margin_mse", "infonce_scale": 20.0},
            r"^infonce_scale does not apply to loss='sparse_margin_mse' \(CachedSparseLoss with SparseMarginMSELoss",
        ),
        (
            {"loss": "sparse_margin_mse", "teacher_temperature": 2.0},
            r"teacher_temperature does not apply to loss='sparse_margin_mse' \(CachedSparseLoss with "
            r"SparseMarginMSELoss as its base loss does not take teacher_temperature\): teacher_temperature "
            r"applies to loss='distill_kl', loss='multi_vector_distill_kl' or loss='sparse_distill_kl'",
        ),
        ({"loss": "sparse_distill_kl", "mask_duplicates": True}, "mask_duplicates does not apply"),
        ({"loss": "sparse_distill_kl", "tile_size": 8}, "tile_size does not apply"),
        (
            {"loss": "sparse_distill_kl", "gather_across_devices": True},
            "gather_across_devices does not apply",
        ),
        ({"loss": "sparse_distill_kl", "directions": "query_to_doc"}, "directions does not apply"),
        ({"loss": "sparse_distill_kl", "hardness_mode": "hard_negatives"}, "hardness_mode does not apply"),
        ({"loss": "sparse_margin_mse", "learnable_scale": True}, "learnable_scale does not apply"),
        ({"loss": "sparse_distill_kl", "similarity": "maxsim"}, "similarity must be 'cosine' or 'dot'"),
        ({"loss": "sparse_distill_kl", "student_temperature": 0.0}, "student_temperature must be a positive"),
    ],
)
def test_fields_the_loss_does_not_take_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        _args(document_regularizer_weight=3e-5, **fields)


def test_infonce_weight_zero_is_the_default_and_accepted():
    assert _args(loss="sparse_distill_kl", document_regularizer_weight=3e-5, infonce_weight=0.0)


@pytest.mark.parametrize("loss", ["sparse_distill_kl", "sparse_margin_mse"])
def test_the_regulariser_weight_is_required_and_the_model_kind_checked(loss):
    with pytest.raises(ValueError, match=f"^loss='{loss}' needs document_regularizer_weight"):
        _args(loss=loss)
    with pytest.raises(ValueError, match=f"loss='{loss}' trains a SparseEncoder with SparseEncoderTrainer"):
        CachedLossTrainingArguments(**BASE, loss=loss, document_regularizer_weight=3e-5)


def test_the_command_line_refuses_infonce_with_one_error_line(monkeypatch, capsys):
    parser = CachedLossArgumentParser(CachedSparseEncoderTrainingArguments, prog="train.py")
    argv = ["--output_dir", "out", "--use_cpu", "--report_to", "none", "--loss", "sparse_distill_kl"]
    monkeypatch.setattr(
        sys, "argv", ["train.py", *argv, "--document_regularizer_weight", "3e-5", "--infonce_weight", "0.1"]
    )
    with pytest.raises(SystemExit) as info:
        parser.parse_command_line()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "train.py: error: infonce_weight does not apply to loss='sparse_distill_kl'"
    )
    (args,) = parser.parse_command_line(
        [*argv, "--document_regularizer_weight", "3e-5", "--student_temperature", "4"]
    )
    assert (args.loss, args.student_temperature) == ("sparse_distill_kl", 4.0)


def test_help_names_the_sparse_distillation_losses():
    text = " ".join(CachedLossArgumentParser(CachedSparseEncoderTrainingArguments).format_help().split())
    for words in (
        "for a SparseEncoder: 'sparse' (CachedSparseLoss), 'sparse_distill_kl' (CachedSparseLoss with "
        "SparseDistillKLDivLoss), 'sparse_margin_mse' (CachedSparseLoss with SparseMarginMSELoss)",
        "SparseDistillKLDivLoss, SparseMarginMSELoss",
        "Not on the sparse distillation losses",
    ):
        assert words in text, words


def test_a_dataset_without_negatives_or_scores_is_refused():
    args = _args(loss="sparse_margin_mse", document_regularizer_weight=3e-5, per_device_train_batch_size=2)
    check_dataset_columns(
        Dataset.from_dict({"q": ["a", "b"], "p": ["c", "d"], "n": ["e", "f"], "label": [1.0, 0.5]}), args
    )
    with pytest.raises(ValueError, match=r"CachedSparseLoss \(loss='sparse_margin_mse'\).*no label column"):
        check_dataset_columns(Dataset.from_dict({"q": ["a"] * 2, "p": ["c"] * 2, "n": ["e"] * 2}), args)
    with pytest.raises(ValueError, match="needs \\(query, positive, negative_1"):
        check_dataset_columns(Dataset.from_dict({"q": ["a"] * 2, "p": ["c"] * 2, "label": [1.0, 0.0]}), args)


def test_trains_through_the_sparse_encoder_trainer(tmp_path, model_dir):
    """Two steps of SparseEncoderTrainer on (query, positive, negative, label) rows through the route: the
    parameters move and the logged loss is finite."""
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer

    model = load(model_dir)
    data = Dataset.from_dict(
        {
            "query": random_texts(8, seed=1, max_words=6),
            "positive": random_texts(8, seed=2),
            "negative": random_texts(8, seed=3),
            "label": torch.randn(8, 2, generator=torch.Generator().manual_seed(0)).tolist(),
        }
    )
    args = CachedSparseEncoderTrainingArguments(
        **{**BASE, "output_dir": str(tmp_path / "out")},
        loss="sparse_distill_kl",
        document_regularizer_weight=3e-5,
        query_regularizer_weight=5e-5,
        temperature=1.0,
        per_device_train_batch_size=4,
        mini_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    loss = build_loss(model, args, train_dataset=data)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not torch.equal(before, after)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(logged)))
