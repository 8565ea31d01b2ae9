"""Lists (issue 60): a ``negative`` column whose rows hold lists of texts (0 to 5 each, empty allowed),
``negative_1 ... negative_K`` columns with None where a row has fewer, and a ``positive`` column of lists (1 to 3
each), collated by ``ListDataCollator`` (sentence-transformers' collator, extended) and taken by CachedMNRLoss,
CachedCLIPLoss and CachedTiledLoss. The loss and every parameter gradient equal the float64 reference that scores
every row's candidates flattened (``reference_listed_infonce``), at mini-batches that do not divide the batch;
one step of the stock trainer equals the reference gradient; a missing negative costs no forward; one positive
per row as lists is the loss of a positive column bit for bit; a batch of fixed columns is collated as
sentence-transformers collates it; the options without a meaning for lists are refused by name."""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers.base.trainer import BaseTrainer
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.config.collator import ListDataCollator
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.losses.test_trainer import flat_params, make_args
from tests.support.reference import reference_listed_infonce
from tests.support.tiny_model import make_tiny_model, random_texts

B = 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def make_rows(b: int, max_negatives: int, seed: int, max_positives: int = 0) -> dict[str, list]:
    """Anchors, positives and lists of 0..max_negatives negatives per row (at least one row empty, one full);
    with ``max_positives``, lists of 1..max_positives positives (at least one row with one, one with the most)."""
    rng = random.Random(seed)
    counts = [rng.randint(0, max_negatives) for _ in range(b)]
    counts[0], counts[-1] = 0, max_negatives
    n_pos = [rng.randint(1, max_positives) for _ in range(b)] if max_positives else [1] * b
    if max_positives:
        n_pos[1], n_pos[-2] = 1, max_positives
    texts = random_texts(b + sum(n_pos) + sum(counts), seed=seed)
    it = iter(texts)
    anchors = [next(it) for _ in range(b)]
    positives: list = [[next(it) for _ in range(n)] for n in n_pos]
    return {
        "anchor": anchors,
        "positive": positives if max_positives else [p[0] for p in positives],
        "negative": [[next(it) for _ in range(n)] for n in counts],
    }


def as_columns(rows: dict[str, list], k: int) -> dict[str, list]:
    """The same rows as ``negative_1 ... negative_k`` columns, None where a row has fewer."""
    out = {"anchor": rows["anchor"], "positive": rows["positive"]}
    for j in range(k):
        out[f"negative_{j + 1}"] = [neg[j] if j < len(neg) else None for neg in rows["negative"]]
    return out


def collate(model, columns: dict[str, list]) -> list[dict]:
    """The features the stock trainer hands the loss, collated by ListDataCollator."""
    names = list(columns)
    rows = [{name: columns[name][i] for name in names} for i in range(len(columns[names[0]]))]
    batch = ListDataCollator(preprocess_fn=model.preprocess)(rows)
    features, _ = BaseTrainer.collect_features(None, batch)  # type: ignore[arg-type]  # self is unused
    return features


def embed(model, texts: list[str]) -> torch.Tensor:
    if not texts:
        return torch.zeros(0, model.get_embedding_dimension())
    return model(model.preprocess(texts))["sentence_embedding"]


def reference_step(model, rows: dict[str, list], **kw) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    anchors = embed(model, rows["anchor"])
    flat = [t for neg in rows["negative"] for t in neg]
    negatives = embed(model, flat).split([len(neg) for neg in rows["negative"]])
    pos_lists = [p if isinstance(p, list) else [p] for p in rows["positive"]]
    positives = embed(model, [t for p in pos_lists for t in p]).split([len(p) for p in pos_lists])
    loss = reference_listed_infonce(anchors, list(positives), list(negatives), **kw)
    loss.backward()
    return loss.detach(), flat_grads(model).clone()


def cached_step(model, loss_fn, features) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features)
    loss.backward()
    return loss.detach(), flat_grads(model).clone()


LOSSES = {
    "mnr": (CachedMNRLoss, {}, False),
    "mnr_dot": (CachedMNRLoss, {"similarity_fct": "dot", "scale": 1.0}, False),
    "clip": (CachedCLIPLoss, {}, True),
    "tiled": (CachedTiledLoss, {"tile_size": 3}, False),
    "tiled_symmetric": (CachedTiledLoss, {"tile_size": 4, "symmetric": True}, True),
    "all_negatives": (CachedMNRLoss, {"hardness_mode": "all_negatives", "hardness_strength": 3.0}, False),
}


def reference_options(kw: dict, symmetric: bool) -> dict:
    """The reference's options for a loss built with ``kw``: its direction, a dot score's scale, the
    all-negatives penalty."""
    options: dict = {"symmetric": symmetric}
    if "similarity_fct" in kw:
        options.update(similarity="dot", scale=kw["scale"])
    if "hardness_strength" in kw:
        options["all_negatives_penalty"] = kw["hardness_strength"]
    return options


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("layout", ["list", "none_padded"])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mini_batch_size", [3, 64])
def test_lists_of_negatives_equal_the_reference(model, name, layout, mini_batch_size):
    cls, kw, symmetric = LOSSES[name]
    rows = make_rows(B, 5, seed=len(name) + mini_batch_size)
    columns = rows if layout == "list" else as_columns(rows, 5)
    loss_fn = cls(model, mini_batch_size=mini_batch_size, **kw)
    features = collate(model, columns)
    ours, g_ours = cached_step(model, loss_fn, features)
    ref, g_ref = reference_step(model, rows, **reference_options(kw, symmetric))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, g_ref)


def test_chunked_and_tiled_loss_stages_agree(model):
    rows = make_rows(B, 4, seed=3)
    features = collate(model, rows)
    chunked = cached_step(
        model, CachedMNRLoss(model, mini_batch_size=2, path="chunked", tile_size=2), features
    )
    tiled = cached_step(model, CachedMNRLoss(model, mini_batch_size=2, path="tiled", tile_size=2), features)
    torch.testing.assert_close(chunked[0], tiled[0], rtol=1e-6, atol=1e-6)
    assert_grads_close(chunked[1], tiled[1])


def test_every_list_empty_is_the_pairs_loss(model):
    rows = make_rows(B, 0, seed=5)
    assert all(neg == [] for neg in rows["negative"])
    features = collate(model, rows)
    assert features[2]["input_ids"].shape[0] == 0
    loss_fn = CachedMNRLoss(model, mini_batch_size=3)
    listed = cached_step(model, loss_fn, features)
    pairs = cached_step(model, loss_fn, features[:2])
    assert torch.equal(listed[0], pairs[0])
    assert torch.equal(listed[1], pairs[1])


@pytest.mark.filterwarnings("ignore:.*caching is off")
def test_a_missing_negative_costs_no_forward(model):
    rows = make_rows(B, 3, seed=11)
    features = collate(model, rows)
    seen: list[int] = []
    handle = model[0].register_forward_hook(lambda m, args, out: seen.append(args[0]["input_ids"].shape[0]))
    try:
        CachedMNRLoss(model, mini_batch_size=64)(features).backward()
    finally:
        handle.remove()
    n_negatives = sum(len(neg) for neg in rows["negative"])
    assert sum(seen) == 2 * B + n_negatives


def test_one_negative_per_row_as_lists_is_bit_identical_to_a_column(model):
    rows = make_rows(B, 1, seed=2)
    rows["negative"] = [neg or ["w1 w2"] for neg in rows["negative"]]
    loss_fn = CachedCLIPLoss(model, mini_batch_size=3)
    listed = cached_step(model, loss_fn, collate(model, rows))
    column = {**rows, "negative": [neg[0] for neg in rows["negative"]]}
    plain = cached_step(model, loss_fn, collate(model, column))
    assert torch.equal(listed[0], plain[0])
    assert torch.equal(listed[1], plain[1])


def test_fixed_columns_are_collated_as_sentence_transformers_does(model):
    texts = {name: random_texts(5, seed=k) for k, name in enumerate(["anchor", "positive", "negative"])}
    rows = [{name: texts[name][i] for name in texts} for i in range(5)]
    ours = ListDataCollator(preprocess_fn=model.preprocess)(rows)
    theirs = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)(rows)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value


def test_stock_collator_would_read_a_two_text_list_as_a_pair(model):
    # why the collation is extended: sentence-transformers tokenises a row of two texts as one text pair
    rows = [{"anchor": "w1", "negative": ["w2", "w3"]}, {"anchor": "w4", "negative": ["w5", "w6"]}]
    theirs = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)(rows)
    assert theirs["negative_input_ids"].shape[0] == 2
    ours = ListDataCollator(preprocess_fn=model.preprocess)(rows)
    assert ours["negative_input_ids"].shape[0] == 4
    assert ours["negative_row_counts"].tolist() == [2, 2]


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"hardness_mode": "hard_negatives", "hardness_strength": 1.0}, "hardness_mode='hard_negatives'"),
        (
            {"hardness_mode": "in_batch_negatives", "hardness_strength": 1.0},
            "hardness_mode='in_batch_negatives'",
        ),
        ({"directions": ("query_to_doc", "doc_to_doc")}, "directions="),
        ({"in_batch_negatives": False}, "in_batch_negatives=False"),
    ],
)
def test_options_reading_a_rows_own_negatives_are_refused(model, kw, named):
    features = collate(model, make_rows(B, 3, seed=1))
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        CachedMNRLoss(model, **kw)(features)


def test_lists_in_the_anchor_column_and_other_losses_are_refused(model):
    rows = make_rows(B, 2, seed=4)
    swapped = {"anchor": [[a, a] for a in rows["anchor"]], "positive": rows["positive"]}
    with pytest.raises(ValueError, match="anchors \\(column 0\\) must hold one text per row"):
        CachedMNRLoss(model)(collate(model, swapped))
    from st_cached_losses import CachedMarginMSELoss

    with pytest.raises(ValueError, match="CachedMarginMSELoss takes columns of one text per row"):
        CachedMarginMSELoss(model)(collate(model, rows))


def assert_one_sgd_step_equals_the_reference(tmp_path, cls, kw, symmetric, rows):
    """One step of the stock trainer (SGD, no clipping, one batch of every row, ``ListDataCollator``) moves
    the parameters by ``lr`` times the float64 reference's gradient of ``rows``."""
    local = make_tiny_model(tmp_path / "bert", dropout=0.0)
    _, g_ref = reference_step(local, rows, symmetric=symmetric)
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
        loss=cls(local, mini_batch_size=3, **kw),
        data_collator=ListDataCollator(preprocess_fn=local.preprocess),
    )
    # one batch of every row, in the dataset's order (the loss is a mean: the order of rows does not matter)
    trainer.train()
    assert_grads_close((before - flat_params(local)) / lr, g_ref, rtol=1e-4)


@pytest.mark.parametrize("name", ["mnr", "clip"])
def test_one_stock_trainer_step_equals_the_reference_gradient(tmp_path, model, name):
    cls, kw, symmetric = LOSSES[name]
    assert_one_sgd_step_equals_the_reference(tmp_path, cls, kw, symmetric, make_rows(8, 4, seed=21))


SEVERAL = {
    "mnr": (CachedMNRLoss, {}, False),
    "mnr_dot": (CachedMNRLoss, {"similarity_fct": "dot", "scale": 1.0}, False),
    "clip": (CachedCLIPLoss, {}, True),
    "tiled_symmetric": (CachedTiledLoss, {"tile_size": 4, "symmetric": True}, True),
    "all_negatives": (CachedMNRLoss, {"hardness_mode": "all_negatives", "hardness_strength": 3.0}, False),
    "mask_duplicates": (CachedMNRLoss, {"mask_duplicates": True}, False),
}


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("name", list(SEVERAL))
@pytest.mark.parametrize("mini_batch_size", [3, 64])
@pytest.mark.parametrize("max_negatives", [0, 5])
def test_several_positives_equal_the_reference(model, name, mini_batch_size, max_negatives):
    cls, kw, symmetric = SEVERAL[name]
    rows = make_rows(B, max_negatives, seed=len(name) + mini_batch_size, max_positives=3)
    features = collate(model, rows)
    ours, g_ours = cached_step(model, cls(model, mini_batch_size=mini_batch_size, **kw), features)
    ref, g_ref = reference_step(model, rows, **reference_options(kw, symmetric))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, g_ref)
    with torch.no_grad():  # evaluation: the same loss, no graph
        torch.testing.assert_close(cls(model, mini_batch_size=mini_batch_size, **kw)(features), ours)


def test_several_positives_with_a_learnable_scale_equal_the_reference(model):
    rows = make_rows(B, 3, seed=8, max_positives=3)
    loss_fn = CachedCLIPLoss(model, mini_batch_size=3, scale=12.0, learnable_scale=True)
    model.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    loss_fn(collate(model, rows)).backward()
    ours = [p.grad.clone() for p in loss_fn.parameters() if p.grad is not None and p.numel() == 1]
    scale = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
    logit_scale = scale.log().detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    anchors = embed(model, rows["anchor"])
    positives = embed(model, [t for p in rows["positive"] for t in p]).split(
        [len(p) for p in rows["positive"]]
    )
    negatives = embed(model, [t for n in rows["negative"] for t in n]).split(
        [len(n) for n in rows["negative"]]
    )
    reference_listed_infonce(
        anchors, list(positives), list(negatives), scale=logit_scale.exp(), symmetric=True
    ).backward()
    assert len(ours) == 1 and logit_scale.grad is not None and logit_scale.grad.abs() > 0
    torch.testing.assert_close(ours[0].double(), logit_scale.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["mnr", "clip", "tiled_symmetric"])
def test_one_positive_per_row_as_lists_is_bit_identical(model, name):
    cls, kw, _ = SEVERAL[name]
    rows = make_rows(B, 4, seed=6)
    loss_fn = cls(model, mini_batch_size=3, **kw)
    plain = cached_step(model, loss_fn, collate(model, rows))
    listed = cached_step(
        model, loss_fn, collate(model, {**rows, "positive": [[p] for p in rows["positive"]]})
    )
    assert torch.equal(listed[0], plain[0])
    assert torch.equal(listed[1], plain[1])


@pytest.mark.parametrize(
    ("cls", "kw", "named"),
    [
        (CachedMNRLoss, {"directions": ("query_to_doc", "query_to_query")}, "directions="),
        (CachedMNRLoss, {"directions": ("query_to_doc", "doc_to_query")}, "partition_mode='joint'"),
        (CachedMNRLoss, {"negative_bank_size": 8}, "negative_bank_size=8"),
        (CachedCLIPLoss, {"mask_duplicates": True}, "mask_duplicates=True"),
    ],
)
def test_options_without_a_meaning_for_several_positives_are_refused(model, cls, kw, named):
    features = collate(model, make_rows(B, 2, seed=1, max_positives=2))
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        cls(model, **kw)(features)


def test_a_row_without_a_positive_is_refused(model):
    rows = make_rows(B, 2, seed=1, max_positives=2)
    rows["positive"][3] = []
    with pytest.raises(ValueError, match=r"rows \[3\] have no positive"):
        CachedMNRLoss(model)(collate(model, rows))


@pytest.mark.parametrize("name", ["mnr", "clip"])
def test_one_stock_trainer_step_with_several_positives_equals_the_reference_gradient(tmp_path, name):
    cls, kw, symmetric = SEVERAL[name]
    rows = make_rows(8, 3, seed=22, max_positives=3)
    assert_one_sgd_step_equals_the_reference(tmp_path, cls, kw, symmetric, rows)
