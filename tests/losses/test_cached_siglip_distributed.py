"""CachedSigLIPLoss across 2 and 3 gloo processes with unequal batches under DDP, gathered and on a ring, with
a learned scale and bias: every process's encoder gradient, and the scale's and bias's, equal those of one
process on the global batch against the dense reference (and the mean of the processes' losses its loss);
without gathering, each process's own rows, the scale's and bias's gradients averaged as DDP averages the
model's."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_sigmoid
from tests.support.tiny_model import make_tiny_model, random_texts

SCALE, BIAS = 10.0, -10.0
#: name -> (loss keywords, text columns)
CASES = {
    "gathered": ({"gather_across_devices": True, "path": "chunked"}, 3),
    "ring": ({"gather_across_devices": True, "path": "tiled", "tile_size": 2}, 2),
    "local": ({"gather_across_devices": False}, 2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("siglip_dist")
    model = make_tiny_model(base / "bert")
    path = base / "st"
    model.save(str(path))
    return str(path)


def load_model(path: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP must see every parameter used
    model.eval()
    return model


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def global_texts(n_rows: int, n_cols: int) -> list[list[str]]:
    return [random_texts(n_rows, seed=7 + 31 * k) for k in range(n_cols)]


def _worker(rank: int, world: int, path: str, sizes: list[int]) -> dict:
    import torch.distributed as dist

    from st_cached_losses import CachedSigLIPLoss

    assert dist.get_world_size() == world == len(sizes)
    results = {}
    for name, (kwargs, n_cols) in CASES.items():
        model = load_model(path)
        ddp = DDP(model)
        loss = CachedSigLIPLoss(model, SCALE, BIAS, True, 2, **kwargs)
        loss.model = ddp  # what sentence-transformers' trainer does with a wrapped model
        texts = global_texts(sum(sizes), n_cols)
        start = sum(sizes[:rank])
        feats = [model.preprocess(t[start : start + sizes[rank]]) for t in texts]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = loss(feats, None)
            value.backward()
        results[name] = {
            "loss": value.item(),
            "grads": flat_grads(model),
            "logit_scale": float(loss.logit_scale.grad),
            "logit_bias": float(loss.logit_bias.grad),
        }
    return results


def _reference(path: str, texts: list[list[str]]) -> dict:
    model = load_model(path)
    log_scale = torch.tensor(math.log(SCALE), requires_grad=True)
    bias = torch.tensor(BIAS, requires_grad=True)
    embs = [model(dict(model.preprocess(t)))["sentence_embedding"] for t in texts]
    value = reference_sigmoid(embs[0], embs[1:], scale=log_scale.exp(), bias=bias)
    value.backward()
    return {
        "loss": value.item(),
        "grads": flat_grads(model),
        "logit_scale": float(log_scale.grad),
        "logit_bias": float(bias.grad),
    }


def _local_reference(path: str, texts: list[list[str]], sizes: list[int]) -> dict:
    """What DDP's average optimises without gathering: the mean of the processes' own losses."""
    parts = []
    for rank in range(len(sizes)):
        start = sum(sizes[:rank])
        parts.append(_reference(path, [t[start : start + sizes[rank]] for t in texts]))
    return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}


@pytest.mark.parametrize("sizes", [[3, 1], [2, 5, 3]], ids=["w2", "w3"])
def test_every_gradient_equals_one_process_on_the_global_batch(model_dir, sizes):
    per_rank = run_distributed(_worker, len(sizes), model_dir, sizes)
    for name, (_, n_cols) in CASES.items():
        texts = global_texts(sum(sizes), n_cols)
        ref = _local_reference(model_dir, texts, sizes) if name == "local" else _reference(model_dir, texts)
        assert ref["grads"].abs().max() > 0 and ref["logit_scale"] != 0 and ref["logit_bias"] != 0
        results = [r[name] for r in per_rank]
        mean_loss = sum(r["loss"] for r in results) / len(results)
        assert mean_loss == pytest.approx(ref["loss"], rel=1e-5), name
        tol = 1e-5 * ref["grads"].abs().max().item()
        for rank, r in enumerate(results):
            err = (r["grads"] - ref["grads"]).abs().max().item()
            assert err <= tol, f"{name} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
            for param in ("logit_scale", "logit_bias"):
                assert r[param] == pytest.approx(ref[param], rel=1e-4, abs=1e-7), (name, rank, param)
        # the loss's own parameters step alike on every process
        assert len({r["logit_scale"] for r in results}) == 1 and len({r["logit_bias"] for r in results}) == 1
