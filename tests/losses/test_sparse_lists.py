"""Lists (issue 60) for CachedSparseLoss with sentence-transformers' ``SparseMultipleNegativesRankingLoss`` as its
base loss: a ``negative`` column of lists of texts (0 to 5 per row, empty allowed) or ``negative_1 ...
negative_K`` with None where a row has fewer, and a ``positive`` column of lists (1 to 3 per row), collated by
``ListDataCollator``. The loss's components and every parameter gradient equal a float64 reference written from
``SpladeLoss``'s semantics with the lists flattened: the base loss ``reference_listed_infonce`` (a row's other
positives masked), the documents' FLOPS over the documents that exist (every positive and list entry, none for a
missing one), the queries' FLOPS over the anchors; in the chunked and tiled loss stages, with the packed (compact)
cache and the dense one, and through one step of the stock ``SparseEncoderTrainer``. Base losses that read fixed
columns and the options without a meaning for lists are refused by name."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers.sparse_encoder import losses as sparse_losses
from sentence_transformers.util import cos_sim
from torch import Tensor

from st_cached_losses import CachedSparseLoss
from st_cached_losses.config.collator import ListDataCollator
from tests.losses.test_lists import as_columns, collate, make_rows
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.reference import reference_listed_infonce
from tests.support.tiny_model import make_tiny_splade

B = 7
WEIGHTS = {
    "document_regularizer_weight": 0.8,
    "query_regularizer_weight": 0.5,
}  # large: their gradients count


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``packed``: rows with 8-19 of 205 entries non-zero, kept packed by the engine (the compact cache);
    ``dense``: about half non-zero, kept dense."""
    base = tmp_path_factory.mktemp("splade_lists")
    return {"packed": make_tiny_splade(base / "packed", bias=-1.0), "dense": make_tiny_splade(base / "dense")}


@pytest.fixture(scope="module")
def model(models):
    return models["dense"]


#: the FLOPS thresholds (documents, queries) that keep some rows of each model and drop others
THRESHOLDS = {"packed": (13, 11), "dense": (100, 95)}


def embed(model, texts: list[str]) -> Tensor:
    if not texts:
        return torch.zeros(0, model.get_embedding_dimension())
    return model(model.preprocess(texts))["sentence_embedding"]


def flops(x: Tensor, threshold: float | None) -> Tensor:
    """sentence-transformers' ``FlopsLoss`` of the rows ``x`` (float64)."""
    return sparse_losses.FlopsLoss(None, threshold=threshold).compute_loss_from_embeddings(x.double())  # type: ignore[arg-type]


def reference_parts(
    model, rows: dict[str, list], *, scale: float = 1.0, similarity: str = "dot", symmetric: bool = False,
    document_threshold: float | None = None, query_threshold: float | None = None, documents_only: bool = False,
) -> dict[str, Tensor]:  # fmt: skip
    """``SpladeLoss``'s components with the lists flattened (float64), with a graph to the model."""
    anchors = embed(model, rows["anchor"])
    pos_lists = [p if isinstance(p, list) else [p] for p in rows["positive"]]
    positives = embed(model, [t for p in pos_lists for t in p])
    negatives = embed(model, [t for n in rows["negative"] for t in n])
    base = reference_listed_infonce(
        anchors,
        list(positives.split([len(p) for p in pos_lists])),
        list(negatives.split([len(n) for n in rows["negative"]])),
        scale=scale,
        similarity=similarity,
        symmetric=symmetric,
    )
    documents = torch.cat([positives, negatives])
    if documents_only:
        return {
            "base_loss": base,
            "document_regularizer_loss": WEIGHTS["document_regularizer_weight"]
            * flops(torch.cat([anchors, documents]), document_threshold),
        }
    return {
        "base_loss": base,
        "document_regularizer_loss": WEIGHTS["document_regularizer_weight"]
        * flops(documents, document_threshold),
        "query_regularizer_loss": WEIGHTS["query_regularizer_weight"] * flops(anchors, query_threshold),
    }


def reference_step(model, rows, **kw) -> tuple[dict[str, Tensor], Tensor]:
    model.zero_grad(set_to_none=True)
    parts = reference_parts(model, rows, **kw)
    torch.stack(list(parts.values())).sum().backward()
    return {k: v.detach() for k, v in parts.items()}, flat_grads(model).clone()


def cached_step(model, loss_fn, features) -> tuple[dict[str, Tensor], Tensor]:
    """The components and the flat parameter gradient of their sum, as the trainer computes it."""
    model.zero_grad(set_to_none=True)
    parts = loss_fn(features, None)
    torch.stack(list(parts.values())).sum().backward()
    return {k: v.detach() for k, v in parts.items()}, flat_grads(model).clone()


def assert_parts_close(ours: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    assert list(ours) == list(ref)
    for key, value in ref.items():
        torch.testing.assert_close(ours[key].double(), value, rtol=1e-5, atol=1e-7, msg=key)


#: name -> (base loss keywords, CachedSparseLoss keywords, reference keywords)
CASES = {
    "dot": ({}, {}, {}),
    "tiled": ({}, {"path": "tiled", "tile_size": 3}, {}),
    "cosine": ({"similarity_fct": cos_sim, "scale": 20.0}, {}, {"similarity": "cosine", "scale": 20.0}),
    "symmetric": (
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        {},
        {"symmetric": True},
    ),
    "thresholds": ({}, {}, {}),  # THRESHOLDS, by the model
    "documents_only": (
        {},
        {"use_document_regularizer_only": True, "query_regularizer_weight": None},
        {"documents_only": True},
    ),
}


def thresholds(name: str, form: str) -> tuple[dict, dict]:
    """The loss's and the reference's thresholds of case ``name`` on the ``form`` model."""
    if name != "thresholds":
        return {}, {}
    document, query = THRESHOLDS[form]
    return (
        {"document_regularizer_threshold": document, "query_regularizer_threshold": query},
        {"document_threshold": document, "query_threshold": query},
    )


def reference_kw(name: str, form: str = "dense") -> dict:
    return {**CASES[name][2], **thresholds(name, form)[1]}


def make_loss(model, name: str, mini_batch_size: int, form: str = "dense") -> CachedSparseLoss:
    base_kw, kw, _ = CASES[name]
    weights = {**WEIGHTS, **kw, **thresholds(name, form)[0]}
    return CachedSparseLoss(
        model,
        sparse_losses.SparseMultipleNegativesRankingLoss(model, **base_kw),
        mini_batch_size=mini_batch_size,
        **weights,
    )


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("layout", ["list", "none_padded"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mini_batch_size", [3, 64])
@pytest.mark.parametrize("form", ["packed", "dense"])
def test_lists_of_negatives_equal_the_reference(models, form, name, layout, mini_batch_size):
    model = models[form]
    rows = make_rows(B, 5, seed=len(name) + mini_batch_size)
    columns = rows if layout == "list" else as_columns(rows, 5)
    loss_fn = make_loss(model, name, mini_batch_size, form)
    ours, g_ours = cached_step(model, loss_fn, collate(model, columns))
    # the dot score on sparse enough rows keeps the cache packed (its exactness is what is checked there too)
    assert loss_fn.cache.form.compact == (form == "packed" and "similarity_fct" not in CASES[name][0])
    ref, g_ref = reference_step(model, rows, **reference_kw(name, form))
    assert_parts_close(ours, ref)
    assert_grads_close(g_ours, g_ref)


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("name", ["dot", "cosine", "symmetric", "thresholds"])
@pytest.mark.parametrize("mini_batch_size", [3, 64])
@pytest.mark.parametrize("max_negatives", [0, 5])
@pytest.mark.parametrize("form", ["packed", "dense"])
def test_several_positives_equal_the_reference(models, form, name, mini_batch_size, max_negatives):
    model = models[form]
    rows = make_rows(B, max_negatives, seed=len(name) + mini_batch_size, max_positives=3)
    features = collate(model, rows)
    ours, g_ours = cached_step(model, make_loss(model, name, mini_batch_size, form), features)
    ref, g_ref = reference_step(model, rows, **reference_kw(name, form))
    assert_parts_close(ours, ref)
    assert_grads_close(g_ours, g_ref)
    with torch.no_grad():  # evaluation: the same components, no graph
        evaluated = make_loss(model, name, mini_batch_size, form)(features, None)
    assert_parts_close({k: v.double() for k, v in evaluated.items()}, ref)


def test_one_negative_per_row_as_lists_is_bit_identical_to_a_column(model):
    rows = make_rows(B, 1, seed=2)
    rows["negative"] = [neg or ["w1 w2"] for neg in rows["negative"]]
    loss_fn = make_loss(model, "dot", 3)
    listed = cached_step(model, loss_fn, collate(model, rows))
    plain = cached_step(
        model, loss_fn, collate(model, {**rows, "negative": [n[0] for n in rows["negative"]]})
    )
    for key in plain[0]:
        assert torch.equal(listed[0][key], plain[0][key]), key
    assert torch.equal(listed[1], plain[1])


def test_one_stock_trainer_step_equals_the_reference_gradient(tmp_path):
    """One step of the stock ``SparseEncoderTrainer`` (SGD, no clipping, one batch of every row,
    ``ListDataCollator``) moves the parameters by ``lr`` times the float64 reference's gradient."""
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments

    local = make_tiny_splade(tmp_path / "splade")
    rows = make_rows(8, 4, seed=21, max_positives=2)
    _, g_ref = reference_step(local, rows)
    before = torch.cat([p.detach().flatten() for p in local.parameters()]).clone()
    lr = 1e-2
    args = SparseEncoderTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=1, learning_rate=lr,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0,
        batch_sampler="batch_sampler", dataloader_drop_last=False, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = SparseEncoderTrainer(
        model=local,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        loss=make_loss(local, "dot", 3),
        data_collator=ListDataCollator(preprocess_fn=local.preprocess),
    )
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in local.parameters()])
    assert_grads_close((before - after) / lr, g_ref, rtol=1e-4)


def test_a_base_loss_of_fixed_columns_is_refused(model):
    base = sparse_losses.SparseMarginMSELoss(model)
    loss_fn = CachedSparseLoss(model, base, document_regularizer_weight=0.1, query_regularizer_weight=0.1)
    with pytest.raises(ValueError, match="base loss SparseMarginMSELoss reads columns of one text per row"):
        loss_fn(collate(model, make_rows(B, 2, seed=1)), None)


@pytest.mark.parametrize(
    ("base_kw", "named", "positives"),
    [
        ({"hardness_mode": "hard_negatives", "hardness_strength": 1.0}, "hardness_mode='hard_negatives'", 0),
        ({"directions": ("query_to_doc", "doc_to_doc")}, "directions=", 0),
        ({"directions": ("query_to_doc", "doc_to_query")}, "partition_mode='joint'", 2),
    ],
)
def test_options_without_a_meaning_for_lists_are_refused(model, base_kw, named, positives):
    base = sparse_losses.SparseMultipleNegativesRankingLoss(model, **base_kw)
    loss_fn = CachedSparseLoss(model, base, **WEIGHTS)
    features = collate(model, make_rows(B, 2, seed=1, max_positives=positives))
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        loss_fn(features, None)
