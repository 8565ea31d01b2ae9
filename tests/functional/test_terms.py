"""The general InfoNCE (``functional.softmax.terms``): sentence-transformers' ``directions`` / ``partition_mode``
/ hardness options and GIST's guide masks, against sentence-transformers' own non-cached losses as the
oracle, in fp64: one process (chunked, tiled, autograd and loss-and-gradient entry points), and across
2 and 3 gloo processes with unequal batches (gathered and ring, each equal to the one-process oracle on
the global batch)."""

from __future__ import annotations

import itertools

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import gist_embed
from sentence_transformers.sentence_transformer.losses.multiple_negatives_ranking import (
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score

from st_cached_losses.functional import infonce, infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Guide
from st_cached_losses.functional.softmax.terms import gist_terms, mnrl_terms

DIRECTIONS = [
    ("query_to_doc", *extra)
    for r in range(4)
    for extra in itertools.combinations(("query_to_query", "doc_to_query", "doc_to_doc"), r)
]
CASES = [
    (dirs, part, hardness)
    for dirs in DIRECTIONS
    for part in ("joint", "per_direction")
    if not (part == "per_direction" and {"query_to_query", "doc_to_doc"} & set(dirs))
    for hardness in (None, "in_batch_negatives", "hard_negatives", "all_negatives")
]


def st_mnrl_loss(embeddings, directions, partition, hardness, strength=3.0, scale=20.0, similarity=cos_sim):
    """sentence-transformers' MultipleNegativesRankingLoss on given embeddings (no model needed)."""
    loss = MultipleNegativesRankingLoss.__new__(MultipleNegativesRankingLoss)
    torch.nn.Module.__init__(loss)
    loss.scale, loss.similarity_fct, loss.gather_across_devices = scale, similarity, False
    loss.directions, loss.partition_mode = directions, partition
    loss.hardness_mode, loss.hardness_strength = hardness, strength
    return loss.compute_loss_from_embeddings(embeddings, None)


def embeddings(b: int, n_cols: int, d: int = 6, seed: int = 0, g: int | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, g or d, generator=gen, dtype=torch.float64) for _ in range(1 + n_cols)]


def grads_of(loss: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize(("directions", "partition", "hardness"), CASES)
@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_every_option_equals_sentence_transformers(directions, partition, hardness, path):
    emb = [e.requires_grad_() for e in embeddings(7, 2)]
    ref = st_mnrl_loss(emb, directions, partition, hardness)
    ref_grads = grads_of(ref, emb)
    terms = mnrl_terms(directions, partition, hardness, 3.0, 2)
    sizes = {"chunk_size": 3} if path == "chunked" else {"tile_size": 3}
    ours = infonce(emb[0], emb[1:], scale=20.0, terms=terms, path=path, **sizes)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=0)
    for g, r in zip(grads_of(ours, emb), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    out = infonce_loss_and_grad(emb[0], emb[1:], scale=20.0, terms=terms, path=path, grad_output=2.0, **sizes)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=0)
    for g, r in zip([out.grad_anchors, *out.grad_candidates], ref_grads):
        torch.testing.assert_close(g, 2 * r, rtol=1e-10, atol=1e-12)


def test_dot_similarity_and_float32():
    emb = [e.float().requires_grad_() for e in embeddings(9, 1)]
    dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    ref = st_mnrl_loss(emb, dirs, "joint", "all_negatives", scale=1.0, similarity=dot_score)
    terms = mnrl_terms(dirs, "joint", "all_negatives", 3.0, 1)
    ours = infonce(emb[0], emb[1:], scale=1.0, similarity="dot", terms=terms)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads_of(ours, emb), grads_of(ref, emb)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_scale_gradient_matches_finite_differences(path):
    """sentence-transformers' own scale gradient is NaN here (a removed entry, -inf, times the scale):
    central differences of its loss are the oracle."""
    emb = embeddings(6, 2)
    dirs = ("query_to_doc", "query_to_query", "doc_to_doc")
    terms = mnrl_terms(dirs, "joint", "all_negatives", 3.0, 2)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    out = infonce_loss_and_grad(emb[0], emb[1:], scale=scale, terms=terms, path=path, tile_size=4)
    h = 1e-6
    fd = (
        st_mnrl_loss(emb, dirs, "joint", "all_negatives", scale=7.0 + h)
        - st_mnrl_loss(emb, dirs, "joint", "all_negatives", scale=7.0 - h)
    ) / (2 * h)
    assert float(out.grad_scale) == pytest.approx(float(fd), rel=1e-7)


def test_stable_at_scale_100_in_float32():
    emb = [e.float().requires_grad_() for e in embeddings(16, 1)]
    dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    ours = infonce(
        emb[0], emb[1:], scale=100.0, terms=mnrl_terms(dirs, "joint", "in_batch_negatives", 9.0, 1)
    )
    ref = st_mnrl_loss(
        [e.double() for e in emb], dirs, "joint", "in_batch_negatives", strength=9.0, scale=100.0
    )
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- GIST


def st_gist_loss(emb, guide, strategy, margin, anchors, positives, temperature=0.05):
    """sentence-transformers' GISTEmbedLoss with both models' embeddings given (its embedding calls
    answered from the lists)."""
    loss = gist_embed.GISTEmbedLoss.__new__(gist_embed.GISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.model = loss.guide = None
    loss.temperature, loss.similarity_fct = temperature, torch.nn.CosineSimilarity(dim=-1)
    loss.margin_strategy, loss.margin = strategy, margin
    loss.contrast_anchors, loss.contrast_positives = anchors, positives
    loss.gather_across_devices, loss.must_retokenize = False, False
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    answers = iter([emb, guide])
    original = gist_embed.embed_columns
    gist_embed.embed_columns = lambda model, features: next(answers)
    try:
        return loss([{} for _ in emb], None)
    finally:
        gist_embed.embed_columns = original


def gist_case(b: int, n_cols: int, seed: int = 0):
    emb = embeddings(b, n_cols, seed=seed)
    guide = embeddings(b, n_cols, seed=seed + 100, g=4)
    # a false negative the guide sees: positive 2 is (nearly) anchor 3; near, not equal, so that no
    # guide similarity ties a threshold exactly (rounding would then decide)
    guide[1][2] = 2 * guide[0][3] + 1e-3 * torch.arange(4, dtype=torch.float64)
    emb[1][2] = emb[0][3] + 0.1
    return emb, guide


GIST_CASES = list(
    itertools.product(["absolute", "relative"], [0.0, 0.1], [True, False], [True, False], [1, 2])
)


@pytest.mark.parametrize(("strategy", "margin", "anchors", "positives", "n_cols"), GIST_CASES)
def test_gist_equals_gist_embed_loss(strategy, margin, anchors, positives, n_cols):
    emb, guide = gist_case(6, n_cols)
    emb = [e.requires_grad_() for e in emb]
    ref = st_gist_loss(emb, guide, strategy, margin, anchors, positives)
    ref_grads = grads_of(ref, emb)
    terms = gist_terms(anchors, positives, n_cols, strategy, margin)
    for path, sizes in [("chunked", {"chunk_size": 4}), ("tiled", {"tile_size": 4})]:
        out = infonce_loss_and_grad(
            emb[0], emb[1:], scale=20.0, terms=terms, guide=Guide(guide[0], guide[1:]), path=path, **sizes
        )
        torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-12, atol=0)
        for g, r in zip([out.grad_anchors, *out.grad_candidates], ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_gist_duplicate_positive_is_masked():
    """Two rows with the same positive text: the guide rates the other row's copy equal to the
    positive, so (margin 0, strict ">") it stays; with a margin it is removed. Matches GISTEmbedLoss."""
    emb, guide = gist_case(5, 1, seed=3)
    guide[1][4] = guide[1][0]
    emb[1][4] = emb[1][0]
    terms = gist_terms(True, True, 1, "absolute", 0.05)
    out = infonce_loss_and_grad(emb[0], emb[1:], scale=20.0, terms=terms, guide=Guide(guide[0], guide[1:]))
    ref = st_gist_loss(emb, guide, "absolute", 0.05, True, True)
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- across processes


def _slices(sizes):
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def _general_worker(rank: int, world: int, sizes: list[int], kind: str, ring: bool):
    from st_cached_losses.functional.softmax.parallel import gathered_loss_and_grad, ring_loss_and_grad

    own = _slices(sizes)[rank]
    if kind == "gist":
        emb, guide = gist_case(sum(sizes), 2)
        terms = gist_terms(True, True, 2, "relative", 0.1)
        g = Guide(guide[0][own], [c[own] for c in guide[1:]])
    elif kind == "hardness":  # one direction: no term reads the documents' rows
        emb, g = embeddings(sum(sizes), 2), None
        terms = mnrl_terms(("query_to_doc",), "joint", "hard_negatives", 3.0, 2)
    else:
        emb, g = embeddings(sum(sizes), 2), None
        dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
        terms = mnrl_terms(dirs, "joint", "all_negatives", 3.0, 2)
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    strategy = ring_loss_and_grad if ring else gathered_loss_and_grad
    out = strategy(
        emb[0][own], [c[own] for c in emb[1:]], sizes, scale=scale, terms=terms, guide=g, tile_size=3,
        path="tiled" if ring else "auto",
    )  # fmt: skip
    return {"loss": out.loss, "grads": [out.grad_anchors, *out.grad_candidates], "scale": out.grad_scale}


@pytest.mark.parametrize("ring", [False, True], ids=["gather", "ring"])
@pytest.mark.parametrize("sizes", [[4, 2], [3, 1, 4]], ids=["w2", "w3"])
@pytest.mark.parametrize("kind", ["mnrl", "gist", "hardness"])
def test_across_processes_equals_one_process_global_batch(kind, sizes, ring):
    """Each process's share weighs ``W / B_global``: the shares' mean is the global loss and their
    gradients sum to ``W`` times the global gradient (DDP averages them)."""
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_general_worker, len(sizes), sizes, kind, ring, timeout=180)
    n, w = sum(sizes), len(sizes)
    if kind == "gist":
        # GISTEmbedLoss across processes contrasts each process's anchors with its own anchors only
        emb, guide = gist_case(n, 2)
        emb = [e.requires_grad_() for e in emb]
        # the global loss: the mean over every row (a process's anchors see only its own anchors)
        ref = sum(m * _gist_rows(emb, guide, sl) for sl, m in zip(_slices(sizes), sizes)) / n
    elif kind == "hardness":
        emb = [e.requires_grad_() for e in embeddings(n, 2)]
        ref = st_mnrl_loss(emb, ("query_to_doc",), "joint", "hard_negatives")
    else:
        emb = [e.requires_grad_() for e in embeddings(n, 2)]
        dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
        ref = st_mnrl_loss(emb, dirs, "joint", "all_negatives")
    ref_grads = grads_of(ref, emb)
    assert float(sum(r["loss"] for r in per_rank)) / w == pytest.approx(float(ref.detach()), rel=1e-12)
    for k, r in enumerate(ref_grads):
        ours = torch.cat([p["grads"][k] for p in per_rank]) / w
        torch.testing.assert_close(ours, r, rtol=1e-9, atol=1e-12)
    scales = [float(p["scale"]) for p in per_rank]
    assert max(scales) == min(scales)


def _gist_rows(emb, guide, rows: slice):
    """GISTEmbedLoss of the rows ``rows`` as one process of a gathered run sees them: its anchors
    against every positive and negative, its own anchors, and its positives against every positive."""
    import torch.nn.functional as F

    def cos(a, b):
        return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T

    a, p, *negs = emb
    ga, gp, *gn = guide
    idx = torch.arange(rows.start, rows.stop)
    local = torch.arange(rows.stop - rows.start)
    g_pos = cos(ga[rows], gp)[local, idx][:, None]
    thr = g_pos - g_pos.abs() * 0.1

    def masked(s, g, positive=False):
        m = g > thr
        if positive:
            m[local, idx] = False
        return s.masked_fill(m, -torch.inf)

    blocks = [masked(cos(a[rows], p), cos(ga[rows], gp), True)]
    blocks.append(masked(cos(a[rows], a[rows]), cos(ga[rows], ga[rows])))
    blocks.append(masked(cos(p[rows], p), cos(gp[rows], gp)))
    blocks += [masked(cos(a[rows], n), cos(ga[rows], g)) for n, g in zip(negs, gn)]
    logits = torch.cat(blocks, dim=1) * 20.0
    return F.cross_entropy(logits, idx)


def test_gist_rows_reference_is_gist_embed_loss_on_one_process():
    """The per-process GIST reference above is sentence-transformers' loss when one process holds all."""
    emb, guide = gist_case(6, 2)
    ref = st_gist_loss(emb, guide, "relative", 0.1, True, True)
    torch.testing.assert_close(_gist_rows(emb, guide, slice(0, 6)), ref, rtol=1e-12, atol=0)
