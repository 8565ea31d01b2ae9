"""CachedCrossEncoderLoss in sentence-transformers' CrossEncoderTrainer: two training steps with ``loss=``
(prompt from the arguments included) move the model; ``loss: cross_encoder`` in the arguments builds it with
the fields' settings, CrossEncoderTrainer accepts the arguments class, and the model card names the loss and
its settings."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer

from st_cached_losses import CachedCrossEncoderLoss, CachedCrossEncoderTrainingArguments, build_loss
from tests.support.tiny_model import make_tiny_cross_encoder, random_texts


def dataset(rows: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "query": random_texts(rows, seed=1, max_words=4),
            "answer": random_texts(rows, seed=2, max_words=20),
            "negative": random_texts(rows, seed=3, max_words=20),
        }
    )


def snapshot(model: CrossEncoder) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_trainer_with_loss_trains_two_steps(tmp_path):
    model = make_tiny_cross_encoder(tmp_path / "ce", dropout=0.1)
    loss = CachedCrossEncoderLoss(model, num_negatives=3, mini_batch_size=5)
    args = CachedCrossEncoderTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        prompts="w150 w151 ",
    )
    before = snapshot(model)
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=dataset(), loss=loss)
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)
    assert (snapshot(model) - before).abs().max() > 0


def test_loss_from_the_arguments_and_model_card(tmp_path):
    from st_cached_losses.config.model_card import add_training_section

    model = make_tiny_cross_encoder(tmp_path / "ce")
    args = CachedCrossEncoderTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        mini_batch_size=3,
        num_negatives="all",
        mini_batch_num_tokens=64,
    )
    assert args.loss == "cross_encoder" and args.model_kind == "CrossEncoder"
    loss = build_loss(model, args, train_dataset=dataset())
    assert isinstance(loss, CachedCrossEncoderLoss)
    assert (loss.num_negatives, loss.scale, loss.mini_batch_size, loss.mini_batch_num_tokens) == (
        None,
        10.0,
        3,
        64,
    )
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=dataset(), loss=loss)
    trainer.train()
    model.save_pretrained(str(tmp_path / "saved"))
    card = add_training_section(tmp_path / "saved", trainer).read_text()
    assert "CachedCrossEncoderLoss" in card
    from st_cached_losses.config.model_card import project_url

    assert f"Trained by [st_cached_losses]({project_url()}) with" in card  # the project's address, linked
    assert '"num_negatives": "all"' in card and '"mini_batch_size": 3' in card
    assert "similarity" not in args.loss_settings()
    assert "equivalent-loss:CachedMultipleNegativesRankingLoss" in model.model_card_data.tags


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_negatives": 0}, "num_negatives must be"),
        ({"similarity": "cosine"}, "similarity does not apply to loss=.cross_encoder.*Remove similarity"),
        ({"learnable_scale": True}, "learnable_scale does not apply"),
    ],
)
def test_fields_the_reranker_loss_does_not_take_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedCrossEncoderTrainingArguments(output_dir=str(tmp_path), **kwargs)


def test_num_negatives_is_refused_for_other_losses(tmp_path):
    from st_cached_losses import CachedLossTrainingArguments

    with pytest.raises(ValueError, match="num_negatives does not apply"):
        CachedLossTrainingArguments(output_dir=str(tmp_path), loss="mnr", num_negatives=2)


def test_a_loss_for_another_model_kind_is_refused(tmp_path):
    """CrossEncoderTrainer takes only its own arguments class, so the reranker's arguments train a reranker."""
    with pytest.raises(ValueError, match="trains a SentenceTransformer"):
        CachedCrossEncoderTrainingArguments(output_dir=str(tmp_path), loss="mnr")


def test_a_sentence_transformer_is_refused_for_the_reranker_loss(tmp_path):
    from tests.support.tiny_model import make_tiny_model

    args = CachedCrossEncoderTrainingArguments(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="CrossEncoder"):
        build_loss(make_tiny_model(tmp_path / "st"), args)


def test_example_runs_end_to_end_on_a_tiny_reranker(tmp_path):
    """examples/train_cached_cross_encoder.py trains, evaluates before and after, and writes the card."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "train_cached_cross_encoder.py"
    spec = importlib.util.spec_from_file_location("train_cached_cross_encoder", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    make_tiny_cross_encoder(tmp_path / "ce")
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tmp_path / "ce"), "--output_dir", str(out), "--max_steps", "2"]
    argv += ["--train_pairs", "32", "--eval_queries", "4", "--candidates", "4", "--max_length", "32"]
    argv += ["--per_device_train_batch_size", "8", "--mini_batch_size", "6", "--disable_tqdm", "true"]
    trainer, metrics = module.main(argv)
    assert isinstance(trainer.loss, CachedCrossEncoderLoss) and trainer.state.global_step == 2
    assert set(metrics) == {"before", "after"} and set(metrics["after"]) == {"MRR@10", "NDCG@10"}
    card = (out / "README.md").read_text()
    assert "CachedCrossEncoderLoss" in card and "Cached loss training" in card


def test_num_negatives_all_from_the_command_line_and_none_means_all(tmp_path):
    """``--num_negatives all`` (the examples' command line) parses, and the field's None means every in-batch
    negative, as the loss's None does (it built 4 negatives before), and the card says 'all'."""
    from st_cached_losses.config.cli import CachedLossArgumentParser

    parser = CachedLossArgumentParser(CachedCrossEncoderTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_negatives", "all"])
    assert args.num_negatives == "all"
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_negatives", "3"])
    assert args.num_negatives == 3
    model = make_tiny_cross_encoder(tmp_path / "ce")
    for value in ("all", None):
        args = CachedCrossEncoderTrainingArguments(output_dir=str(tmp_path), num_negatives=value)
        assert args.num_negatives == "all"
        assert build_loss(model, args).num_negatives is None
        assert args.loss_settings()["num_negatives"] == "all"
