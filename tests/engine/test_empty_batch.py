"""A batch with no rows: a ``ValueError`` naming the column and the batch, in training and in
evaluation, on one process; across processes (DDP, 2 gloo processes, with and without
``gather_across_devices``) one process at 0 rows stops every process within seconds through the
library's raise-on-every-process path, not through a peer's timeout, and the next step runs."""

from __future__ import annotations

import pytest
import torch

import st_cached_losses
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_model, random_texts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("empty_model")
    make_tiny_model(base / "bert").save(str(base / "st"))
    return str(base / "st")


def _load(path: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None
    return model


def _empty_features(model, n_cols: int) -> list[dict]:
    feats = [model.preprocess(random_texts(2, seed=k)) for k in range(n_cols)]
    return [{k: v[:0] if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in feats]


@pytest.mark.parametrize("cls_name", ["CachedMNRLoss", "CachedCLIPLoss", "CachedTiledLoss"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_empty_batch_is_a_clear_error(model_dir, cls_name, mode):
    model = _load(model_dir)
    loss = getattr(st_cached_losses, cls_name)(model, mini_batch_size=2)
    feats = _empty_features(model, 3)
    with pytest.raises(ValueError, match=r"empty batch: column 0 \(the anchors\) of this batch has 0 rows"):
        if mode == "train":
            loss(feats, None).backward()
        else:
            with torch.no_grad():
                loss(feats, None)


def _worker(rank: int, world: int, path: str, gather: bool) -> dict:
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _load(path)
    ddp = DDP(model)
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=gather)
    loss.model = ddp
    full = [model.preprocess(random_texts(3, seed=10 * rank + k)) for k in range(2)]
    feats = _empty_features(model, 2) if rank == 1 else full
    out = {}
    for mode in ("train", "eval"):
        start = time.perf_counter()
        try:
            if mode == "train":
                loss(feats, None).backward()
            else:
                with torch.no_grad():
                    loss(feats, None)
            out[mode] = ("no error", "")
        except (ValueError, RuntimeError) as exc:
            out[mode] = (type(exc).__name__, str(exc))
        out[f"{mode}_seconds"] = time.perf_counter() - start
    # nobody was left inside a collective: a normal step runs on every process
    ddp.zero_grad(set_to_none=True)
    value = loss(full, None)
    value.backward()
    out["clean_loss"] = value.item()
    return out


@pytest.mark.parametrize("gather", [False, True], ids=["local", "gathered"])
def test_empty_batch_on_one_process_stops_every_process(model_dir, gather):
    per_rank = run_distributed(_worker, 2, model_dir, gather, timeout=120)
    for mode in ("train", "eval"):
        kind, msg = per_rank[1][mode]
        assert kind == "ValueError" and "empty batch" in msg, (mode, kind, msg)
        kind, msg = per_rank[0][mode]
        assert kind == "RuntimeError", (mode, kind, msg)
        assert "rank 1 of 2" in msg and "empty batch" in msg, (mode, msg)
        for r in per_rank:
            assert r[f"{mode}_seconds"] < 30, (mode, r[f"{mode}_seconds"])
    assert all(torch.isfinite(torch.tensor(r["clean_loss"])) for r in per_rank)
