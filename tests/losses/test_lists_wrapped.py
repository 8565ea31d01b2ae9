"""Lists (issue 60) inside sentence-transformers' MatryoshkaLoss: the loss and every parameter gradient equal the
weighted sum of the float64 reference over the truncated embeddings, with lists of 0-5 negatives and of 1-3
positives, in the chunked and tiled loss stages, at a mini-batch that does not divide the batch."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from tests.losses.test_lists import B, collate, embed, make_rows
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.reference import reference_listed_infonce
from tests.support.tiny_model import make_tiny_model

DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def _reference(model, rows, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    anchors = embed(model, rows["anchor"])
    negatives = embed(model, [t for neg in rows["negative"] for t in neg])
    pos_lists = [p if isinstance(p, list) else [p] for p in rows["positive"]]
    positives = embed(model, [t for p in pos_lists for t in p])
    total = torch.zeros((), dtype=torch.float64)
    for dim, weight in zip(DIMS, WEIGHTS):
        a, p, n = anchors[:, :dim], positives[:, :dim], negatives[:, :dim]
        total = total + weight * reference_listed_infonce(
            a,
            list(p.split([len(x) for x in pos_lists])),
            list(n.split([len(x) for x in rows["negative"]])),
            symmetric=symmetric,
        )
    total.backward()
    return total.detach(), flat_grads(model).clone()


CASES = {
    "mnr": (CachedMNRLoss, {}, False),
    "clip": (CachedCLIPLoss, {}, True),
    "tiled": (CachedTiledLoss, {"tile_size": 3}, False),
}


@pytest.mark.parametrize("positives", [0, 3], ids=["one_positive", "several_positives"])
@pytest.mark.parametrize("name", list(CASES))
def test_lists_inside_matryoshka_equal_the_reference(model, name, positives):
    cls, kw, symmetric = CASES[name]
    rows = make_rows(B, 5, seed=11 + positives, max_positives=positives)
    loss = MatryoshkaLoss(model, cls(model, mini_batch_size=3, **kw), DIMS, matryoshka_weights=WEIGHTS)
    model.zero_grad(set_to_none=True)
    value = loss(collate(model, rows), None)
    value.backward()
    ours, g_ours = value.detach(), flat_grads(model).clone()
    ref, g_ref = _reference(model, rows, symmetric)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, g_ref)


@pytest.mark.parametrize("name", ["mnr", "tiled"])
def test_lists_with_the_negative_bank_equal_the_reference(model, name):
    """Lists of negatives with ``negative_bank_size``: the third of three steps (no optimizer step between
    them) scores every candidate of the first two (their positives and listed negatives, without gradient) as
    extra negatives of every anchor: the reference gives them to one row's list, detached (every row's listed
    negatives are candidates of every anchor). Not vacuous: the bank changes the loss."""
    cls, kw, _ = CASES[name]
    loss_fn = cls(model, mini_batch_size=3, negative_bank_size=200, **kw)
    steps = [make_rows(B, 4, seed=70 + s) for s in range(3)]
    for rows in steps[:2]:
        model.zero_grad(set_to_none=True)
        loss_fn(collate(model, rows), None).backward()
    with torch.no_grad():
        past = torch.cat(
            [embed(model, [*r["positive"], *(t for neg in r["negative"] for t in neg)]) for r in steps[:2]]
        )
    assert loss_fn.negative_bank.stats()["negative_bank_rows"] == len(past)
    model.zero_grad(set_to_none=True)
    value = loss_fn(collate(model, steps[2]), None)
    value.backward()
    ours, g_ours = value.detach(), flat_grads(model).clone()

    def reference(bank: torch.Tensor | None) -> torch.Tensor:
        rows = steps[2]
        anchors, positives = embed(model, rows["anchor"]), embed(model, rows["positive"])
        negatives = list(
            embed(model, [t for n in rows["negative"] for t in n]).split([len(n) for n in rows["negative"]])
        )
        if bank is not None:
            negatives[0] = torch.cat([negatives[0], bank])
        return reference_listed_infonce(anchors, list(positives.split(1)), negatives)

    model.zero_grad(set_to_none=True)
    ref = reference(past)
    ref.backward()
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, flat_grads(model))
    assert abs(float(reference(None)) - float(ref)) > 1e-3
