"""CachedSparseLoss on a tiny random SPLADE model (BERT + MLM head + max SpladePooling): the loss's components
and the parameter gradients against sentence-transformers' non-cached ``SpladeLoss`` with
``SparseMultipleNegativesRankingLoss`` (the oracle), and the analytic FLOPS against autograd."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from sentence_transformers.sparse_encoder import losses as sparse_losses
from sentence_transformers.util import cos_sim

from st_cached_losses import CachedSparseLoss
from st_cached_losses.functional.representations.flops import flops_loss_and_grad
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.tiny_model import make_tiny_splade, random_texts

B = 11  # rows: mini-batch sizes 4 and 5 do not divide it, 32 exceeds it
ALL_FOUR = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
WEIGHTS = {
    "document_regularizer_weight": 0.8,
    "query_regularizer_weight": 0.5,
}  # large: their gradients count


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_splade(tmp_path_factory.mktemp("splade") / "bert")


def columns(model, n_cols: int, b: int = B, seed: int = 0):
    return [model.preprocess(random_texts(b, seed=seed + 100 * k)) for k in range(n_cols)]


def run(model, loss_fn, features):
    """The loss's components and the flat parameter gradient of their sum, as the trainer computes it."""
    model.zero_grad(set_to_none=True)
    parts = loss_fn(features, None)
    torch.stack(list(parts.values())).sum().backward()
    return {k: v.detach() for k, v in parts.items()}, flat_grads(model).clone()


def oracle(model, base=None, **kwargs):
    return sparse_losses.SpladeLoss(
        model, base or sparse_losses.SparseMultipleNegativesRankingLoss(model), **{**WEIGHTS, **kwargs}
    )


def ours(model, base=None, mini_batch_size: int = 4, **kwargs):
    splade = {k: kwargs.pop(k) for k in list(kwargs) if "regulariz" in k}
    return CachedSparseLoss(
        model,
        base or sparse_losses.SparseMultipleNegativesRankingLoss(model),
        **{**WEIGHTS, **splade},
        mini_batch_size=mini_batch_size,
        **kwargs,
    )


def assert_same(model, features, our_loss, ref_loss):
    got, got_grads = run(model, our_loss, features)
    want, want_grads = run(model, ref_loss, features)
    assert list(got) == list(want), (list(got), list(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key].float(), rtol=1e-5, atol=1e-7, msg=key)
    assert_grads_close(got_grads, want_grads)
    return got


@pytest.mark.parametrize("n_cols", [2, 3], ids=["pairs", "triplets"])
@pytest.mark.parametrize("mini_batch_size", [4, 5, 32])
def test_matches_splade_loss(model, n_cols, mini_batch_size):
    features = columns(model, n_cols)
    parts = assert_same(model, features, ours(model, mini_batch_size=mini_batch_size), oracle(model))
    assert set(parts) == {"base_loss", "document_regularizer_loss", "query_regularizer_loss"}
    assert all(v > 0 for v in parts.values())  # every component counts


@pytest.mark.parametrize(
    "options",
    [
        {"document_regularizer_threshold": 100, "query_regularizer_threshold": 95},
        {"use_document_regularizer_only": True, "query_regularizer_weight": None},
        {"query_regularizer_weight": None},
        {"document_regularizer_weight": 0.0},
    ],
    ids=["thresholds", "documents-only", "no-query", "zero-weight"],
)
def test_regularizer_options_match(model, options):
    features = columns(model, 3)
    if "document_regularizer_threshold" in options:
        # the thresholds split the rows: some count, some do not
        l0 = [(model(dict(f))["sentence_embedding"] != 0).sum(1) for f in features]
        assert 0 < int((torch.cat(l0[1:]) > 100).sum()) < 2 * B and 0 < int((l0[0] > 95).sum()) < B
    assert_same(model, features, ours(model, **options), oracle(model, **options))


def test_token_budget_matches(model):
    features = columns(model, 3)
    assert_same(model, features, ours(model, mini_batch_num_tokens=20), oracle(model))


@pytest.mark.parametrize(
    "base_options",
    [
        {"scale": 20.0, "similarity_fct": cos_sim},
        {
            "directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            "partition_mode": "joint",
        },
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        {"hardness_mode": "all_negatives", "hardness_strength": 5.0},
    ],
    ids=["cosine", "gte", "symmetric", "hardness"],
)
def test_base_loss_options_match(model, base_options):
    features = columns(model, 3)
    base = sparse_losses.SparseMultipleNegativesRankingLoss(model, **base_options)
    ref = sparse_losses.SparseMultipleNegativesRankingLoss(model, **base_options)
    assert_same(model, features, ours(model, base), oracle(model, ref))


def test_base_loss_settings_are_read_from_the_base_loss_every_step(model):
    features = columns(model, 2)
    loss = ours(model)
    loss.loss.scale = 3.0  # set on their loss, as in sentence-transformers
    assert loss.scale == 3.0
    ref = oracle(model, sparse_losses.SparseMultipleNegativesRankingLoss(model, scale=3.0))
    assert_same(model, features, loss, ref)
    loss.similarity_fct = cos_sim  # set on ours: reaches their loss
    assert loss.loss.similarity_fct is cos_sim
    with pytest.raises(ValueError, match="scale"):
        loss.scale = -1.0
    assert loss.loss.scale == 3.0  # a refused assignment changes nothing
    with pytest.raises(ValueError, match="query_to_doc"):
        loss.directions = ("doc_to_query",)
    loss.loss.partition_mode = "sideways"  # an invalid value set on their loss is refused at the next step
    with pytest.raises(ValueError, match="partition_mode"):
        loss(features, None)
    loss.loss.partition_mode = "joint"
    assert not hasattr(loss, "learnable_scale")  # the base loss's scale is fixed, as in sentence-transformers
    with pytest.raises(ValueError, match="document_regularizer_weight"):
        loss.document_regularizer_weight = float("nan")


class OwnMNRL(sparse_losses.SparseMultipleNegativesRankingLoss):
    """A base loss that is not the core's (its own compute_loss_from_embeddings): autograd on the whole batch."""

    def compute_loss_from_embeddings(self, embeddings, labels):
        return {
            "ranking": super().compute_loss_from_embeddings(embeddings, labels),
            "norm": embeddings[0].sum() * 1e-3,
        }


class L1Regularizer(torch.nn.Module):
    def compute_loss_from_embeddings(self, embeddings):
        return embeddings.abs().sum(dim=1).mean()  # an L1 regulariser


def test_other_base_losses_and_regularizers_go_through_autograd(model):
    features = columns(model, 3)
    our_loss = ours(model, OwnMNRL(model), document_regularizer=L1Regularizer())
    ref = oracle(model, OwnMNRL(model), document_regularizer=L1Regularizer())
    parts = assert_same(model, features, our_loss, ref)
    assert list(parts) == ["ranking", "norm", "document_regularizer_loss", "query_regularizer_loss"]
    with pytest.raises(AttributeError):
        _ = our_loss.scale  # the base loss has one, but it is not the core's: read it there
    assert our_loss.get_config_dict()["document_regularizer"] == "L1Regularizer"


def test_components_sum_to_the_total_with_one_graph(model):
    loss = ours(model)
    parts = loss(columns(model, 2), None)
    assert sum(v.requires_grad for v in parts.values()) == 1
    total = torch.stack(list(parts.values())).sum()
    assert total.requires_grad
    total.backward()


def test_evaluation_without_grad_matches(model):
    features = columns(model, 3)
    with torch.no_grad():
        got = ours(model)(features, None)
        want = oracle(model)(features, None)
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)


def test_calculate_loss_with_autograd_has_the_same_gradients(model):
    """The cached-loss interface (``calculate_loss``) called with autograd: the same value and gradients."""
    features = columns(model, 3)
    loss = ours(model)
    embs = [model(dict(f))["sentence_embedding"].detach().requires_grad_() for f in features]
    total = loss.calculate_loss([[e] for e in embs])
    total.backward()
    ref_embs = [e.detach().clone().requires_grad_() for e in embs]
    ref = oracle(model)
    ref_total = sum(ref.loss.compute_loss_from_embeddings(ref_embs, None) for _ in [0])
    ref_total = (
        ref_total
        + ref.document_regularizer.compute_loss_from_embeddings(torch.cat(ref_embs[1:]))
        * WEIGHTS["document_regularizer_weight"]
        + ref.query_regularizer.compute_loss_from_embeddings(ref_embs[0])
        * WEIGHTS["query_regularizer_weight"]
    )
    ref_total.backward()
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-7)
    for e, r in zip(embs, ref_embs):
        torch.testing.assert_close(e.grad, r.grad, rtol=1e-5, atol=1e-5 * r.grad.abs().max().item())


@pytest.mark.parametrize("threshold", [None, 3])
def test_flops_gradient_is_autograd_s(threshold):
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.relu(torch.randn(n, 30, generator=gen, dtype=torch.float64)) for n in (5, 1, 7)]
    leaves = [b.clone().requires_grad_() for b in blocks]
    ref = (
        sparse_losses.FlopsLoss(None, threshold=threshold).compute_loss_from_embeddings(torch.cat(leaves))
        * 0.3
    )
    ref.backward()
    out = flops_loss_and_grad(blocks, threshold, grad_output=0.3)
    torch.testing.assert_close(out.loss, ref.detach())
    for g, leaf in zip(out.grads, leaves):
        torch.testing.assert_close(g, leaf.grad)
    into = [torch.ones_like(b) for b in blocks]
    flops_loss_and_grad(blocks, threshold, grad_output=0.3, accumulate=into)
    for g, leaf in zip(into, leaves):
        torch.testing.assert_close(g, leaf.grad + 1)


def test_config_citation_and_tags(model, caplog):
    with caplog.at_level(logging.WARNING):
        loss = ours(model, document_regularizer_threshold=100, use_document_regularizer_only=True)
    assert "ignored" in caplog.text  # the query weight, as sentence-transformers warns
    config = loss.get_config_dict()
    assert config["loss"] is loss.loss and config["document_regularizer_threshold"] == 100
    assert config["mini_batch_size"] == 4 and config["mini_batch_num_tokens"] is None
    assert "query_regularizer_weight" not in config and config["use_document_regularizer_only"] is True
    assert (
        "gao2021scaling" in loss.citation and "formal2022" in loss.citation and "paria2020" in loss.citation
    )
    loss(columns(model, 2), None)
    assert "equivalent-loss:CachedSpladeLoss" in model.model_card_data.tags
    with pytest.raises(ValueError, match="compute_loss_from_embeddings"):
        CachedSparseLoss(model, torch.nn.Linear(2, 2), 1.0)
    with pytest.raises(ValueError, match="document_regularizer_threshold"):
        ours(model, document_regularizer_threshold="100")
    with pytest.raises(ValueError, match="query_regularizer_weight"):
        ours(model, query_regularizer_weight=float("inf"))
    for name in ("document_regularizer_weight", "query_regularizer_threshold"):  # the fields' one check
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            ours(model, **{name: -1.0})


def test_sparse_encoder_trainer_logs_components_and_saves(tmp_path):
    from datasets import Dataset
    from sentence_transformers.sparse_encoder import (
        SparseEncoder,
        SparseEncoderTrainer,
        SparseEncoderTrainingArguments,
    )

    model = make_tiny_splade(tmp_path / "model")
    data = Dataset.from_dict({"anchor": random_texts(32, seed=1), "positive": random_texts(32, seed=2)})
    loss = CachedSparseLoss(
        model,
        sparse_losses.SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=3e-3,
        query_regularizer_weight=5e-3,
        mini_batch_size=3,
    )
    args = SparseEncoderTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    trainer = SparseEncoderTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data.select(range(16)), loss=loss
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3
    for log in logs:
        parts = [log["base_loss"], log["document_regularizer_loss"], log["query_regularizer_loss"]]
        assert all(torch.isfinite(torch.tensor(parts))) and parts[0] > 0
        assert log["loss"] == pytest.approx(sum(parts), abs=2e-4)  # the logged parts are rounded to 4 digits
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert evals and {
        "eval_base_loss",
        "eval_document_regularizer_loss",
        "eval_query_regularizer_loss",
    } <= set(evals[0])
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()]))

    model.save_pretrained(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "CachedSparseLoss" in card and "document_regularizer_weight" in card
    reloaded = SparseEncoder(str(tmp_path / "saved"), device="cpu")
    texts = random_texts(4, seed=9)
    torch.testing.assert_close(
        reloaded.encode(texts, convert_to_tensor=True).to_dense(),
        model.encode(texts, convert_to_tensor=True).to_dense(),
    )


def test_mask_duplicates_matches_masked_reference(model):
    """``mask_duplicates`` (ours) on the core's base loss: the masked dense InfoNCE plus their FLOPS."""
    from st_cached_losses.functional.keys import input_hashes
    from tests.support.reference import reference_infonce

    texts = [random_texts(9, seed=40 + k) for k in range(3)]
    texts[1][5] = texts[1][0]  # a duplicate positive
    texts[2][3] = texts[1][0]  # a hard negative equal to row 0's positive
    features = [model.preprocess(t) for t in texts]
    keys = [input_hashes(f) for f in features]
    flops = sparse_losses.FlopsLoss(model)

    def reference(features, labels):
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        base = reference_infonce(
            embs[0], embs[1:], scale=1.0, similarity="dot", anchor_keys=keys[0], candidate_keys=keys[1:]
        )
        return {
            "base_loss": base,
            "document_regularizer_loss": flops.compute_loss_from_embeddings(torch.cat(embs[1:])) * 0.8,
            "query_regularizer_loss": flops.compute_loss_from_embeddings(embs[0]) * 0.5,
        }

    assert_same(model, features, ours(model, mask_duplicates=True), reference)
    unmasked, _ = run(model, ours(model), features)
    masked, _ = run(model, ours(model, mask_duplicates=True), features)
    assert abs(unmasked["base_loss"] - masked["base_loss"]) > 1e-4, "the test data must contain duplicates"
    with pytest.raises(ValueError, match="mask_duplicates"):
        ours(model, OwnMNRL(model), mask_duplicates=True)(features, None)


@pytest.mark.parametrize(
    "options",
    [{}, {"use_document_regularizer_only": True, "query_regularizer_weight": None, "mask_duplicates": True}],
    ids=["default", "documents-only"],
)
def test_assigning_the_current_value_changes_nothing(model, options):
    loss = ours(
        model, sparse_losses.SparseMultipleNegativesRankingLoss(model, directions=ALL_FOUR), **options
    )
    settable = sorted(
        name
        for name in {
            *loss.settings_class.names(),
            *(
                n
                for n, m in inspect.getmembers(type(loss))
                if hasattr(m, "__set__") and not isinstance(m, property)
            ),
            *(n for n, m in inspect.getmembers(type(loss)) if isinstance(m, property) and m.fset is not None),
        }
        if not name.startswith("_")
    )
    assert {"scale", "directions", "document_regularizer_weight", "use_document_regularizer_only"} <= set(
        settable
    )
    features = columns(model, 3)
    with torch.no_grad():
        before_value = loss(features, None)
    before = {name: getattr(loss, name) for name in settable}
    config = loss.get_config_dict()
    for name in settable:
        setattr(loss, name, getattr(loss, name))
        assert {n: getattr(loss, n) for n in settable} == before, name
        assert loss.get_config_dict() == config, name
    with torch.no_grad():
        ours_value = loss(features, None)
    assert {k: v.item() for k, v in ours_value.items()} == {k: v.item() for k, v in before_value.items()}
