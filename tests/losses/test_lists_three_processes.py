"""Lists of hard negatives (0-4 per row), and several positives (1-3 per row), across 3 gloo processes (spawned
from pytest) with unequal batches (2, 4 and 3 rows), ``gather_across_devices=True``, one training step under DDP:
the mean of the processes' losses and the DDP-averaged parameter gradients equal the one-process float64
reference on the global batch, one direction and symmetric, gathered and on the ring (``path="tiled"``), with
``mask_duplicates`` (list entries repeating another row's positive), at a mini-batch that divides no process's
batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.losses.test_lists import collate, make_rows, reference_step
from tests.losses.test_lists_distributed import with_duplicates
from tests.losses.test_losses import assert_grads_close
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import load_for_ddp, make_tiny_model

SIZES = [2, 4, 3]
#: name -> (class name, kwargs, symmetric, max positives per row)
CONFIGS = {
    "mnr": ("CachedMNRLoss", {}, False, 0),
    "clip": ("CachedCLIPLoss", {}, True, 0),
    # the ring: every process's lists pass every other process at their own lengths
    "tiled_ring_symmetric": ("CachedTiledLoss", {"tile_size": 2, "symmetric": True}, True, 0),
    # several positives (1 to 3) per row on every process
    "clip_several": ("CachedCLIPLoss", {}, True, 3),
    "mnr_several_dot": ("CachedMNRLoss", {"similarity_fct": "dot", "scale": 1.0}, False, 3),
    # several positives on the ring, symmetric: one ring per count of positives (and per positive backwards)
    "tiled_several_symmetric": ("CachedTiledLoss", {"tile_size": 2, "symmetric": True}, True, 3),
    # duplicates in the lists, gathered and on the ring (several positives on the ring too)
    "clip_mask_duplicates": ("CachedCLIPLoss", {"mask_duplicates": True}, True, 0),
    "mnr_ring_several_mask_duplicates": (
        "CachedMNRLoss",
        {"path": "tiled", "tile_size": 3, "mask_duplicates": True},
        False,
        3,
    ),
}


def global_rows(max_positives: int = 0, duplicates: bool = False) -> tuple[dict[str, list], list]:
    """The global batch and, with ``duplicates``, the reference's masked triples (``with_duplicates``)."""
    rows = make_rows(sum(SIZES), 4, seed=53, max_positives=max_positives)
    rows["negative"][
        SIZES[0]
    ] = []  # the second process's first row has none, its last (the global last) four
    return with_duplicates(rows) if duplicates else (rows, [])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("lists_three_model")
    make_tiny_model(base / "bert", dropout=0.0).save(str(base / "st"))
    return str(base / "st")


def _worker(rank: int, world: int, path: str) -> dict:
    import st_cached_losses

    assert torch.distributed.get_world_size() == world == len(SIZES)
    start = sum(SIZES[:rank])
    results = {}
    for name, (cls_name, kwargs, _, max_positives) in CONFIGS.items():
        model = load_for_ddp(path)
        loss = getattr(st_cached_losses, cls_name)(
            model, mini_batch_size=3, gather_across_devices=True, **kwargs
        )
        loss.model = DDP(model)
        rows, _ = global_rows(max_positives, bool(kwargs.get("mask_duplicates")))
        mine = {k: v[start : start + SIZES[rank]] for k, v in rows.items()}
        model.zero_grad(set_to_none=True)
        value = loss(collate(model, mine), None)
        value.backward()
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )
        results[name] = {"loss": value.item(), "grads": grads}
    return results


def test_lists_across_three_processes_equal_the_global_reference(model_dir):
    per_rank = run_distributed(_worker, len(SIZES), model_dir)
    model = load_for_ddp(model_dir)
    for name, (_, kwargs, symmetric, max_positives) in CONFIGS.items():
        options = {"similarity": "dot", "scale": 1.0} if "similarity_fct" in kwargs else {}
        rows, masked = global_rows(max_positives, bool(kwargs.get("mask_duplicates")))
        ref, g_ref = reference_step(model, rows, symmetric=symmetric, masked_negatives=masked, **options)
        losses = [r[name]["loss"] for r in per_rank]
        torch.testing.assert_close(
            torch.tensor(sum(losses) / len(losses), dtype=torch.float64), ref, rtol=1e-5, atol=1e-6
        )
        for other in per_rank[1:]:
            torch.testing.assert_close(per_rank[0][name]["grads"], other[name]["grads"])  # DDP's average
        assert_grads_close(per_rank[0][name]["grads"], g_ref)
