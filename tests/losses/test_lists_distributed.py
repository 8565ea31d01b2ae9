"""Lists of hard negatives across 2 gloo processes (spawned from pytest) with ``gather_across_devices=True`` and
unequal per-process batches (3 and 5 rows): one training step under DDP, each process's lists gathered at their
own lengths (one process's lists all empty, so its list column is not embedded there; a ``None``-padded layout
too). The mean of the processes' losses and the DDP-averaged parameter gradients equal the one-process float64
reference on the global batch (``reference_listed_infonce``): several positives gathered and on the ring
(``path="tiled"``), and ``mask_duplicates`` with lists (list entries that repeat another row's positive, on another
process and on the same one: the keys travel with each list column at its own lengths), gathered and on the
ring."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.losses.test_lists import as_columns, collate, make_rows, reference_step
from tests.losses.test_losses import assert_grads_close
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import load_for_ddp, make_tiny_model

SIZES = [3, 5]
#: name -> (class name, kwargs, layout, symmetric)
CONFIGS = {
    "mnr": ("CachedMNRLoss", {}, "list", False),
    "clip_none_padded": ("CachedCLIPLoss", {}, "none_padded", True),
    # the first process's negative_1 has no None (a fixed column there), the second's has: every process
    # learns in the step's first collective that one has lists, and all score them as lists
    "mixed": ("CachedMNRLoss", {}, "mixed", False),
    # the ring (path="tiled"): each process's lists travel at their own lengths (the first process's empty)
    "tiled_ring": ("CachedTiledLoss", {"tile_size": 2}, "list", False),
    "tiled_ring_symmetric_none_padded": (
        "CachedTiledLoss",
        {"tile_size": 3, "symmetric": True},
        "none_padded",
        True,
    ),
    "mnr_ring_mixed": ("CachedMNRLoss", {"path": "tiled", "tile_size": 2}, "mixed", False),
    # several positives per row: the first process's rows one each (its positive column a fixed one), the
    # second's one to three; each process's positives are candidates of every anchor, and target their anchor
    "mnr_several": ("CachedMNRLoss", {}, "several", False),
    "clip_several": ("CachedCLIPLoss", {}, "several", True),
    # a learned scale: its gradient (outside DDP) averaged over the processes, the reference's
    "clip_several_learnable": ("CachedCLIPLoss", {"scale": 12.0, "learnable_scale": True}, "several", True),
    # several positives on the ring: each process's sorted positives, lists and keys travel, one ring per count
    "tiled_several": ("CachedTiledLoss", {"tile_size": 2}, "several", False),
    "clip_ring_several_learnable": (
        "CachedCLIPLoss",
        {"path": "tiled", "tile_size": 3, "scale": 12.0, "learnable_scale": True},
        "several",
        True,
    ),
    # duplicates in the lists (with_duplicates): masked out of that positive's softmax, gathered and on the ring
    "mnr_mask_duplicates": ("CachedMNRLoss", {"mask_duplicates": True}, "list", False),
    "clip_mask_duplicates_none_padded": ("CachedCLIPLoss", {"mask_duplicates": True}, "none_padded", True),
    "tiled_ring_mask_duplicates": (
        "CachedTiledLoss",
        {"tile_size": 2, "mask_duplicates": True},
        "list",
        False,
    ),
    "mnr_several_mask_duplicates": ("CachedMNRLoss", {"mask_duplicates": True}, "several", False),
    "mnr_ring_several_mask_duplicates": (
        "CachedMNRLoss",
        {"path": "tiled", "tile_size": 2, "mask_duplicates": True},
        "several",
        False,
    ),
}


def with_duplicates(rows: dict[str, list]) -> tuple[dict[str, list], list[tuple[int, int, int]]]:
    """``rows`` with two list entries that repeat another row's positive: the first row's (the first process's)
    appended to the last row's list, the last row's last positive to the row before's (both on the last
    process); and the reference's masked ``(row, positive, flat negative)`` triples (``mask_duplicates`` takes
    each out of that positive's softmax, and out of no other's)."""
    rows = {k: list(v) for k, v in rows.items()}
    b = len(rows["anchor"])
    as_list = [p if isinstance(p, list) else [p] for p in rows["positive"]]
    last = len(as_list[-1]) - 1
    rows["negative"][-1] = [*rows["negative"][-1], as_list[0][0]]
    rows["negative"][-2] = [*rows["negative"][-2], as_list[-1][last]]
    flat = [sum(len(n) for n in rows["negative"][: r + 1]) - 1 for r in range(b)]  # each row's last entry
    return rows, [(0, 0, flat[-1]), (b - 1, last, flat[-2])]


def global_rows(layout: str = "list") -> dict[str, list]:
    if layout == "several":
        rows = make_rows(sum(SIZES), 4, seed=37, max_positives=3)
        rows["positive"][: SIZES[0]] = [p[:1] for p in rows["positive"][: SIZES[0]]]
        rows["negative"][: SIZES[0]] = [[] for _ in range(SIZES[0])]
        return rows
    rows = make_rows(sum(SIZES), 4, seed=31)
    for i in range(SIZES[0]):  # the first process's lists are all empty
        rows["negative"][i] = [] if layout != "mixed" else rows["negative"][-1][:1]
    rows["negative"][-2] = rows["negative"][-1][:2]
    if layout == "mixed":  # one negative or none per row
        rows["negative"] = [n[:1] for n in rows["negative"]]
    return rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("lists_dist_model")
    model = make_tiny_model(base / "bert", dropout=0.0)
    model.save(str(base / "st"))
    return str(base / "st")


load_model = load_for_ddp


def _worker(rank: int, world: int, path: str) -> dict:
    import st_cached_losses

    assert torch.distributed.get_world_size() == world
    start = sum(SIZES[:rank])
    results = {}
    for name, (cls_name, kwargs, layout, _) in CONFIGS.items():
        rows = global_rows(layout)
        if kwargs.get("mask_duplicates"):
            rows, _ = with_duplicates(rows)
        model = load_model(path)
        ddp = DDP(model)
        loss = getattr(st_cached_losses, cls_name)(
            model, mini_batch_size=2, gather_across_devices=True, **kwargs
        )
        loss.model = ddp
        mine = {k: v[start : start + SIZES[rank]] for k, v in rows.items()}
        widest = max(len(n) for n in rows["negative"])  # every process's columns alike
        columns = mine if layout in ("list", "several") else as_columns(mine, widest)
        model.zero_grad(set_to_none=True)
        value = loss(collate(model, columns), None)
        value.backward()
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )
        results[name] = {
            "loss": value.item(),
            "grads": grads,
            "scale_grad": [p.grad.item() for p in loss.parameters() if p.grad is not None and p.numel() == 1],
            "embedded": len(collate(model, columns)[2]["input_ids"]),
        }
    return results


def test_lists_across_two_processes_equal_the_global_reference(model_dir):
    per_rank = run_distributed(_worker, len(SIZES), model_dir)
    model = load_model(model_dir)
    for name, (_, kwargs, layout, symmetric) in CONFIGS.items():
        logit_scale = torch.tensor(kwargs.get("scale", 20.0), dtype=torch.float64).log().requires_grad_()
        rows, masked = global_rows(layout), []
        if kwargs.get("mask_duplicates"):
            rows, masked = with_duplicates(rows)
        ref, g_ref = reference_step(
            model, rows, symmetric=symmetric, scale=logit_scale.exp(), masked_negatives=masked
        )
        losses = [r[name]["loss"] for r in per_rank]
        # the first process had no negative to embed (mixed: one per row, a fixed column)
        assert per_rank[0][name]["embedded"] == (SIZES[0] if layout == "mixed" else 0)
        torch.testing.assert_close(
            torch.tensor(sum(losses) / len(losses), dtype=torch.float64), ref, rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(per_rank[0][name]["grads"], per_rank[1][name]["grads"])  # DDP's average
        assert_grads_close(per_rank[0][name]["grads"], g_ref)
        if kwargs.get("learnable_scale"):
            assert logit_scale.grad is not None and logit_scale.grad.abs() > 0
            for r in per_rank:
                (ours,) = r[name]["scale_grad"]
                torch.testing.assert_close(
                    torch.tensor(ours, dtype=torch.float64), logit_scale.grad, rtol=1e-5, atol=1e-7
                )
        else:
            assert all(r[name]["scale_grad"] == [] for r in per_rank)


def _refusing_worker(rank: int, world: int, path: str) -> dict:
    """What is not kept for several positives is refused on every process, with the option named (several positives: the first process's rows have one positive each, the
    second's several, so the first learns of them in the step's first collective)."""
    import st_cached_losses

    assert torch.distributed.get_world_size() == world
    model = load_model(path)
    start = sum(SIZES[:rank])
    several = make_rows(sum(SIZES), 2, seed=5, max_positives=2)
    several["positive"][: SIZES[0]] = [p[:1] for p in several["positive"][: SIZES[0]]]
    several["positive"][-1] = several["positive"][-1] + ["w1 w2"]
    cases = {
        "several_positives_bank": ("CachedMNRLoss", several, {"negative_bank_size": 4}),
    }
    messages = {}
    for name, (cls_name, batch, kwargs) in cases.items():
        loss = getattr(st_cached_losses, cls_name)(
            model, mini_batch_size=2, gather_across_devices=True, **kwargs
        )
        mine = {k: v[start : start + SIZES[rank]] for k, v in batch.items()}
        try:
            loss(collate(model, mine), None)
            messages[name] = ""
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def test_what_is_not_kept_for_several_positives_is_refused_on_every_process(model_dir):
    per_rank = run_distributed(_refusing_worker, len(SIZES), model_dir)
    for messages in per_rank:
        assert "negative_bank_size=4 cannot take several positives" in messages["several_positives_bank"]
