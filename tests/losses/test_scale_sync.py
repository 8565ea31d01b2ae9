"""A learnable scale belongs to the loss, outside DDP / FSDP2: its gradient must still be averaged over
the processes, or every process trains its own temperature. W = 2 and 3 processes with
unequal batches, 3 optimizer steps, with and without ``gather_across_devices``: every process holds the
same scale after every step, and that scale is the one a single process reaches on the same objective
(the mean of the processes' losses without gathering; the global batch's loss with it)."""

from __future__ import annotations

import pytest
import torch

from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_model, random_texts

STEPS = 3
LR = 0.5  # large enough that a wrong scale gradient shows after one step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("scale_model")
    model = make_tiny_model(base / "bert")
    path = base / "st"
    model.save(str(path))
    return str(path)


def _load(path: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP must see every parameter used
    return model


def _batches(sizes: list[int]) -> list[list[list[str]]]:
    """Per step, the global batch's two text columns (distinct per step)."""
    return [[random_texts(sum(sizes), seed=100 * step + k) for k in range(2)] for step in range(STEPS)]


def _local(texts: list[list[str]], sizes: list[int], rank: int) -> list[list[str]]:
    start = sum(sizes[:rank])
    return [t[start : start + sizes[rank]] for t in texts]


def _make_loss(model, cls_name: str, gather: bool):
    import st_cached_losses

    return getattr(st_cached_losses, cls_name)(
        model, scale=10.0, learnable_scale=True, mini_batch_size=1, gather_across_devices=gather
    )


#: (wrapper, loss class, gather_across_devices); all run in one group of processes per world size
CASES = [
    (wrapper, cls_name, gather)
    for wrapper, cls_name in [
        ("ddp", "CachedCLIPLoss"),
        ("ddp", "CachedTiledLoss"),
        ("fsdp2", "CachedCLIPLoss"),
    ]
    for gather in (False, True)
]


def _run_case(rank: int, path: str, sizes: list[int], wrapper: str, cls_name: str, gather: bool) -> dict:
    torch.manual_seed(0)
    model = _load(path)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    loss = _make_loss(model, cls_name, gather)
    loss.model = wrapped  # what sentence-transformers' trainer does with a wrapped model
    model.eval()  # no dropout: the single-process check below replays the same arithmetic
    opt = torch.optim.SGD(
        [{"params": model.parameters(), "lr": 0.0}, {"params": [loss.logit_scale], "lr": LR}]
    )
    scales, grads = [], []
    for texts in _batches(sizes):
        opt.zero_grad(set_to_none=True)
        feats = [model.preprocess(t) for t in _local(texts, sizes, rank)]
        loss(feats, None).backward()
        grads.append(float(loss.logit_scale.grad))
        opt.step()
        scales.append(loss.scale)
    return {"scales": scales, "grads": grads}


def _worker(rank: int, world: int, path: str, sizes: list[int]) -> dict:
    return {case: _run_case(rank, path, sizes, *case) for case in CASES}


def _single_process(path: str, sizes: list[int], cls_name: str, gather: bool) -> list[float]:
    """The same 3 steps on one process: the global batch's loss when gathered, else the mean of the
    processes' own losses (what DDP's gradient average optimises)."""
    model = _load(path)
    model.eval()
    loss = _make_loss(model, cls_name, False)
    opt = torch.optim.SGD([loss.logit_scale], lr=LR)
    scales = []
    for texts in _batches(sizes):
        opt.zero_grad(set_to_none=True)
        if gather:
            loss([model.preprocess(t) for t in texts], None).backward()
        else:
            for rank in range(len(sizes)):
                value = loss([model.preprocess(t) for t in _local(texts, sizes, rank)], None)
                (value / len(sizes)).backward()
        opt.step()
        scales.append(loss.scale)
    return scales


@pytest.mark.parametrize("sizes", [[3, 1], [2, 4, 3]], ids=["w2", "w3"])
def test_learnable_scale_same_on_every_process(model_dir, sizes):
    per_rank = run_distributed(_worker, len(sizes), model_dir, sizes)
    for case in CASES:
        _, cls_name, gather = case
        expected = _single_process(model_dir, sizes, cls_name, gather)
        for step in range(STEPS):
            values = [r[case]["scales"][step] for r in per_rank]
            assert len(set(values)) == 1, f"{case} step {step}: the processes' scales differ: {values}"
            assert values[0] == pytest.approx(expected[step], rel=1e-5), f"{case} step {step}"
        # not vacuous: the scale moved, by gradients the processes agreed on
        assert abs(expected[-1] - 10.0) > 1e-3, case
        assert all(len({r[case]["grads"][s] for r in per_rank}) == 1 for s in range(STEPS)), case
