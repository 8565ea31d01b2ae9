"""Lists (issue 60) for CachedGISTLoss: a ``negative`` column of lists of texts (0 to 5 per row, empty allowed),
or ``negative_1 ... negative_K`` with None where a row has fewer, collated by ``ListDataCollator``. The guide (a
model, one of another vocabulary that re-tokenises, or the model itself) embeds the same existing texts; each
row's threshold is its one positive's guide similarity; every row's negatives are candidates of every anchor,
rated by the guide as a hard-negative column's are. The loss and every parameter gradient equal a float64
reference written from sentence-transformers' ``GISTEmbedLoss`` with the negatives flattened
(``reference_listed_gist``, itself checked against ``GISTEmbedLoss`` where every row has one negative), in the
chunked and tiled loss stages, inside MatryoshkaLoss and through one step of the stock trainer. Several positives
per row and the options without a meaning for lists are refused by name."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss, MatryoshkaLoss
from torch import Tensor

from st_cached_losses import CachedGISTLoss
from st_cached_losses.config.collator import ListDataCollator
from tests.losses.test_lists import as_columns, collate, embed, make_rows
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.losses.test_trainer import flat_params, make_args
from tests.support.tiny_model import WORDS, make_tiny_model

B = 7
TEMPERATURE = 0.05


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("gist_lists")
    model = make_tiny_model(base / "model", dropout=0.0, seed=0)
    guide = make_tiny_model(base / "guide", dropout=0.0, seed=5, hidden=24)
    other = make_tiny_model(base / "other", dropout=0.0, seed=6, words=list(reversed(WORDS)))
    return {"model": model, "guide": guide, "other": other}


def reference_listed_gist(
    anchors: Tensor,
    positives: Tensor,
    negatives: Sequence[Tensor],
    guide: tuple[Tensor, Tensor, Sequence[Tensor]],
    *,
    temperature: float = TEMPERATURE,
    margin_strategy: str = "absolute",
    margin: float = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    processes: Sequence[int] | None = None,
) -> Tensor:
    """sentence-transformers' ``GISTEmbedLoss`` (6.3) in float64 with lists: ``negatives[i]`` ``(n_i, d)`` row
    ``i``'s (``n_i >= 0``), flattened into one block of candidates of every anchor; ``guide`` the guide's
    embeddings of the same texts, ``(anchors, positives, negatives per row)``. Each row's threshold is its
    positive's guide similarity minus the margin; every entry the guide rates above it is removed (never the
    row's positive), a row's own anchor-anchor and positive-positive entries always. ``processes``: the rows of
    each process in order, as ``GISTEmbedLoss`` gathered across processes (the anchor-anchor block holds the
    anchors of the row's own process only); None: one process."""

    def cos(x: Tensor, y: Tensor) -> Tensor:
        return F.normalize(x.double(), dim=-1) @ F.normalize(y.double(), dim=-1).T

    def flat(rows: Sequence[Tensor], like: Tensor) -> Tensor:
        return torch.cat(list(rows)) if rows else like[:0]

    ga, gp, gn = guide
    b = anchors.shape[0]
    guided_ap = cos(ga, gp)
    g = guided_ap.diagonal()[:, None]
    threshold = g - margin if margin_strategy == "absolute" else g - g.abs() * margin
    eye = torch.eye(b, dtype=torch.bool)

    def masked(sim: Tensor, guided: Tensor, keep: Tensor | None = None) -> Tensor:
        mask = guided > threshold
        if keep is not None:
            mask &= ~keep
        return sim.masked_fill(mask, -torch.inf)

    blocks = [masked(cos(anchors, positives), guided_ap, keep=eye)]
    if contrast_anchors:
        other = eye
        if processes is not None:
            process = torch.repeat_interleave(torch.arange(len(processes)), torch.tensor(list(processes)))
            other = eye | (process[:, None] != process[None, :])
        blocks.append(masked(cos(anchors, anchors), cos(ga, ga)).masked_fill(other, -torch.inf))
    if contrast_positives:
        blocks.append(masked(cos(positives, positives), cos(gp, gp)).masked_fill(eye, -torch.inf))
    n, guided_n = flat(negatives, positives), flat(gn, gp)
    if len(n):
        blocks.append(masked(cos(anchors, n), cos(ga, guided_n)))
    scores = torch.cat(blocks, dim=1) / temperature
    return F.cross_entropy(scores, torch.arange(b))


def embed_rows(model, rows: dict[str, list]) -> tuple[Tensor, Tensor, list[Tensor]]:
    """A model's embeddings of the rows: anchors, positives, each row's negatives."""
    anchors, positives = embed(model, rows["anchor"]), embed(model, rows["positive"])
    flat = [t for neg in rows["negative"] for t in neg]
    negatives = list(embed(model, flat).split([len(neg) for neg in rows["negative"]]))
    return anchors, positives, negatives


def reference_step(model, guide, rows: dict[str, list], **kw) -> tuple[Tensor, Tensor]:
    """The float64 reference's loss and parameter gradient (``guide`` None: the model's own embeddings,
    detached, guide)."""
    model.zero_grad(set_to_none=True)
    a, p, n = embed_rows(model, rows)
    if guide is None:
        guided = (a.detach(), p.detach(), [x.detach() for x in n])
    else:
        with torch.no_grad():
            guided = embed_rows(guide, rows)
    loss = reference_listed_gist(a, p, n, guided, **kw)
    loss.backward()
    return loss.detach(), flat_grads(model).clone()


def cached_step(model, loss_fn, features) -> tuple[Tensor, Tensor]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features)
    loss.backward()
    return loss.detach(), flat_grads(model).clone()


# the tiny random guide rates every pair 0.77 ... 1.0: a margin of 0.03 removes some negatives, not all
OPTIONS = {
    "default": {},
    "margin": {"margin": 0.03},
    "relative": {"margin_strategy": "relative", "margin": 0.03},
    "no_contrast": {"contrast_anchors": False, "contrast_positives": False, "margin": 0.03},
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_reference_is_gist_embed_loss_with_one_negative_per_row(models, options):
    """The reference, with one negative per row, is sentence-transformers' own loss (so it is GIST's rule)."""
    model, guide = models["model"], models["guide"]
    kw = OPTIONS[options]
    rows = make_rows(B, 1, seed=3)
    rows["negative"] = [neg or ["w1 w2 w3"] for neg in rows["negative"]]
    ref, g_ref = reference_step(model, guide, rows, **kw)
    column = {**rows, "negative": [neg[0] for neg in rows["negative"]]}
    features = [model.preprocess(column[k]) for k in ("anchor", "positive", "negative")]
    theirs, g_theirs = cached_step(
        model, lambda f: GISTEmbedLoss(model, guide, TEMPERATURE, **kw)(f, None), features
    )
    assert float(ref) > 0.1, "vacuous: the guide removed every negative"
    torch.testing.assert_close(theirs.double(), ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_theirs, g_ref)


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("guide_name", ["guide", "other", "self"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize(("path", "mini_batch_size"), [("chunked", 3), ("tiled", 3), ("auto", 64)])
def test_lists_of_negatives_equal_the_reference(models, guide_name, options, path, mini_batch_size):
    model = models["model"]
    guide = None if guide_name == "self" else models[guide_name]
    kw = OPTIONS[options]
    rows = make_rows(B, 5, seed=len(options) + mini_batch_size)
    loss_fn = CachedGISTLoss(
        model, guide, TEMPERATURE, mini_batch_size=mini_batch_size, path=path, tile_size=3, **kw
    )
    assert loss_fn.must_retokenize == (guide_name == "other")
    ours, g_ours = cached_step(model, loss_fn, collate(model, rows))
    ref, g_ref = reference_step(model, guide, rows, **kw)
    assert float(ref) > 0.1, "vacuous: the guide removed every negative"
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, g_ref)
    with torch.no_grad():  # evaluation: the same loss, no graph
        torch.testing.assert_close(loss_fn(collate(model, rows)), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("guide_name", ["guide", "self"])
def test_none_padded_columns_equal_the_lists(models, guide_name):
    model = models["model"]
    guide = None if guide_name == "self" else models[guide_name]
    rows = make_rows(B, 4, seed=9)
    loss_fn = CachedGISTLoss(model, guide, TEMPERATURE, mini_batch_size=3, margin=0.03)
    listed = cached_step(model, loss_fn, collate(model, rows))
    padded = cached_step(model, loss_fn, collate(model, as_columns(rows, 4)))
    ref, g_ref = reference_step(model, guide, rows, margin=0.03)
    for loss, grads in (listed, padded):
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
        assert_grads_close(grads, g_ref)


def test_one_negative_per_row_as_lists_is_bit_identical_to_a_column(models):
    model, guide = models["model"], models["guide"]
    rows = make_rows(B, 1, seed=2)
    rows["negative"] = [neg or ["w1 w2"] for neg in rows["negative"]]
    loss_fn = CachedGISTLoss(model, guide, TEMPERATURE, mini_batch_size=3, margin=0.03)
    listed = cached_step(model, loss_fn, collate(model, rows))
    column = {**rows, "negative": [neg[0] for neg in rows["negative"]]}
    plain = cached_step(model, loss_fn, collate(model, column))
    assert torch.equal(listed[0], plain[0])
    assert torch.equal(listed[1], plain[1])


def test_every_list_empty_is_the_pairs_loss(models):
    model, guide = models["model"], models["guide"]
    rows = make_rows(B, 0, seed=5)
    features = collate(model, rows)
    assert features[2]["input_ids"].shape[0] == 0
    loss_fn = CachedGISTLoss(model, guide, TEMPERATURE, mini_batch_size=3)
    listed = cached_step(model, loss_fn, features)
    pairs = cached_step(model, loss_fn, features[:2])
    assert torch.equal(listed[0], pairs[0])
    assert torch.equal(listed[1], pairs[1])


@pytest.mark.filterwarnings("ignore:.*caching is off")
def test_the_guide_embeds_only_the_existing_texts(models):
    model, guide = models["model"], models["guide"]
    rows = make_rows(B, 3, seed=11)
    seen: list[int] = []
    handle = guide[0].register_forward_hook(lambda m, args, out: seen.append(args[0]["input_ids"].shape[0]))
    try:
        CachedGISTLoss(model, guide, TEMPERATURE, mini_batch_size=64)(collate(model, rows)).backward()
    finally:
        handle.remove()
    assert sum(seen) == 2 * B + sum(len(neg) for neg in rows["negative"])


DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 2.0]


@pytest.mark.parametrize("guide_name", ["guide", "self"])
def test_lists_inside_matryoshka_equal_the_reference(models, guide_name):
    """Every width guided by the full-width guide embeddings (the guide model's, or the model's own, as
    ``GISTEmbedLoss`` with a frozen copy of the model guides every width)."""
    model = models["model"]
    guide = None if guide_name == "self" else models[guide_name]
    rows = make_rows(B, 5, seed=13)
    inner = CachedGISTLoss(model, guide, TEMPERATURE, mini_batch_size=3, margin=0.03)
    loss = MatryoshkaLoss(model, inner, DIMS, matryoshka_weights=WEIGHTS)
    ours, g_ours = cached_step(model, lambda f: loss(f, None), collate(model, rows))
    model.zero_grad(set_to_none=True)
    a, p, n = embed_rows(model, rows)
    if guide is None:
        guided = (a.detach(), p.detach(), [x.detach() for x in n])
    else:
        with torch.no_grad():
            guided = embed_rows(guide, rows)
    ref = sum(
        w * reference_listed_gist(a[:, :d], p[:, :d], [x[:, :d] for x in n], guided, margin=0.03)
        for d, w in zip(DIMS, WEIGHTS)
    )
    assert isinstance(ref, Tensor)
    ref.backward()
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, flat_grads(model))


@pytest.mark.parametrize("guide_name", ["guide", "self"])
def test_one_stock_trainer_step_equals_the_reference_gradient(tmp_path, models, guide_name):
    """One step of the stock trainer (SGD, no clipping, one batch of every row, ``ListDataCollator``) moves
    the parameters by ``lr`` times the float64 reference's gradient."""
    local = make_tiny_model(tmp_path / "bert", dropout=0.0)
    guide = None if guide_name == "self" else models["guide"]
    rows = make_rows(8, 4, seed=21)
    _, g_ref = reference_step(local, guide, rows, margin=0.03)
    before = flat_params(local)
    lr = 1e-2
    args = make_args(
        tmp_path / "out", per_device_train_batch_size=8, max_steps=1, learning_rate=lr, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0,
        batch_sampler="batch_sampler", dataloader_drop_last=False,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(
        model=local,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        loss=CachedGISTLoss(local, guide, TEMPERATURE, mini_batch_size=3, margin=0.03),
        data_collator=ListDataCollator(preprocess_fn=local.preprocess),
    )
    trainer.train()
    assert_grads_close((before - flat_params(local)) / lr, g_ref, rtol=1e-4)


def test_several_positives_are_refused_with_what_to_do(models):
    model = models["model"]
    rows = make_rows(B, 2, seed=1, max_positives=2)
    with pytest.raises(ValueError, match="CachedGISTLoss takes one positive per row") as info:
        CachedGISTLoss(model, models["guide"])(collate(model, rows))
    assert "false_negative_filter" in str(info.value)


def test_lists_without_in_batch_negatives_are_refused(models):
    model = models["model"]
    rows = make_rows(B, 2, seed=1)
    with pytest.raises(ValueError, match="in_batch_negatives=False cannot take lists"):
        CachedGISTLoss(model, None, in_batch_negatives=False)(collate(model, rows))


def test_lists_in_the_anchor_column_are_refused(models):
    model = models["model"]
    rows = make_rows(B, 2, seed=4)
    swapped = {"anchor": [[a, a] for a in rows["anchor"]], "positive": rows["positive"]}
    with pytest.raises(ValueError, match="anchors \\(column 0\\) must hold one text per row"):
        CachedGISTLoss(model, None)(collate(model, swapped))
