"""Sharded models across processes (gloo on CPU, processes spawned from pytest): FSDP2 (``fully_shard``
per encoder layer and at the root) gives parameter gradients equal to one process on the global batch,
for equal and unequal per-process batches and token budgets that cut different numbers of
mini-batches per process; one reduce-scatter per parameter group per step and none inside gradient
accumulation; the same agreed plans under DDP; a bad input on one rank fails every rank in bounded
time."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_distributed import CONFIGS, global_texts, load_model, reference_step
from tests.tiny_model import make_tiny_model

#: steps per sharded model: FSDP2's state across steps is part of what is tested
STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sharded_model")
    model = make_tiny_model(base / "bert")
    path = base / "st"
    model.save(str(path))
    return str(path)


def make_loss(name: str, model, **extra):
    import st_cached_losses

    cls_name, kwargs, _, _ = CONFIGS[name]
    options = {"mini_batch_size": 2, "gather_across_devices": True, **kwargs, **extra}
    return getattr(st_cached_losses, cls_name)(model, **options)


def shard(model):
    """FSDP2 per encoder layer and at the root: three parameter groups (two layers, the rest)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model[0].auto_model.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    return model


#: FSDP2 parameter groups of :func:`shard`'s model: one reduce-scatter each per synchronised backward
GROUPS = 3


class _Counter:
    """Counts FSDP2's collectives (it calls them through the ``torch.distributed`` module)."""

    def __init__(self) -> None:
        self.calls = {"all_gather_single": 0, "reduce_scatter_single": 0}
        self._orig = {name: getattr(dist, name) for name in self.calls}
        for name in self.calls:
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name):
        orig = self._orig[name]

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return orig(*args, **kwargs)

        return counted

    def reset(self) -> dict[str, int]:
        out = dict(self.calls)
        for name in self.calls:
            self.calls[name] = 0
        return out


def full_grads(model) -> torch.Tensor:
    """Every parameter's full gradient (an all-gather per sharded parameter, same order on every rank)."""
    parts = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            parts.append(torch.zeros(p.shape).flatten())
            continue
        parts.append((g.full_tensor() if hasattr(g, "full_tensor") else g).flatten())
    return torch.cat(parts)


def local_columns(texts: list[list[str]], sizes: list[int], rank: int) -> list[list[str]]:
    start = sum(sizes[:rank])
    return [t[start : start + sizes[rank]] for t in texts]


def _fsdp_worker(rank: int, world: int, path: str, names: list[str], sizes: list[int], extra: dict):
    from st_cached_losses.distributed import STATS

    counter = _Counter()
    results = {}
    for name in names:
        model = shard(load_model(path))
        loss = make_loss(name, model, **extra)
        per_step = []
        for step in range(STEPS):
            texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step)
            feats = [model.preprocess(t) for t in local_columns(texts, sizes, rank)]
            natural = [len(loss.cache.plan(k, f)) for k, f in enumerate(feats)]
            model.zero_grad(set_to_none=True)
            if getattr(loss, "learnable_scale", False):
                loss.logit_scale.grad = None
            # evaluation first: as in training, where evaluation follows an optimizer step
            counter.reset()
            with torch.no_grad():
                evaluated = loss(feats, None).item()
            eval_calls = counter.reset()
            STATS.reset()
            value = loss(feats, None)
            value.backward()
            calls = counter.reset()
            stats = dict(STATS.calls)
            grads = full_grads(model)
            per_step.append(
                {
                    "loss": value.item(),
                    "eval_loss": evaluated,
                    "grads": grads,
                    "natural": natural,
                    "calls": calls,
                    "eval_calls": eval_calls,
                    "stats": stats,
                    "scale_grad": float(loss.logit_scale.grad)
                    if getattr(loss, "learnable_scale", False)
                    else None,
                }
            )
        results[name] = per_step
    return results


def _check(model_dir, names, sizes, per_rank) -> None:
    for name in names:
        for step in range(STEPS):
            texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step)
            ref = reference_step(model_dir, name, texts)
            assert ref["grads"].abs().max() > 0
            tol = 1e-5 * ref["grads"].abs().max().item()
            results = [r[name][step] for r in per_rank]
            where = f"{name} step {step}"
            mean_loss = sum(r["loss"] for r in results) / len(results)
            assert mean_loss == pytest.approx(ref["loss"], rel=1e-5), where
            mean_eval = sum(r["eval_loss"] for r in results) / len(results)
            assert mean_eval == pytest.approx(ref["loss"], rel=1e-5), where
            for rank, r in enumerate(results):
                err = (r["grads"] - ref["grads"]).abs().max().item()
                assert err <= tol, f"{where} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
                # one reduce-scatter per parameter group per step, whatever the number of replays
                assert r["calls"]["reduce_scatter_single"] == GROUPS, (where, rank, r["calls"])
                assert r["stats"].get("all_gather_counts") == 1, (where, rank, r["stats"])
                if r["scale_grad"] is not None:
                    assert r["scale_grad"] == pytest.approx(ref["scale_grad"], rel=1e-4, abs=1e-7), where
            # the same collective sequence on every rank, in training and in evaluation
            assert len({tuple(sorted(r["calls"].items())) for r in results}) == 1, where
            assert len({tuple(sorted(r["eval_calls"].items())) for r in results}) == 1, where
            if results[0]["scale_grad"] is not None:
                assert len({r["scale_grad"] for r in results}) == 1, "every rank: the same scale gradient"


FSDP_NAMES = ["mnr_2neg", "clip_learnable", "tiled_ring_sym"]


@pytest.mark.parametrize("sizes", [[4, 4], [5, 3], [2, 5, 3]], ids=["w2_equal", "w2_unequal", "w3_unequal"])
def test_fsdp2_gradients_equal_single_process_global_batch(model_dir, sizes):
    names = FSDP_NAMES if len(sizes) == 2 else ["clip_learnable"]
    per_rank = run_distributed(_fsdp_worker, len(sizes), model_dir, names, sizes, {}, timeout=300)
    _check(model_dir, names, sizes, per_rank)


def test_fsdp2_token_budget_different_counts_per_rank(model_dir):
    """A token budget cuts a different number of mini-batches on each rank (rows of different
    lengths): the ranks agree on the largest, and the result is still exact."""
    sizes = [5, 4]
    extra = {"mini_batch_size": 4, "mini_batch_num_tokens": 40}
    names = ["mnr_pairs", "tiled_ring_sym"]
    per_rank = run_distributed(_fsdp_worker, 2, model_dir, names, sizes, extra, timeout=300)
    _check(model_dir, names, sizes, per_rank)
    naturals = [tuple(r[name][s]["natural"]) for name in names for s in range(STEPS) for r in per_rank]
    assert len(set(naturals)) > 1, f"the test needs ranks that plan different counts: {naturals}"


def _accumulation_worker(rank: int, world: int, path: str):
    from st_cached_losses import CachedMNRLoss

    model = shard(load_model(path))
    counter = _Counter()
    loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True)
    sizes = [5, 3]
    counts = []
    for micro, seed in enumerate((1, 2)):
        texts = global_texts(8, 2, seed=seed)
        # what accelerate's no_sync does for FSDP2
        model.set_requires_gradient_sync(micro == 1)
        loss([model.preprocess(c) for c in local_columns(texts, sizes, rank)], None).backward()
        counts.append(counter.reset()["reduce_scatter_single"])
    return {"counts": counts, "grads": full_grads(model)}


def test_fsdp2_no_reduce_scatter_inside_accumulation(model_dir):
    per_rank = run_distributed(_accumulation_worker, 2, model_dir, timeout=300)
    refs = [reference_step(model_dir, "mnr_pairs", global_texts(8, 2, seed=s)) for s in (1, 2)]
    expected = refs[0]["grads"] + refs[1]["grads"]
    for r in per_rank:
        assert r["counts"] == [0, GROUPS], "accumulation step: none; sync step: one per parameter group"
        torch.testing.assert_close(r["grads"], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _ddp_worker(rank: int, world: int, path: str, names: list[str], sizes: list[int], ddp_kwargs: dict):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for name in names:
        model = load_model(path)
        ddp = DDP(model, **ddp_kwargs)
        hooks = [0]

        def counting_hook(state, bucket, hooks=hooks):
            hooks[0] += 1
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting_hook)
        loss = make_loss(name, model, mini_batch_size=4, mini_batch_num_tokens=40)
        loss.cache.agree_mini_batches = True
        loss.model = ddp
        per_step = []
        for step in range(STEPS):
            texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step)
            feats = [model.preprocess(t) for t in local_columns(texts, sizes, rank)]
            natural = [len(loss.cache.plan(k, f)) for k, f in enumerate(feats)]
            ddp.zero_grad(set_to_none=True)
            hooks[0] = 0
            value = loss(feats, None)
            value.backward()
            per_step.append(
                {
                    "loss": value.item(),
                    "grads": torch.cat([p.grad.flatten() for p in model.parameters()]),
                    "hooks": hooks[0],
                    "natural": natural,
                }
            )
        results[name] = per_step
    return results


@pytest.mark.parametrize(
    "ddp_kwargs", [{"find_unused_parameters": True}, {"static_graph": True}], ids=["unused", "static"]
)
def test_ddp_agreed_plans_with_token_budget(model_dir, ddp_kwargs):
    """The agreed plans (filler mini-batches on the rank with fewer) under DDP: exact, one all-reduce."""
    sizes = [5, 2]
    names = ["mnr_pairs", "clip_learnable"]
    per_rank = run_distributed(_ddp_worker, 2, model_dir, names, sizes, ddp_kwargs, timeout=300)
    naturals = set()
    for name in names:
        for step in range(STEPS):
            ref = reference_step(model_dir, name, global_texts(sum(sizes), CONFIGS[name][2], seed=step))
            tol = 1e-5 * ref["grads"].abs().max().item()
            for rank, r in enumerate(per_rank):
                res = r[name][step]
                naturals.add(tuple(res["natural"]))
                err = (res["grads"] - ref["grads"]).abs().max().item()
                assert err <= tol, f"{name} step {step} rank {rank}: {err:.2e} > {tol:.2e}"
                assert res["hooks"] == 1
            assert sum(r[name][step]["loss"] for r in per_rank) / 2 == pytest.approx(ref["loss"], rel=1e-5)
    assert len(naturals) > 1, naturals


def _bad_input_worker(rank: int, world: int, path: str):
    from st_cached_losses import CachedMNRLoss

    model = shard(load_model(path))
    loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True)
    feats = [model.preprocess(t) for t in global_texts(4, 2)]
    if rank == 1:
        # flat ids with offsets (StaticEmbedding's layout): cannot be cut into mini-batches
        feats[1] = {"input_ids": torch.arange(6), "offsets": torch.tensor([0, 3])}
    start = time.monotonic()
    try:
        # the engine directly: the loss's own column check (CachedMNRLoss.forward) would raise on rank 1
        # before the engine's agreement, leaving rank 0 to learn of it from gloo's "Connection closed"
        loss.cache.step(model, feats, lambda e: loss._stage2(e, None)).backward()
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_bad_input_on_one_rank_fails_every_rank(model_dir):
    start = time.monotonic()
    per_rank = run_distributed(_bad_input_worker, 2, model_dir, timeout=120)
    assert time.monotonic() - start < 120
    (kind0, msg0, t0), (kind1, msg1, t1) = per_rank
    assert kind1 == "ValueError" and "no batch" in msg1, msg1
    assert kind0 == "RuntimeError" and "rank(s) [1]" in msg0, (msg0, msg1)
    assert t0 < 30 and t1 < 30
