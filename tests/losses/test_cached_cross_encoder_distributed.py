"""CachedCrossEncoderLoss across 2 and 3 gloo processes (spawned from pytest) with unequal rows: each
process draws its in-batch negatives from its own batch (as sentence-transformers' loss), and DDP's
averaged parameter gradients equal one process's gradient of the mean loss over every process's queries on
the very same pairs; one gradient all-reduce per step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_cross_encoder, random_texts

STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dist_cross_encoder") / "ce"
    make_tiny_cross_encoder(path)
    return str(path)


def load(path: str):
    from sentence_transformers.cross_encoder import CrossEncoder

    model = CrossEncoder(path, device="cpu", max_length=64)
    model.train()
    return model


def global_columns(n_rows: int, n_cols: int, step: int) -> list[list[str]]:
    return [
        random_texts(n_rows, seed=100 * step + 7 * k, max_words=4 if k == 0 else 25) for k in range(n_cols)
    ]


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def _worker(rank: int, world: int, path: str, sizes: list[int], n_cols: int, num_negatives: int | None):
    import torch.distributed as dist

    from st_cached_losses import CachedCrossEncoderLoss

    assert dist.get_world_size() == world == len(sizes)
    model = load(path)
    ddp = DDP(model)
    hooks = [0]

    def counting_hook(state, bucket, hooks=hooks):
        hooks[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    loss_fn = CachedCrossEncoderLoss(model, num_negatives, mini_batch_size=3)
    loss_fn.model = ddp  # as sentence-transformers' trainer does with a wrapped model
    out = []
    for step in range(STEPS):
        start = sum(sizes[:rank])
        local = [c[start : start + sizes[rank]] for c in global_columns(sum(sizes), n_cols, step)]
        ddp.zero_grad(set_to_none=True)
        hooks[0] = 0
        # each process its own draws (the reference reads the pairs they gave)
        torch.manual_seed(1000 * step + rank)
        pairs = loss_fn.pairs(local)
        torch.manual_seed(1000 * step + rank)
        value = loss_fn(local, None)
        value.backward()
        out.append({"loss": value.item(), "grads": flat_grads(model), "pairs": pairs, "hooks": hooks[0]})
    return out


def reference(path: str, per_rank_pairs: list[list[tuple[str, str]]], sizes: list[int], num_negatives):
    """One process, every process's pairs: the mean over all queries of their loss (sentence-transformers'
    own ``calculate_loss`` per process's block of pairs, weighted by its queries)."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    model = load(path)
    theirs = MultipleNegativesRankingLoss(model, num_negatives)
    total = torch.zeros(())
    for pairs, b in zip(per_rank_pairs, sizes):
        scores = theirs.call_model_with_pairs(pairs)
        total = total + theirs.calculate_loss([scores], b) * b
    loss = total / sum(sizes)
    loss.backward()
    return loss.item(), flat_grads(model)


@pytest.mark.parametrize(
    ("sizes", "n_cols", "num_negatives"),
    [([3, 1], 2, 4), ([2, 5, 3], 3, None), ([4, 2, 3], 2, 2)],
    ids=["w2-pairs", "w3-hard-all", "w3-pairs-2"],
)
def test_processes_equal_one_process_on_the_same_pairs(model_dir, sizes, n_cols, num_negatives):
    per_rank = run_distributed(_worker, len(sizes), model_dir, sizes, n_cols, num_negatives)
    for step in range(STEPS):
        results = [r[step] for r in per_rank]
        ref_loss, ref_grads = reference(model_dir, [r["pairs"] for r in results], sizes, num_negatives)
        assert ref_grads.abs().max() > 0
        # each process returns its share: their mean is the global mean
        assert sum(r["loss"] for r in results) / len(results) == pytest.approx(ref_loss, rel=1e-5)
        tol = 2e-5 * ref_grads.abs().max().item()
        for rank, r in enumerate(results):
            err = (r["grads"] - ref_grads).abs().max().item()
            assert err <= tol, f"step {step} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
            assert r["hooks"] == 1, "DDP must all-reduce exactly once per step"


def _activation_worker(rank: int, world: int, path: str, sizes: list[int]):
    import torch.distributed as dist

    from st_cached_losses import CachedCrossEncoderLoss

    assert dist.get_world_size() == world == len(sizes)
    model = load(path)
    ddp = DDP(model)
    activation = torch.nn.PReLU(init=0.3)
    loss_fn = CachedCrossEncoderLoss(model, 2, 10.0, activation, mini_batch_size=2)
    loss_fn.model = ddp
    start = sum(sizes[:rank])
    local = [c[start : start + sizes[rank]] for c in global_columns(sum(sizes), 2, 5)]
    torch.manual_seed(rank)
    pairs = loss_fn.pairs(local)
    torch.manual_seed(rank)
    loss_fn(local, None).backward()
    return {"pairs": pairs, "grads": flat_grads(model), "activation": activation.weight.grad.clone()}


def test_a_learnable_activation_is_stepped_by_the_global_batchs_gradient(model_dir):
    """Issue 50: a learnable ``activation_fn`` belongs to the loss, not to the DDP-wrapped model, so nothing
    averaged its gradient: with 3 and 5 rows, the PReLU weight's gradient was each process's own (0.0725 and
    2.3165 where the global batch's is 1.1945). Now every process holds the global batch's gradient, as for
    the model's parameters."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    sizes = [3, 5]
    per_rank = run_distributed(_activation_worker, 2, model_dir, sizes)
    model = load(model_dir)
    activation = torch.nn.PReLU(init=0.3)
    theirs = MultipleNegativesRankingLoss(model, 2, 10.0, activation)
    total = torch.zeros(())
    for r, b in zip(per_rank, sizes):
        total = total + theirs.calculate_loss([theirs.call_model_with_pairs(r["pairs"])], b) * b
    (total / sum(sizes)).backward()
    ref, ref_grads = activation.weight.grad, flat_grads(model)
    assert ref.abs().max() > 0
    for r in per_rank:
        torch.testing.assert_close(r["activation"], ref, rtol=2e-5, atol=0)
        torch.testing.assert_close(r["grads"], ref_grads, rtol=0, atol=2e-5 * ref_grads.abs().max().item())
    # not vacuous: each process's own rows alone give another gradient than the global batch's
    for r in per_rank:
        own = torch.nn.PReLU(init=0.3)
        alone = MultipleNegativesRankingLoss(model, 2, 10.0, own)
        alone.calculate_loss([alone.call_model_with_pairs(r["pairs"])], len(r["pairs"]) // 3).backward()
        assert (own.weight.grad - ref).abs().item() > 0.05 * ref.abs().item()
