"""Lists of hard negatives with CachedSigLIPLoss (issue 60): a ``negative`` column of lists (0-5 texts per row,
empty allowed) and ``negative_1 ... negative_K`` columns with None, collated by ListDataCollator. Every listed
negative is a negative pair of every anchor: the loss and every parameter gradient equal a float64 dense
reference of the pairwise sigmoid loss over every row's candidates flattened, chunked and tiled, fixed and
learned scale and bias, at mini-batches that do not divide the batch; one negative per row as lists is the
loss of a column bit for bit; several positives are refused by name. Across 2 and 3 gloo processes with unequal
batches, gathered and on the ring, the processes' mean loss and the DDP-averaged gradients equal the reference of
the global batch."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import CachedSigLIPLoss
from tests.losses.test_lists import B, as_columns, collate, embed, make_rows
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def reference(model, rows, scale: float, bias: float) -> torch.Tensor:
    """The pairwise sigmoid loss in float64: every anchor against every positive and every listed negative,
    its own positive the one positive pair; the sum over pairs over the anchors."""
    anchors = embed(model, rows["anchor"]).double()
    candidates = embed(model, [*rows["positive"], *(t for neg in rows["negative"] for t in neg)]).double()
    a = torch.nn.functional.normalize(anchors, dim=-1)
    c = torch.nn.functional.normalize(candidates, dim=-1)
    logits = scale * a @ c.T + bias
    labels = -torch.ones_like(logits)
    labels[torch.arange(len(a)), torch.arange(len(a))] = 1.0
    return -torch.nn.functional.logsigmoid(labels * logits).sum() / len(a)


@pytest.mark.filterwarnings("ignore:.*caching is off")
@pytest.mark.parametrize("layout", ["list", "none_padded"])
@pytest.mark.parametrize(("path", "mini_batch_size"), [("chunked", 3), ("tiled", 4), ("auto", 64)])
@pytest.mark.parametrize("learnable", [False, True])
def test_lists_of_negatives_equal_the_reference(model, layout, path, mini_batch_size, learnable):
    rows = make_rows(B, 5, seed=mini_batch_size + learnable)
    loss_fn = CachedSigLIPLoss(
        model, 7.0, -2.0, learnable, mini_batch_size, path=path, tile_size=3 if path == "tiled" else None
    )
    if learnable:  # moved off the initial values, so that their gradients are checked away from the start
        with torch.no_grad():
            loss_fn.logit_scale.fill_(1.5)
            loss_fn.logit_bias.fill_(-1.0)
    scale, bias = loss_fn.scale, loss_fn.bias
    model.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    value = loss_fn(collate(model, rows if layout == "list" else as_columns(rows, 5)), None)
    value.backward()
    ours, g_ours = value.detach(), flat_grads(model).clone()
    learned = [p.grad.clone() for p in (loss_fn.logit_scale, loss_fn.logit_bias)] if learnable else []
    model.zero_grad(set_to_none=True)
    if learnable:
        log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
        ref = reference(model, rows, log_scale.exp(), b)
    else:
        ref = reference(model, rows, scale, bias)
    ref.backward()
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(g_ours, flat_grads(model))
    if learnable:
        torch.testing.assert_close(learned[0].double(), log_scale.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(learned[1].double(), b.grad, rtol=1e-4, atol=1e-6)


def test_one_negative_per_row_as_lists_is_bit_identical_to_a_column(model):
    rows = make_rows(B, 1, seed=3)
    rows["negative"] = [n if n else ["an extra text"] for n in rows["negative"]]
    loss_fn = CachedSigLIPLoss(model, mini_batch_size=3)
    fixed = {
        "anchor": rows["anchor"],
        "positive": rows["positive"],
        "negative": [n[0] for n in rows["negative"]],
    }
    with torch.no_grad():
        as_lists = loss_fn(collate(model, rows), None)
        as_column = loss_fn(collate(model, fixed), None)
    assert torch.equal(as_lists, as_column)


def test_several_positives_are_refused(model):
    rows = make_rows(B, 2, seed=5, max_positives=2)
    with pytest.raises(ValueError, match="CachedSigLIPLoss takes one positive per row"):
        CachedSigLIPLoss(model, mini_batch_size=3)(collate(model, rows), None)


#: per-process batches of the runs across processes (unequal)
SPLITS = {2: [3, 5], 3: [2, 4, 3]}
#: name -> (kwargs, which rows: "list", "first_empty" (the first process's lists all empty: its list column
#: is not embedded there) or "mixed" (one negative or none per row; the last process's column has no None, a
#: fixed column there))
ACROSS = {
    "gathered": ({"path": "chunked"}, "first_empty"),
    "ring": ({"path": "tiled", "tile_size": 2}, "list"),
    "ring_first_empty_learned": ({"path": "tiled", "tile_size": 3, "learnable": True}, "first_empty"),
    "gathered_mixed": ({}, "mixed"),
}


def across_rows(sizes: list[int], layout: str) -> dict[str, list]:
    rows = make_rows(sum(sizes), 4, seed=41 + len(sizes))
    if layout == "first_empty":
        rows["negative"][: sizes[0]] = [[] for _ in range(sizes[0])]
    if layout == "mixed":
        rows["negative"] = [n[:1] for n in rows["negative"]]
        rows["negative"][-sizes[-1] :] = [n or ["a text"] for n in rows["negative"][-sizes[-1] :]]
    return rows


def _across_worker(rank: int, world: int, path: str) -> dict:
    """One training step under DDP per configuration, gathered or on the ring, with this process's rows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.support.tiny_model import load_for_ddp

    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    results = {}
    for name, (kwargs, layout) in ACROSS.items():
        model = load_for_ddp(path)
        loss = CachedSigLIPLoss(model, 7.0, -2.0, mini_batch_size=2, gather_across_devices=True, **kwargs)
        loss.model = DDP(model)
        mine = {k: v[start : start + sizes[rank]] for k, v in across_rows(sizes, layout).items()}
        if layout == "mixed":
            mine = as_columns(mine, 1)
        model.zero_grad(set_to_none=True)
        value = loss(collate(model, mine), None)
        value.backward()
        results[name] = {
            "loss": value.item(),
            "grads": flat_grads(model).clone(),
            "learned": [p.grad.item() for p in loss.parameters() if p.numel() == 1 and p.grad is not None],
        }
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_lists_across_processes_equal_the_reference(tmp_path, world):
    """Gathered (``path="chunked"``) and on the ring (``path="tiled"``) across 2 and 3 gloo processes with unequal
    batches: the mean of the processes' losses, the DDP-averaged parameter gradients and a learned scale's and
    bias's gradients (averaged over processes) equal the float64 reference of the global batch."""
    from tests.support.dist_utils import run_distributed
    from tests.support.tiny_model import load_for_ddp

    make_tiny_model(tmp_path / "bert", dropout=0.0).save(str(tmp_path / "st"))
    per_rank = run_distributed(_across_worker, world, str(tmp_path / "st"))
    model = load_for_ddp(str(tmp_path / "st"))
    for name, (kwargs, layout) in ACROSS.items():
        log_scale = torch.tensor(7.0, dtype=torch.float64).log().requires_grad_()
        bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
        model.zero_grad(set_to_none=True)
        ref = reference(model, across_rows(SPLITS[world], layout), log_scale.exp(), bias)
        ref.backward()
        losses = [r[name]["loss"] for r in per_rank]
        torch.testing.assert_close(
            torch.tensor(sum(losses) / world, dtype=torch.float64), ref.detach(), rtol=1e-5, atol=1e-6
        )
        for r in per_rank:
            assert_grads_close(r[name]["grads"], flat_grads(model))
            if kwargs.get("learnable"):
                expected = torch.stack([log_scale.grad, bias.grad])
                torch.testing.assert_close(
                    torch.tensor(r[name]["learned"], dtype=torch.float64), expected, rtol=1e-4, atol=1e-6
                )
            else:
                assert r[name]["learned"] == []
