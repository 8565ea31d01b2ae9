"""The false-negative filter (issue 60, item 3) and a learned temperature that stays finite (item 4).

``false_negative_filter`` ("relative": NV-Retriever's TopK-PercPos, "absolute": Qwen3-Embedding) on CachedMNRLoss,
CachedCLIPLoss and CachedTiledLoss equals a float64 reference written here (``reference_filtered``: every row's
candidates flattened, the mask decided from the reference's own similarities), loss and every parameter gradient:
one direction and symmetric, the chunked and the tiled paths (several tiles), a fixed hard-negative column, lists of
0-5 negatives, 1-3 positives per row, the negative bank, each row's own candidates only, inside MatryoshkaLoss, and
across two gloo processes (gathered, and the ring). Each comparison also asserts that the filter removed
something and that the loss without the mask differs, so that it fails if the mask is removed; the fraction the
loss reports equals the reference's count. Off (the default) is bit-identical to the loss without the settings;
a learnable scale keeps loss and gradients finite with empty lists, ``None``-padded columns and rows whose every
negative is removed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
from torch.nn.parallel import DistributedDataParallel as DDP

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss, LossStateCallback
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.training_args import CachedLossTrainingArguments
from tests.losses.test_lists import as_columns, collate, embed, make_rows
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import load_for_ddp, make_tiny_model

B = 7
#: margins that remove some negatives of the tiny random model (its cosines are ~0.8-0.97), not all
MARGINS = {"relative": 0.95, "absolute": 0.02}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def threshold(positive: torch.Tensor, strategy: str, margin: float) -> torch.Tensor:
    """The filter's rule as its documentation states it: relative ``margin * p`` (``p - |p| (1 - margin)``
    below 0), absolute ``p + margin``."""
    if strategy == "relative":
        return torch.where(positive >= 0, margin * positive, positive - positive.abs() * (1 - margin))
    return positive + margin


def reference_filtered(
    anchors, positives, negatives, *, strategy=None, margin=0.0, scale=20.0, symmetric=False,
    bank_candidates=None, bank_anchors=None, own_only=False,
):  # fmt: skip
    """InfoNCE in float64, one (anchor, positive) pair at a time, cosine similarity: ``positives[i]`` ``(m_i, d)``
    and ``negatives[i]`` ``(n_i, d)`` row ``i``'s. Each positive ``p`` of row ``i`` against itself, every other row's
    positives, every row's negatives and the bank's candidates (``own_only``: itself and row ``i``'s negatives);
    symmetric, ``p`` also against every anchor and the bank's anchors, its target ``q_i``. With ``strategy``, every
    entry but the target whose similarity exceeds ``threshold(sim(q_i, p))`` is removed (decided without
    gradient). Returns the loss, the entries removed, the negatives seen and the softmaxes left with their target
    alone."""
    norm = lambda x: F.normalize(x.double(), dim=-1)  # noqa: E731
    q, pos, negs = norm(anchors), [norm(p) for p in positives], [norm(n) for n in negatives]
    all_neg = torch.cat(negs)
    bank_c = norm(bank_candidates) if bank_candidates is not None else q[:0]
    bank_q = norm(bank_anchors) if bank_anchors is not None else q[:0]
    removed = seen = emptied = 0
    total = q.new_zeros(())

    def softmax_loss(sims, target):
        nonlocal removed, seen, emptied
        logits = scale * sims
        if strategy is not None:
            mask = sims.detach() > threshold(sims[target].detach(), strategy, margin)
            mask[target] = False
            removed += int(mask.sum())
            emptied += int(mask.sum()) == len(sims) - 1
            logits = logits.masked_fill(mask, -torch.inf)
        seen += len(sims) - 1
        return torch.logsumexp(logits, 0) - logits[target]

    for i in range(len(q)):
        fwd = back = q.new_zeros(())
        for p in pos[i]:
            if own_only:
                cands = torch.cat([p[None], negs[i]])
            else:
                others = [x for j, x in enumerate(pos) if j != i]
                cands = torch.cat([p[None], *others, all_neg, bank_c])
            fwd = fwd + softmax_loss(cands @ q[i], 0)
            if symmetric:
                back = back + softmax_loss(torch.cat([q, bank_q]) @ p, i)
        m = len(pos[i])
        total = total + (fwd / m + back / m) / (2 if symmetric else 1)
    return total / len(q), removed, seen, emptied


def rows_of(kind: str, seed: int) -> tuple[dict, dict]:
    """Rows (the reference's layout: lists) and the columns handed to the collator."""
    if kind == "column":  # one hard negative per row: a fixed column
        rows = make_rows(B, 1, seed=seed)
        rows["negative"] = [n or [f"w{i} w{i + 1} w3"] for i, n in enumerate(rows["negative"])]
        return rows, as_columns(rows, 1)
    if kind == "none_padded":
        rows = make_rows(B, 5, seed=seed)
        return rows, as_columns(rows, 5)
    if kind == "positives":
        rows = make_rows(B, 5, seed=seed, max_positives=3)
        return rows, rows
    rows = make_rows(B, 5, seed=seed)
    return rows, rows


def embedded(model, rows, dim=None):
    """The reference's embeddings of ``rows`` (truncated to ``dim``)."""
    cut = (lambda x: x[:, :dim]) if dim else (lambda x: x)
    pos_lists = [p if isinstance(p, list) else [p] for p in rows["positive"]]
    positives = cut(embed(model, [t for p in pos_lists for t in p])).split([len(p) for p in pos_lists])
    negatives = cut(embed(model, [t for n in rows["negative"] for t in n])).split(
        [len(n) for n in rows["negative"]]
    )
    return cut(embed(model, rows["anchor"])), list(positives), list(negatives)


def ours_and_reference(model, loss_fn, rows, columns, symmetric, strategy, margin, **ref):
    model.zero_grad(set_to_none=True)
    value = loss_fn(collate(model, columns))
    value.backward()
    ours = value.detach().double(), flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    a, p, n = embedded(model, rows)
    loss, removed, seen, _ = reference_filtered(
        a, p, n, strategy=strategy, margin=margin, symmetric=symmetric, **ref
    )
    loss.backward()
    with torch.no_grad():
        unmasked, *_ = reference_filtered(a, p, n, symmetric=symmetric, **ref)
    return ours, (loss.detach(), flat_grads(model).clone()), (removed, seen), unmasked


def assert_filtered_equal(ours, ref, counts, unmasked, fraction):
    removed, seen = counts
    assert 0 < removed < seen, "the case must have negatives removed and kept"
    assert abs(float(ref[0]) - float(unmasked)) > 1e-3, "the mask must change the loss"
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(ours[1], ref[1])
    assert fraction == pytest.approx(removed / seen)


LOSSES = {
    "mnr_chunked": (CachedMNRLoss, {"path": "chunked", "tile_size": 2}, False),
    "mnr_tiled": (CachedMNRLoss, {"path": "tiled", "tile_size": 3}, False),
    "clip": (CachedCLIPLoss, {}, True),
    "clip_tiled": (CachedCLIPLoss, {"path": "tiled", "tile_size": 2}, True),
    "tiled": (CachedTiledLoss, {"tile_size": 3}, False),
    "tiled_symmetric": (CachedTiledLoss, {"tile_size": 4, "symmetric": True}, True),
}


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("kind", ["column", "lists"])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("strategy", list(MARGINS))
def test_filter_equals_the_reference(model, strategy, name, kind):
    cls, kw, symmetric = LOSSES[name]
    rows, columns = rows_of(kind, seed=len(name))
    loss_fn = cls(
        model,
        mini_batch_size=3,
        false_negative_filter=strategy,
        false_negative_margin=MARGINS[strategy],
        **kw,
    )
    ours, ref, counts, unmasked = ours_and_reference(
        model, loss_fn, rows, columns, symmetric, strategy, MARGINS[strategy]
    )
    assert_filtered_equal(ours, ref, counts, unmasked, loss_fn.false_negative_fraction)


@pytest.mark.parametrize("name", ["mnr_chunked", "clip", "tiled_symmetric"])
@pytest.mark.parametrize("strategy", list(MARGINS))
def test_several_positives_compare_to_their_own_positive(model, strategy, name):
    cls, kw, symmetric = LOSSES[name]
    rows, columns = rows_of("positives", seed=4)
    loss_fn = cls(
        model,
        mini_batch_size=4,
        false_negative_filter=strategy,
        false_negative_margin=MARGINS[strategy],
        **kw,
    )
    ours, ref, counts, unmasked = ours_and_reference(
        model, loss_fn, rows, columns, symmetric, strategy, MARGINS[strategy]
    )
    assert_filtered_equal(ours, ref, counts, unmasked, loss_fn.false_negative_fraction)


def test_each_rows_own_candidates_only(model):
    rows, _ = rows_of("column", seed=2)
    rows["negative"] = [[*n, f"{n[0]} w9", f"w8 {n[0]}"] for n in rows["negative"]]
    loss_fn = CachedMNRLoss(
        model,
        mini_batch_size=3,
        in_batch_negatives=False,
        false_negative_filter="relative",
        false_negative_margin=0.99,
    )
    ours, ref, counts, unmasked = ours_and_reference(
        model, loss_fn, rows, as_columns(rows, 3), False, "relative", 0.99, own_only=True
    )
    assert_filtered_equal(ours, ref, counts, unmasked, loss_fn.false_negative_fraction)


@pytest.mark.parametrize(
    ("cls", "kw", "symmetric"),
    [(CachedMNRLoss, {}, False), (CachedTiledLoss, {"tile_size": 3, "symmetric": True}, True)],
    ids=["mnr", "tiled_symmetric"],
)
def test_the_negative_bank_is_filtered(model, cls, kw, symmetric):
    """Two steps fill the bank (no optimizer step: its entries are the model's); the third scores them, filtered."""
    loss_fn = cls(model, mini_batch_size=3, negative_bank_size=9, false_negative_filter="relative", **kw)
    steps = [rows_of("column", seed=s) for s in (11, 12, 13)]
    for _, columns in steps[:2]:
        loss_fn(collate(model, columns)).backward()
    with torch.no_grad():
        past = [embedded(model, rows) for rows, _ in steps[:2]]
    bank_c = torch.cat([torch.stack([p[0], n[0]]) for _, ps, ns in past for p, n in zip(ps, ns)])[-9:]
    bank_q = torch.cat([a for a, _, _ in past])[-9:]
    bank = {"bank_candidates": bank_c, "bank_anchors": bank_q if symmetric else None}
    rows, columns = steps[2]
    ours, ref, counts, unmasked = ours_and_reference(
        model, loss_fn, rows, columns, symmetric, "relative", 0.95, **bank
    )
    assert_filtered_equal(ours, ref, counts, unmasked, loss_fn.false_negative_fraction)


def test_inside_matryoshka_each_truncation_judges_itself(model):
    dims = [32, 12]
    inner = CachedCLIPLoss(
        model, mini_batch_size=3, false_negative_filter="absolute", false_negative_margin=0.02
    )
    loss_fn = MatryoshkaLoss(model, inner, dims)
    rows, columns = rows_of("lists", seed=6)
    model.zero_grad(set_to_none=True)
    ours = loss_fn(collate(model, columns), None)
    ours.backward()
    g_ours = flat_grads(model).clone()
    model.zero_grad(set_to_none=True)
    parts = [
        reference_filtered(*embedded(model, rows, d), strategy="absolute", margin=0.02, symmetric=True)
        for d in dims
    ]
    sum(p[0] for p in parts).backward()
    assert all(p[1] > 0 for p in parts)
    torch.testing.assert_close(
        ours.detach().double(), sum(p[0] for p in parts).detach(), rtol=1e-5, atol=1e-6
    )
    assert_grads_close(g_ours, flat_grads(model))
    # every truncation's removals are counted in the step
    assert inner.false_negative_fraction == pytest.approx(sum(p[1] for p in parts) / sum(p[2] for p in parts))


@pytest.mark.parametrize("kind", ["lists", "none_padded", "positives"])
@pytest.mark.parametrize("margin", [0.95, 1e-3], ids=["some", "every"])
def test_a_learnable_scale_stays_finite(tmp_path, kind, margin):
    """Empty lists, None-padded columns, several positives; with margin 1e-3 nearly every softmax loses every
    negative; the loss, the model's and the scale's gradients stay finite and equal the reference. A model of
    its own: with margin 1e-3 whether a candidate stays depends on the weights, which the module's shared
    model holds as the tests before left them: a subset of the file, or another order, emptied every softmax)."""
    model = make_tiny_model(tmp_path / "bert", dropout=0.0)
    rows, columns = rows_of(kind, seed=9)
    loss_fn = CachedCLIPLoss(
        model,
        mini_batch_size=3,
        scale=12.0,
        learnable_scale=True,
        false_negative_filter="relative",
        false_negative_margin=margin,
    )
    model.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    value = loss_fn(collate(model, columns))
    value.backward()
    g_model = flat_grads(model).clone()
    g_scale = loss_fn.logit_scale.grad
    assert torch.isfinite(value) and torch.isfinite(g_model).all()
    assert g_scale is not None and torch.isfinite(g_scale).all()
    logit_scale = torch.tensor(12.0, dtype=torch.float64).log().requires_grad_()
    model.zero_grad(set_to_none=True)
    ref, removed, seen, emptied = reference_filtered(
        *embedded(model, rows), strategy="relative", margin=margin, scale=logit_scale.exp(), symmetric=True
    )
    ref.backward()
    torch.testing.assert_close(value.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert removed > 0 and loss_fn.false_negative_fraction == pytest.approx(removed / seen)
    if margin == 1e-3:  # most softmaxes hold their target alone (a candidate of cosine <= 0 may stay)
        assert emptied >= B, emptied
    if margin == 1e-3:  # emptied softmaxes: their gradients are 0, or small differences of fp32 probabilities
        torch.testing.assert_close(g_model.double(), flat_grads(model).double(), rtol=1e-4, atol=1e-7)
    else:
        assert_grads_close(g_model, flat_grads(model), rtol=1e-5)
    torch.testing.assert_close(g_scale.double(), logit_scale.grad, rtol=1e-5, atol=1e-7)
    # a step of the scale from there stays finite too
    torch.optim.SGD(loss_fn.parameters(), lr=0.1).step()
    assert torch.isfinite(loss_fn.logit_scale).all()


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (CachedMNRLoss, {"path": "chunked"}),
        (CachedMNRLoss, {"path": "tiled", "tile_size": 3}),
        (CachedTiledLoss, {"tile_size": 3}),
        (CachedCLIPLoss, {}),
    ],
    ids=["mnr_chunked", "mnr_tiled", "tiled", "clip"],
)
def test_off_is_bit_identical(model, cls, kw):
    """The default is the loss without the settings, bit for bit (and its config names neither); a filter that
    removes nothing changes no bit of the one-direction losses either (the symmetric loss then shares no tile
    between its directions, which may round otherwise)."""
    _, columns = rows_of("lists", seed=3)
    features = collate(model, columns)

    def step(loss_fn):
        model.zero_grad(set_to_none=True)
        value = loss_fn(features)
        value.backward()
        return value.detach(), flat_grads(model).clone()

    plain = cls(model, mini_batch_size=3, **kw)
    off = cls(model, mini_batch_size=3, false_negative_filter=None, false_negative_margin=None, **kw)
    a, b = step(plain), step(off)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert plain.get_config_dict() == off.get_config_dict()
    assert "false_negative_filter" not in off.get_config_dict() and off.false_negative_fraction is None
    if cls is not CachedCLIPLoss:
        keeps = cls(
            model, mini_batch_size=3, false_negative_filter="absolute", false_negative_margin=1e6, **kw
        )
        c = step(keeps)
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
        assert keeps.false_negative_fraction == 0.0


def test_mask_duplicates_masks_a_candidate_equal_to_the_rows_positive(model):
    """Text-equal candidates are mask_duplicates's: a negative whose text is its row's positive is removed."""
    rows, _ = rows_of("column", seed=5)
    rows["negative"][2] = [rows["positive"][2]]
    loss_fn = CachedMNRLoss(model, mini_batch_size=3, mask_duplicates=True)
    model.zero_grad(set_to_none=True)
    ours = loss_fn(collate(model, as_columns(rows, 1)))
    with torch.no_grad():
        a, p, n = embedded(model, rows)
        q = F.normalize(a.double(), dim=-1)
        cands = F.normalize(torch.cat([*p, *n]).double(), dim=-1)  # positives, then one negative per row
        logits = 20.0 * q @ cands.T
        kept = (torch.logsumexp(logits, 1) - logits.diagonal()).mean()
        logits[2, B + 2] = -torch.inf  # row 2's own negative is its positive: no negative of row 2 (only)
        ref = (torch.logsumexp(logits, 1) - logits.diagonal()).mean()
    torch.testing.assert_close(ours.detach().double(), ref, rtol=1e-5, atol=1e-6)
    assert abs(float(kept) - float(ref)) > 1e-3


def test_settings_config_arguments_and_callback(model, tmp_path):
    loss = CachedMNRLoss(model, mini_batch_size=3, false_negative_filter="absolute")
    config = loss.get_config_dict()
    assert config["false_negative_filter"] == "absolute" and "false_negative_margin" not in config
    loss.false_negative_margin = 0.05
    rebuilt = CachedMNRLoss(model, **loss.get_config_dict())
    assert rebuilt.get_config_dict() == loss.get_config_dict()
    assert rebuilt.false_negative_margin == 0.05
    assert "false_negative_filter" in loss.settings.beyond_sentence_transformers()
    for bad, named in [
        ({"false_negative_filter": "relativ"}, "false_negative_filter"),
        ({"false_negative_filter": "relative", "false_negative_margin": 1.5}, "false_negative_margin"),
        ({"false_negative_filter": "absolute", "false_negative_margin": -0.1}, "false_negative_margin"),
        ({"false_negative_margin": 0.9}, "false_negative_filter"),
    ]:
        with pytest.raises(ValueError, match=named):
            CachedMNRLoss(model, **bad)
    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path), loss="clip", false_negative_filter="relative", false_negative_margin=0.9
    )
    built = build_loss(model, args)
    assert (built.false_negative_filter, built.false_negative_margin) == ("relative", 0.9)
    # the callback logs the latest training step's fraction
    callback = LossStateCallback(built)
    _, columns = rows_of("lists", seed=1)
    built(collate(model, columns)).backward()
    logs = {"loss": 1.0}
    callback.on_log(args, type("State", (), {"log_history": []})(), None, logs)
    assert logs["false_negative_fraction"] == built.false_negative_fraction > 0
    with torch.no_grad():  # evaluation neither counts nor resets
        built(collate(model, columns))
    assert built.false_negative_fraction == logs["false_negative_fraction"]


# ------------------------------------------------------------------ across two processes

SIZES = [3, 4]
#: name -> (class name, kwargs, layout, symmetric)
DIST_CONFIGS = {
    "mnr_gathered_lists": ("CachedMNRLoss", {}, "lists", False),
    "clip_ring": ("CachedTiledLoss", {"symmetric": True, "tile_size": 2}, "column", True),
}


def dist_rows(layout: str) -> tuple[dict, dict]:
    rows = make_rows(sum(SIZES), 4 if layout == "lists" else 1, seed=21)
    if layout == "column":
        rows["negative"] = [n or [f"w{i} w2"] for i, n in enumerate(rows["negative"])]
    return rows, layout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("fn_dist_model")
    make_tiny_model(base / "bert", dropout=0.0).save(str(base / "st"))
    return str(base / "st")


def _worker(rank: int, world: int, path: str) -> dict:
    import st_cached_losses

    assert torch.distributed.get_world_size() == world
    start = sum(SIZES[:rank])
    results = {}
    for name, (cls_name, kwargs, layout, _) in DIST_CONFIGS.items():
        rows, _ = dist_rows(layout)
        model = load_for_ddp(path)
        loss = getattr(st_cached_losses, cls_name)(
            model, mini_batch_size=2, gather_across_devices=True, false_negative_filter="relative", **kwargs
        )
        loss.model = DDP(model)
        mine = {k: v[start : start + SIZES[rank]] for k, v in rows.items()}
        columns = mine if layout == "lists" else as_columns(mine, 1)
        model.zero_grad(set_to_none=True)
        value = loss(collate(model, columns), None)
        value.backward()
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )
        results[name] = {"loss": value.item(), "grads": grads}
    return results


@pytest.mark.distributed
def test_across_two_processes_gathered_and_ring_equal_the_global_reference(model_dir):
    per_rank = run_distributed(_worker, len(SIZES), model_dir)
    model = load_for_ddp(model_dir)
    for name, (_, _, layout, symmetric) in DIST_CONFIGS.items():
        rows, _ = dist_rows(layout)
        model.zero_grad(set_to_none=True)
        a, p, n = embedded(model, rows)
        ref, removed, seen, _ = reference_filtered(
            a, p, n, strategy="relative", margin=0.95, symmetric=symmetric
        )
        ref.backward()
        assert 0 < removed < seen
        losses = [r[name]["loss"] for r in per_rank]
        torch.testing.assert_close(
            torch.tensor(sum(losses) / len(losses), dtype=torch.float64), ref.detach(), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(per_rank[0][name]["grads"], per_rank[1][name]["grads"])  # DDP's average
        assert_grads_close(per_rank[0][name]["grads"], flat_grads(model))
