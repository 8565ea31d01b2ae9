"""The arguments route for every model kind: 'sparse' trains a SparseEncoder through
SparseEncoderTrainer and 'multi_vector' a MultiVectorEncoder through MultiVectorEncoderTrainer, each from its own
arguments class (one spec per setting: the classes share CachedLossArguments' fields), with their data collators'
task stamping: the first column tokenized as queries (ColBERT's query expansion included)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from datasets import Dataset

from st_cached_losses import (
    CachedLossTrainingArguments,
    CachedMultiVectorEncoderTrainingArguments,
    CachedSparseEncoderTrainingArguments,
    build_loss,
)
from st_cached_losses.config.training_args import LOSS_FIELDS, CachedLossArguments
from tests.support.tiny_model import make_tiny_multi_vector, make_tiny_splade, random_texts

EXPANSION = 24  # ColBERT's fixed query length: queries are padded to it with expansion tokens


def _base(tmp_path) -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": "none",
        "max_steps": 2,
        "per_device_train_batch_size": 6,
        "mini_batch_size": 2,
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "loss_show_progress_bar": False,
    }


def _dataset() -> Dataset:
    return Dataset.from_dict(
        {"anchor": random_texts(12, seed=3, max_words=6), "positive": random_texts(12, seed=4, max_words=30)}
    )


def _spy(loss: torch.nn.Module) -> list[list[dict[str, Any]]]:
    """The features of every call of the loss (as the trainer's collator made them)."""
    seen: list[list[dict[str, Any]]] = []
    forward = loss.forward

    def spy(features: Any, labels: Any = None) -> Any:
        features = list(features)
        seen.append(features)
        return forward(features, labels)

    loss.forward = spy  # type: ignore[method-assign]
    return seen


def _snapshot(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters() if p.requires_grad])


def test_multi_vector_trains_through_its_own_trainer_with_queries_as_queries(tmp_path):
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoderTrainer

    model = make_tiny_multi_vector(tmp_path / "mv")
    model[0].query_expansion = {"strategy": "fixed", "attend": True, "length": EXPANSION}
    args = CachedMultiVectorEncoderTrainingArguments(**_base(tmp_path), similarity="xtr")
    assert args.loss == "multi_vector" and args.model_kind == "MultiVectorEncoder"
    loss = build_loss(model, args)
    seen = _spy(loss)
    before = _snapshot(model)
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss)
    trainer.train()
    assert len(seen) == 2 and not torch.equal(_snapshot(model), before)
    for queries, documents in seen:
        assert (queries["task"], documents["task"]) == ("query", "document")
        # queries expanded to ColBERT's query length, documents as long as their longest text
        assert queries["input_ids"].shape[1] == EXPANSION and "query_expansion_positions" in queries
        assert documents["input_ids"].shape[1] != EXPANSION and "query_expansion_positions" not in documents


def test_sparse_trains_through_its_own_trainer_with_queries_as_queries(tmp_path):
    """An inference-free SPLADE model: the collator routes the queries (router_mapping) to the query route."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

    documents = make_tiny_splade(tmp_path / "splade", bias=-0.05)
    transformer, pooling = documents[0], documents[1]
    query = SparseStaticEmbedding(tokenizer=transformer.tokenizer, frozen=False)
    router = Router.for_query_document(query_modules=[query], document_modules=[transformer, pooling])
    model = SparseEncoder(modules=[router], device="cpu")
    args = CachedSparseEncoderTrainingArguments(
        **_base(tmp_path),
        document_regularizer_weight=3e-5,
        router_mapping={"anchor": "query", "positive": "document"},
    )
    assert args.loss == "sparse" and args.model_kind == "SparseEncoder"
    loss = build_loss(model, args)
    seen = _spy(loss)
    before = _snapshot(model)
    trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss)
    trainer.train()
    assert len(seen) == 2 and not torch.equal(_snapshot(model), before)
    for queries, docs in seen:
        assert (queries["task"], docs["task"]) == ("query", "document")


def test_each_trainer_takes_its_own_class_only(tmp_path):
    """The class of another model kind is refused by the trainer, as sentence-transformers' own classes are."""
    from sentence_transformers import SentenceTransformerTrainer

    model = make_tiny_splade(tmp_path / "splade")
    args = CachedSparseEncoderTrainingArguments(**_base(tmp_path), document_regularizer_weight=3e-5)
    with pytest.raises(ValueError, match="SentenceTransformerTrainingArguments"):
        SentenceTransformerTrainer(
            model=model, args=args, train_dataset=_dataset(), loss=build_loss(model, args)
        )


@pytest.mark.parametrize(
    ("cls", "kwargs", "wanted"),
    [
        (
            CachedLossTrainingArguments,
            {"loss": "sparse", "document_regularizer_weight": 3e-5},
            "CachedSparseEncoder",
        ),
        (CachedLossTrainingArguments, {"loss": "multi_vector"}, "CachedMultiVectorEncoderTrainingArguments"),
        (CachedSparseEncoderTrainingArguments, {"loss": "mnr"}, "CachedLossTrainingArguments"),
        (CachedMultiVectorEncoderTrainingArguments, {"loss": "clip"}, "CachedLossTrainingArguments"),
        (CachedSparseEncoderTrainingArguments, {"loss": "multi_vector"}, "CachedMultiVectorEncoder"),
    ],
)
def test_a_loss_for_another_model_kind_names_the_class_to_use(tmp_path, cls, kwargs, wanted):
    """SentenceTransformerTrainer would take the first class for a SparseEncoder and tokenize its queries as
    documents: refused when the arguments are built, naming the class (and trainer) the loss needs."""
    with pytest.raises(ValueError, match=rf"trains a \w+ with \w+Trainer, which takes {wanted}"):
        cls(**{**_base(tmp_path), **kwargs})


def test_the_classes_share_one_set_of_loss_fields():
    """One spec per setting: every class has the same loss fields, with the same help; only the loss's default
    differs (each class's own model kind)."""
    classes = [
        CachedLossTrainingArguments,
        CachedSparseEncoderTrainingArguments,
        CachedMultiVectorEncoderTrainingArguments,
    ]
    fields = [{f.name: f for f in dataclasses.fields(c) if f.name in LOSS_FIELDS} for c in classes]
    assert all(set(f) == set(LOSS_FIELDS) for f in fields)
    for name in LOSS_FIELDS:
        assert len({f[name].metadata["help"] for f in fields}) == 1, name
        if name != "loss":
            assert len({repr(f[name].default) for f in fields}) == 1, name
    assert [f["loss"].default for f in fields] == ["mnr", "sparse", "multi_vector"]
    assert all(issubclass(c, CachedLossArguments) for c in classes)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (CachedLossTrainingArguments, {}),
        (CachedSparseEncoderTrainingArguments, {"document_regularizer_weight": 3e-5}),
        (CachedMultiVectorEncoderTrainingArguments, {"similarity": "xtr"}),
    ],
)
def test_arguments_pickle_under_the_documented_path(tmp_path, cls, kwargs):
    """Checkpoints pickle the arguments (training_args.bin) by the class's module: the documented path."""
    import st_cached_losses.training_args as documented

    assert cls.__module__ == "st_cached_losses.training_args" and getattr(documented, cls.__name__) is cls
    args = cls(**_base(tmp_path), **kwargs)
    restored = pickle.loads(pickle.dumps(args))
    assert type(restored) is cls and restored.loss_settings() == args.loss_settings()


def test_the_parser_reads_a_sparse_run(tmp_path):
    import yaml

    from st_cached_losses import CachedLossArgumentParser

    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {"output_dir": str(tmp_path), "report_to": "none", "document_regularizer_weight": 3e-5}
        )
    )
    (args,) = CachedLossArgumentParser(CachedSparseEncoderTrainingArguments).parse_yaml_file(
        tmp_path / "run.yaml"
    )
    assert type(args) is CachedSparseEncoderTrainingArguments and args.loss == "sparse"
    assert (
        "training (SparseEncoderTrainingArguments"
        in CachedLossArgumentParser(CachedSparseEncoderTrainingArguments).format_help()
    )


def test_the_parser_reads_the_multi_vector_class_and_its_max_length():
    """HfArgumentParser refuses sentence-transformers' MultiVectorEncoderTrainingArguments (max_length: int |
    None | dict, one type per flag); CachedLossArgumentParser reads it, max_length as an int or a JSON mapping."""
    from st_cached_losses import CachedLossArgumentParser

    parser = CachedLossArgumentParser(CachedMultiVectorEncoderTrainingArguments)
    base = ["--output_dir", "unused", "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses([*base, "--max_length", "64", "--similarity", "xtr"])
    assert (args.max_length, args.loss, args.similarity) == (64, "multi_vector", "xtr")
    (args,) = parser.parse_args_into_dataclasses([*base, "--max_length", '{"query": 32, "document": 180}'])
    assert args.max_length == {"query": 32, "document": 180}
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses([*base, "--max_length", "long"])
    field = {f.name: f for f in dataclasses.fields(CachedMultiVectorEncoderTrainingArguments)}["max_length"]
    assert "dict" in str(field.type)  # the dataclass's own field is left as declared
