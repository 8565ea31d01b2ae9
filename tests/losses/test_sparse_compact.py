"""CachedSparseLoss with the compact cache (only the non-zero entries of the embeddings and the gradients
on them, :mod:`st_cached_losses.losses.sparse_cache`): the same components and parameter gradients as the
dense cache and as sentence-transformers' ``SpladeLoss``; the packed form is what the loss stage reads and
what the replay gets, and the dense form where it would not save memory or not be exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sentence_transformers.sparse_encoder import losses as sparse_losses
from sentence_transformers.util import cos_sim

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.losses.sparse_cache import CompactSparseRows, zero_gradient_at_zero
from tests.losses.test_cached_sparse import (
    B,
    L1Regularizer,
    OwnMNRL,
    assert_same,
    columns,
    oracle,
    ours,
    run,
)
from tests.losses.test_losses import assert_grads_close
from tests.support.tiny_model import make_tiny_splade, random_texts


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory):
    """Rows with 8-19 of 205 entries non-zero (4-9%): below the density the compact form is chosen for."""
    return make_tiny_splade(tmp_path_factory.mktemp("splade") / "bert", bias=-1.0)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """Rows with about half of 205 entries non-zero: the dense form."""
    return make_tiny_splade(tmp_path_factory.mktemp("splade") / "bert")


class Spy:
    """Records the shapes the loss stage reads and the gradient rows the replay gets."""

    def __init__(self, loss):
        self.read: list[tuple[int, ...]] = []
        self.replayed: list[tuple[int, ...]] = []
        stage, expand = loss.stage, loss.cache.form.expand
        spy = self

        class Reading:
            """The loss's stage, recording what it reads."""

            def __getattr__(self, name):
                return getattr(stage, name)

            def __call__(self, batch, with_grad):
                spy.read += [tuple(e.shape) for e in batch.embeddings]
                return stage(batch, with_grad)

        def expanded(grad, out):
            self.replayed.append(tuple(grad.shape))
            return expand(grad, out)

        loss.stage = Reading()
        loss.cache.form.expand = expanded


def dense_twin(model, **kwargs):
    """Our loss with the engine's dense cache (no form)."""
    loss = ours(model, **kwargs)
    loss.cache = dataclasses.replace(loss.cache, form=CacheForm())  # the engine is frozen: a new one
    return loss


def assert_compact_equals_dense(model, features, kwargs, base_options=None):
    base = sparse_losses.SparseMultipleNegativesRankingLoss(model, **(base_options or {}))
    twin = sparse_losses.SparseMultipleNegativesRankingLoss(model, **(base_options or {}))
    loss = ours(model, base, **kwargs)
    spy = Spy(loss)
    got, got_grads = run(model, loss, features)
    want, want_grads = run(model, dense_twin(model, base=twin, **kwargs), features)
    assert loss.cache.form.compact
    dim = model.get_embedding_dimension()
    assert spy.read and all(len(s) == 3 and s[2] == 2 and s[1] < dim for s in spy.read), spy.read
    assert spy.replayed and all(len(s) == 3 for s in spy.replayed), spy.replayed
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    assert want_grads.abs().max() > 0
    assert_grads_close(got_grads, want_grads)
    return got


CASES = [
    ({"mini_batch_size": 4}, None),
    ({"mini_batch_size": 5}, None),
    ({"mini_batch_size": 32}, None),  # one mini-batch: nothing replayed, every graph kept
    ({"mini_batch_num_tokens": 20}, None),
    ({"document_regularizer_threshold": 15, "query_regularizer_threshold": 14}, None),
    ({"use_document_regularizer_only": True, "query_regularizer_weight": None}, None),
    ({"query_regularizer_weight": None}, None),
    ({"path": "tiled", "tile_size": 3}, None),
    ({"mask_duplicates": True}, None),
    (
        {},
        {
            "directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            "partition_mode": "joint",
        },
    ),
    ({}, {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}),
    ({}, {"hardness_mode": "all_negatives", "hardness_strength": 5.0}),
]


@pytest.mark.parametrize("n_cols", [2, 3], ids=["pairs", "triplets"])
@pytest.mark.parametrize(
    ("kwargs", "base_options"),
    CASES,
    ids=["mb4", "mb5", "mb32", "tokens", "thresholds", "documents-only", "no-query", "tiled", "duplicates", "gte",
         "symmetric", "hardness"],
)  # fmt: skip
def test_compact_equals_dense_and_splade_loss(sparse_model, n_cols, kwargs, base_options):
    features = columns(sparse_model, n_cols)
    if "mask_duplicates" in kwargs:
        texts = [random_texts(B, seed=40 + k) for k in range(n_cols)]
        texts[1][5] = texts[1][0]  # a duplicate positive
        texts[-1][3] = texts[1][0]  # (triplets) a hard negative equal to row 0's positive
        features = [sparse_model.preprocess(t) for t in texts]
    if "document_regularizer_threshold" in kwargs:
        # the thresholds split the rows: some count, some do not
        l0 = [(sparse_model(dict(f))["sentence_embedding"] != 0).sum(1) for f in features]
        assert 0 < int((torch.cat(l0[1:]) > 15).sum()) < (n_cols - 1) * B and 0 < int((l0[0] > 14).sum()) < B
    got = assert_compact_equals_dense(sparse_model, features, kwargs, base_options)
    if not kwargs.get("mask_duplicates"):
        # and sentence-transformers' non-cached loss
        base = sparse_losses.SparseMultipleNegativesRankingLoss(sparse_model, **(base_options or {}))
        ref = oracle(sparse_model, base, **{k: v for k, v in kwargs.items() if "regulariz" in k})
        want, _ = run(sparse_model, ref, features)
        for key in want:
            torch.testing.assert_close(got[key], want[key].float(), rtol=1e-5, atol=1e-7, msg=key)


def test_compact_forced_on_half_dense_rows(dense_model):
    """Rows half non-zero, kept packed anyway (max_density=1): still the dense path's results."""
    loss = ours(dense_model)
    loss.cache.form.max_density = 1.0
    features = columns(dense_model, 3)
    spy = Spy(loss)
    assert_same(dense_model, features, loss, oracle(dense_model))
    assert loss.cache.form.compact and all(len(s) == 3 for s in spy.read)


def test_dense_rows_stay_dense(dense_model):
    """The default density limit: rows about half non-zero are kept dense (packing would not save)."""
    loss = ours(dense_model)
    spy = Spy(loss)
    assert_same(dense_model, columns(dense_model, 3), loss, oracle(dense_model))
    assert not loss.cache.form.compact
    assert spy.read and all(len(s) == 2 for s in spy.read)


def test_one_dense_mini_batch_makes_the_step_dense(sparse_model):
    form = CompactSparseRows(lambda: True)
    sparse = torch.zeros(4, 100)
    sparse[:, :3] = 1.0
    dense = torch.ones(2, 100)
    parts = [[form.pack(sparse)], [form.pack(sparse), form.pack(dense)]]
    assert [p.dim() for c in parts for p in c] == [3, 3, 2]
    out = form.finish(parts)
    assert not form.compact
    assert all(p.dim() == 2 for c in out for p in c)
    torch.testing.assert_close(out[1][0], sparse, rtol=0, atol=0)


def test_dense_where_compact_is_not_exact_or_not_read(sparse_model):
    features = columns(sparse_model, 3)
    # cosine similarity: the core normalises dense rows
    base = sparse_losses.SparseMultipleNegativesRankingLoss(sparse_model, scale=20.0, similarity_fct=cos_sim)
    loss = ours(sparse_model, base)
    run(sparse_model, loss, features)
    assert not loss.cache.form.compact
    # another base loss or regulariser goes through autograd on dense rows
    for loss in [
        ours(sparse_model, document_regularizer=L1Regularizer()),
        ours(sparse_model, OwnMNRL(sparse_model)),
    ]:
        assert_same(
            sparse_model,
            features,
            loss,
            oracle(sparse_model, loss.loss, document_regularizer=loss.document_regularizer),
        )
        assert not loss.cache.form.compact
    # a model that does not end with SpladePooling: its zero entries may have a gradient
    assert zero_gradient_at_zero(sparse_model)
    assert not zero_gradient_at_zero(torch.nn.Sequential(torch.nn.Linear(3, 3)))


def test_evaluation_reads_packed_rows(sparse_model):
    features = columns(sparse_model, 3)
    loss = ours(sparse_model)
    spy = Spy(loss)
    with torch.no_grad():
        got = loss(features, None)
        want = oracle(sparse_model)(features, None)
    assert spy.read and all(len(s) == 3 for s in spy.read)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
