"""CachedSparseLoss with lists across 2 gloo processes (spawned from pytest) and unequal per-process batches (3 and
5 rows), under DDP: gathered (``gather_across_devices`` on the base loss), the first process's lists all empty (its
list column not embedded there), with the packed (compact) cache and the dense one, and a ``None``-padded layout;
the mean of the processes' components and the DDP-averaged parameter gradients equal the one-process float64
reference of the global batch (the documents' FLOPS over every process's existing documents together). Without
gathering, several positives per row: the mean of each process's own reference, as sentence-transformers under
DDP. Several positives gathered and on the ring (the dense cache), and lists on the ring of processes
(``path="tiled"``), equal the reference too; several positives gathered with the packed cache are refused on every process."""

from __future__ import annotations

import pytest
import torch

from tests.losses.test_lists import as_columns, collate, make_rows
from tests.losses.test_losses import assert_grads_close
from tests.losses.test_sparse_lists import WEIGHTS, assert_parts_close, reference_step
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_splade

SIZES = [3, 5]
#: name -> (model, layout, gather, several positives, the loss's plan)
CONFIGS = {
    "gathered_packed": ("packed", "list", True, False, {}),
    "gathered_dense_none_padded": ("dense", "none_padded", True, False, {}),
    "local_several_positives": ("packed", "list", False, True, {}),
    "gathered_several_positives_dense": ("dense", "list", True, True, {}),
    "ring_several_positives_dense": ("dense", "list", True, True, {"path": "tiled", "tile_size": 3}),
    "ring_packed": ("packed", "list", True, False, {"path": "tiled", "tile_size": 3}),
    "ring_dense_none_padded": ("dense", "none_padded", True, False, {"path": "tiled", "tile_size": 3}),
}


def global_rows(several: bool = False) -> dict[str, list]:
    rows = make_rows(sum(SIZES), 4, seed=31, max_positives=3 if several else 0)
    for i in range(SIZES[0]):  # the first process's lists are all empty
        rows["negative"][i] = []
    rows["negative"][-2] = rows["negative"][-1][:2]
    return rows


def share(rows: dict[str, list], rank: int) -> dict[str, list]:
    start = sum(SIZES[:rank])
    return {k: v[start : start + SIZES[rank]] for k, v in rows.items()}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("sparse_lists_dist")
    made = {"packed": make_tiny_splade(base / "packed", bias=-1.0), "dense": make_tiny_splade(base / "dense")}
    for name, model in made.items():
        model.save(str(base / f"st_{name}"))
    return {name: str(base / f"st_{name}") for name in made}


def _loss(model, gather: bool, **kw):
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

    from st_cached_losses import CachedSparseLoss

    base = SparseMultipleNegativesRankingLoss(model, gather_across_devices=gather)
    return CachedSparseLoss(model, base, **WEIGHTS, mini_batch_size=2, **kw)


def _worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert torch.distributed.get_world_size() == world
    results = {}
    for name, (kind, layout, gather, several, plan) in CONFIGS.items():
        model = SparseEncoder(paths[kind], device="cpu")
        loss = _loss(model, gather, **plan)
        loss.model = DDP(model)  # what the trainer does
        mine = share(global_rows(several), rank)
        columns = mine if layout == "list" else as_columns(mine, 4)
        features = collate(model, columns)
        model.zero_grad(set_to_none=True)
        parts = loss(features, None)
        torch.stack(list(parts.values())).sum().backward()
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )
        results[name] = {
            "parts": {k: v.detach().double() for k, v in parts.items()},
            "grads": grads,
            "compact": loss.cache.form.compact,
            "embedded": sum(len(f["input_ids"]) for f in features[2:]),
        }
    return results


def test_lists_across_two_processes_equal_the_reference(paths):
    from sentence_transformers.sparse_encoder import SparseEncoder

    per_rank = run_distributed(_worker, len(SIZES), paths, timeout=240)
    for name, (kind, _, gather, several, _plan) in CONFIGS.items():
        model = SparseEncoder(paths[kind], device="cpu")
        rows = global_rows(several)
        if gather:
            ref, g_ref = reference_step(model, rows)
        else:  # each process's own loss; DDP averages the gradients
            steps = [reference_step(model, share(rows, r)) for r in range(len(SIZES))]
            ref = {k: sum(s[0][k] for s in steps) / len(steps) for k in steps[0][0]}
            g_ref = sum(s[1] for s in steps) / len(steps)
        results = [r[name] for r in per_rank]
        assert results[0]["embedded"] == 0  # the first process had no negative to embed
        assert all(r["compact"] == (kind == "packed") for r in results)
        mean = {k: sum(r["parts"][k] for r in results) / len(results) for k in ref}
        assert_parts_close(mean, ref)
        torch.testing.assert_close(results[0]["grads"], results[1]["grads"])  # DDP's average
        assert_grads_close(results[0]["grads"], g_ref)


def _refusing_worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    """Several positives gathered with the packed cache (the first process's rows one positive each, the
    second's several) are refused on every process, the setting named."""
    from sentence_transformers.sparse_encoder import SparseEncoder

    model = SparseEncoder(paths["packed"], device="cpu")
    rows = global_rows(several=True)
    rows["positive"][: SIZES[0]] = [p[:1] for p in rows["positive"][: SIZES[0]]]
    loss = _loss(model, True)
    try:
        loss(collate(model, share(rows, rank)), None)
    except ValueError as exc:
        return {"message": str(exc), "compact": loss.cache.form.compact}
    return {"message": "", "compact": loss.cache.form.compact}


def test_several_positives_gathered_packed_are_refused_on_every_process(paths):
    per_rank = run_distributed(_refusing_worker, len(SIZES), paths, timeout=240)
    for result in per_rank:
        assert result["compact"]
        assert "gather_across_devices=True" in result["message"] and "compact" in result["message"]
