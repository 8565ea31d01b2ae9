"""CachedGISTLoss with lists of hard negatives across 2 gloo processes (spawned from pytest), gathered
(``gather_across_devices=True``), with unequal per-process batches (3 and 5 rows): the first process's lists are
all empty (its list column is not embedded there, by the model nor the guide), the other's of 0 to 4 per row; a
``None``-padded layout too. The mean of the processes' losses and the DDP-averaged parameter gradients equal the
one-process float64 reference on the global batch (``reference_listed_gist``), with a guide model, one that
re-tokenises, and self-guided. The ring (``path='tiled'``) and several positives are refused on every process."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.losses.test_gist_lists import TEMPERATURE, reference_step
from tests.losses.test_lists import as_columns, collate, make_rows
from tests.losses.test_losses import assert_grads_close
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import WORDS, load_for_ddp, make_tiny_model

SIZES = [3, 5]
#: name -> (guide: "guide", "other" or None, layout)
CONFIGS = {
    "guide": ("guide", "list"),
    "other_none_padded": ("other", "none_padded"),
    "self": (None, "list"),
}
MARGIN = 0.03


def global_rows() -> dict[str, list]:
    rows = make_rows(sum(SIZES), 4, seed=31)
    for i in range(SIZES[0]):  # the first process's lists are all empty
        rows["negative"][i] = []
    rows["negative"][-2] = rows["negative"][-1][:2]
    return rows


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("gist_lists_dist")
    made = {
        "model": make_tiny_model(base / "model", dropout=0.0, seed=0),
        "guide": make_tiny_model(base / "guide", dropout=0.0, seed=5, hidden=24),
        "other": make_tiny_model(base / "other", dropout=0.0, seed=6, words=list(reversed(WORDS))),
    }
    for name, model in made.items():
        model.save(str(base / f"st_{name}"))
    return {name: str(base / f"st_{name}") for name in made}


def _worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    from sentence_transformers import SentenceTransformer

    from st_cached_losses import CachedGISTLoss

    assert torch.distributed.get_world_size() == world
    start = sum(SIZES[:rank])
    results = {}
    for name, (guide_name, layout) in CONFIGS.items():
        model = load_for_ddp(paths["model"])
        guide = SentenceTransformer(paths[guide_name], device="cpu") if guide_name else None
        loss = CachedGISTLoss(
            model, guide, TEMPERATURE, mini_batch_size=2, margin=MARGIN, gather_across_devices=True
        )
        loss.model = DDP(model)  # what the trainer does
        mine = {k: v[start : start + SIZES[rank]] for k, v in global_rows().items()}
        columns = mine if layout == "list" else as_columns(mine, 4)
        model.zero_grad(set_to_none=True)
        features = collate(model, columns)
        value = loss(features, None)
        value.backward()
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
        )
        embedded = sum(len(f["input_ids"]) for f in features[2:])
        results[name] = {"loss": value.item(), "grads": grads, "embedded": embedded}
    return results


def test_lists_across_two_processes_equal_the_global_reference(paths):
    per_rank = run_distributed(_worker, len(SIZES), paths, timeout=240)
    model = load_for_ddp(paths["model"])
    rows = global_rows()
    for name, (guide_name, _) in CONFIGS.items():
        guide = load_for_ddp(paths[guide_name]) if guide_name else None
        ref, g_ref = reference_step(model, guide, rows, margin=MARGIN, processes=SIZES)
        assert float(ref) > 0.1, "vacuous: the guide removed every negative"
        assert per_rank[0][name]["embedded"] == 0  # the first process had no negative to embed
        losses = [r[name]["loss"] for r in per_rank]
        torch.testing.assert_close(
            torch.tensor(sum(losses) / len(losses), dtype=torch.float64), ref, rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(per_rank[0][name]["grads"], per_rank[1][name]["grads"])  # DDP's average
        assert_grads_close(per_rank[0][name]["grads"], g_ref)


def _refusing_worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    """The ring with lists, and several positives (the first process's rows one positive each, the second's
    several), are refused on every process, the setting named."""
    from st_cached_losses import CachedGISTLoss

    model = load_for_ddp(paths["model"])
    start = sum(SIZES[:rank])
    several = make_rows(sum(SIZES), 2, seed=5, max_positives=2)
    several["positive"][: SIZES[0]] = [p[:1] for p in several["positive"][: SIZES[0]]]
    several["positive"][-1] = several["positive"][-1] + ["w1 w2"]
    cases = {"ring": ({"path": "tiled"}, global_rows()), "several_positives": ({}, several)}
    messages = {}
    for name, (kw, rows) in cases.items():
        loss = CachedGISTLoss(model, None, mini_batch_size=2, gather_across_devices=True, **kw)
        mine = {k: v[start : start + SIZES[rank]] for k, v in rows.items()}
        try:
            loss(collate(model, mine), None)
            messages[name] = ""
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def test_what_is_not_exchanged_is_refused_on_every_process(paths):
    per_rank = run_distributed(_refusing_worker, len(SIZES), paths, timeout=240)
    for messages in per_rank:
        assert "path='tiled'" in messages["ring"]
        assert "takes one positive per row" in messages["several_positives"]
