"""Across processes (gloo on CPU, processes spawned from pytest): DDP parameter gradients equal the
single-process gradients of the concatenated global batch, for every loss, equal and unequal
per-process batches, gather and ring; collective counts; learnable scale in sync; duplicate masking;
errors raised on every rank instead of a hang."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.dist_utils import run_distributed
from tests.reference import reference_infonce
from tests.tiny_model import make_tiny_model, random_texts

# name -> (class name, kwargs, number of text columns, symmetric)
CONFIGS = {
    "mnr_pairs": ("CachedMNRLoss", {}, 2, False),
    "mnr_2neg": ("CachedMNRLoss", {}, 4, False),
    "clip": ("CachedCLIPLoss", {}, 2, True),
    "clip_learnable": ("CachedCLIPLoss", {"learnable_scale": True, "scale": 10.0}, 2, True),
    "tiled_ring_sym": ("CachedTiledLoss", {"symmetric": True, "tile_size": 3}, 2, True),
    "tiled_ring_2neg": ("CachedTiledLoss", {"tile_size": 2}, 4, False),
    "tiled_ring_learnable": (
        "CachedTiledLoss",
        {"symmetric": True, "learnable_scale": True, "scale": 10.0},
        3,
        True,
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("dist_model")
    model = make_tiny_model(base / "bert")
    path = base / "st"
    model.save(str(path))
    return str(path)


def load_model(path: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    # BERT's pooler is not used by mean pooling: drop it so DDP sees every parameter used
    model[0].auto_model.pooler = None
    return model


def global_texts(n_rows: int, n_cols: int, seed: int = 0, duplicates: bool = False) -> list[list[str]]:
    cols = [random_texts(n_rows, seed=seed + 31 * k) for k in range(n_cols)]
    if duplicates:
        # the same positive text appears at rows 0 and n-1 (different processes), and a hard
        # negative of row 1 repeats row 0's positive: false negatives across processes
        cols[1][-1] = cols[1][0]
        cols[0][-1] = cols[0][0]
        if n_cols > 2:
            cols[2][1] = cols[1][0]
    return cols


def make_loss(name: str, model, **extra):
    import st_cached_losses

    cls_name, kwargs, _, _ = CONFIGS[name]
    return getattr(st_cached_losses, cls_name)(
        model, mini_batch_size=2, gather_across_devices=True, **kwargs, **extra
    )


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def reference_step(path: str, name: str, texts: list[list[str]], mask: bool = False) -> dict:
    """Single process, whole global batch, naive dense loss."""
    from st_cached_losses.gradcache import input_hashes

    _, kwargs, _, symmetric = CONFIGS[name]
    model = load_model(path)
    feats = [model.preprocess(t) for t in texts]
    scale = torch.tensor(float(kwargs.get("scale", 20.0)), requires_grad=True)
    embs = [model(dict(f))["sentence_embedding"] for f in feats]
    keys = {}
    if mask:
        hashes = [input_hashes(f) for f in feats]
        keys = {"anchor_keys": hashes[0], "candidate_keys": hashes[1:]}
    loss = reference_infonce(embs[0], embs[1:], scale=scale, symmetric=symmetric, **keys)
    loss.backward()
    return {
        "loss": loss.item(),
        "grads": flat_grads(model),
        "scale_grad": float(scale.grad) * float(scale.detach()),
    }


#: steps per DDP instance: DDP's state across steps (static graph, bucket rebuilds) is part of what is tested
STEPS = 3


def _step_worker(
    rank: int, world: int, path: str, names: list[str], sizes: list[int], mask: bool, ddp_kwargs: dict
):
    """Per loss: one DDP instance, ``STEPS`` steps on different global batches (no optimizer step, the
    gradients zeroed in between); per step the loss, parameter gradients, collectives and all-reduces."""
    from st_cached_losses.distributed import STATS

    results = {}
    for name in names:
        n_cols = CONFIGS[name][2]
        model = load_model(path)
        ddp = DDP(model, **ddp_kwargs)
        hooks = [0]

        def counting_hook(state, bucket, hooks=hooks):
            hooks[0] += 1
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting_hook)
        loss = make_loss(name, model, mask_duplicates=mask)
        loss.model = ddp  # what sentence-transformers' trainer does with a wrapped model
        per_step = []
        for step in range(STEPS):
            texts = global_texts(sum(sizes), n_cols, seed=step, duplicates=mask)
            start = sum(sizes[:rank])
            local = [t[start : start + sizes[rank]] for t in texts]
            feats = [model.preprocess(t) for t in local]
            ddp.zero_grad(set_to_none=True)
            if getattr(loss, "learnable_scale", False):
                loss.logit_scale.grad = None
            STATS.reset()
            hooks[0] = 0
            value = loss(feats, None)
            value.backward()
            scale_grad = None
            if getattr(loss, "learnable_scale", False):
                # d/dlogit_scale = s * dL/ds: compare as dL/ds * s with the reference
                scale_grad = float(loss.logit_scale.grad)
            per_step.append(
                {
                    "loss": value.item(),
                    "grads": flat_grads(model),
                    "calls": dict(STATS.calls),
                    "bytes": STATS.total_bytes,
                    "hooks": hooks[0],
                    "scale_grad": scale_grad,
                    "scale": loss.scale,
                }
            )
        results[name] = per_step
    return results


def _check_against_reference(model_dir, names, sizes, per_rank, mask=False):
    """Every rank, every step: the single-process gradient of that step's global batch."""
    for name in names:
        for step in range(STEPS):
            texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step, duplicates=mask)
            ref = reference_step(model_dir, name, texts, mask)
            assert ref["grads"].abs().max() > 0
            tol = 1e-5 * ref["grads"].abs().max().item()
            results = [r[name][step] for r in per_rank]
            where = f"{name} step {step}"
            losses = [r["loss"] for r in results]
            assert sum(losses) / len(losses) == pytest.approx(ref["loss"], rel=1e-5), where
            for rank, r in enumerate(results):
                err = (r["grads"] - ref["grads"]).abs().max().item()
                assert err <= tol, f"{where} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
                assert r["hooks"] == 1, f"{where}: DDP must all-reduce exactly once per step"
                if r["scale_grad"] is not None:
                    assert r["scale_grad"] == pytest.approx(ref["scale_grad"], rel=1e-4, abs=1e-7), where
            if results[0]["scale_grad"] is not None:
                assert len({r["scale_grad"] for r in results}) == 1, (
                    "every rank must get the same scale gradient"
                )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_gradients_equal_single_process_global_batch(model_dir, world):
    sizes = [3] * world
    names = list(CONFIGS)
    per_rank = run_distributed(
        _step_worker, world, model_dir, names, sizes, False, {"find_unused_parameters": False}
    )
    _check_against_reference(model_dir, names, sizes, per_rank)
    # one all-gather per gathered tensor and one gradient reduction per gathered tensor
    for rank_result in per_rank:
        calls = rank_result["mnr_2neg"][-1]["calls"]
        assert calls == {"all_gather_shapes": 1, "all_gather": 3, "all_reduce_grad": 3}, calls
        calls = rank_result["clip_learnable"][-1]["calls"]
        assert calls == {
            "all_gather_shapes": 1,
            "all_gather": 2,
            "all_reduce_grad": 2,
            "all_reduce_scale": 1,
        }, calls
        # the ring never gathers embeddings
        calls = rank_result["tiled_ring_sym"][-1]["calls"]
        assert "all_gather" not in calls and calls["ring_send"] > 0, calls


@pytest.mark.parametrize(
    "ddp_kwargs",
    [{}, {"find_unused_parameters": True}, {"static_graph": True}],
    ids=["default", "unused", "static"],
)
@pytest.mark.parametrize("sizes", [[3, 1], [2, 5, 3]], ids=["w2", "w3"])
def test_unequal_batches_and_ddp_options(model_dir, sizes, ddp_kwargs):
    names = list(CONFIGS) if len(sizes) == 2 else ["mnr_2neg", "clip_learnable", "tiled_ring_sym"]
    per_rank = run_distributed(_step_worker, len(sizes), model_dir, names, sizes, False, ddp_kwargs)
    _check_against_reference(model_dir, names, sizes, per_rank)


def test_ring_and_gather_agree(model_dir):
    """CachedTiledLoss (ring) and CachedCLIPLoss (gather) compute the same symmetric loss."""
    sizes = [4, 2]
    per_rank = run_distributed(_step_worker, 2, model_dir, ["clip", "tiled_ring_sym"], sizes, False, {})
    for r in per_rank:
        for clip, ring in zip(r["clip"], r["tiled_ring_sym"]):
            ref = clip["grads"]
            assert ref.abs().max() > 0
            torch.testing.assert_close(ring["grads"], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            assert clip["loss"] == pytest.approx(ring["loss"], rel=1e-6)


def test_duplicates_masked_across_processes(model_dir):
    sizes = [3, 3]
    names = ["mnr_2neg", "clip", "tiled_ring_sym"]
    per_rank = run_distributed(_step_worker, 2, model_dir, names, sizes, True, {})
    _check_against_reference(model_dir, names, sizes, per_rank, mask=True)
    # and masking changes the result (the test data does contain cross-process duplicates)
    unmasked = reference_step(model_dir, "clip", global_texts(6, 2, duplicates=True))
    assert sum(r["clip"][0]["loss"] for r in per_rank) / 2 != pytest.approx(unmasked["loss"], rel=1e-4)


def _accumulation_worker(rank: int, world: int, path: str):
    from st_cached_losses import CachedMNRLoss

    model = load_model(path)
    ddp = DDP(model)
    hooks = [0]

    def counting_hook(state, bucket):
        hooks[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True)
    loss.model = ddp
    texts = [global_texts(8, 2, seed=s) for s in (1, 2)]
    counts = []
    for micro, t in enumerate(texts):
        local = [col[rank * 4 : rank * 4 + 4] for col in t]
        ctx = ddp.no_sync() if micro == 0 else torch.enable_grad()
        with ctx:
            loss([model.preprocess(c) for c in local], None).backward()
        counts.append(hooks[0])
    return {"counts": counts, "grads": flat_grads(model)}


def test_no_all_reduce_inside_outer_no_sync(model_dir):
    per_rank = run_distributed(_accumulation_worker, 2, model_dir)
    refs = [reference_step(model_dir, "mnr_pairs", global_texts(8, 2, seed=s)) for s in (1, 2)]
    expected = refs[0]["grads"] + refs[1]["grads"]
    for r in per_rank:
        assert r["counts"] == [0, 1], "accumulation step: no all-reduce; sync step: exactly one"
        torch.testing.assert_close(r["grads"], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _mismatch_worker(rank: int, world: int, path: str):
    from st_cached_losses import CachedMNRLoss

    model = load_model(path)
    loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True)
    n_cols = 2 if rank == 0 else 3  # rank 1 feeds a hard-negative column rank 0 does not have
    feats = [model.preprocess(t) for t in global_texts(4, n_cols)]
    try:
        loss(feats, None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_columns_raise_on_every_rank(model_dir):
    messages = run_distributed(_mismatch_worker, 2, model_dir, timeout=120)
    for msg in messages:
        assert "processes disagree" in msg and "columns" in msg, msg


def test_gather_without_process_group_warns_once(model_dir):
    from st_cached_losses import CachedCLIPLoss

    model = load_model(model_dir)
    loss = CachedCLIPLoss(model, mini_batch_size=2, gather_across_devices=True)
    feats = [model.preprocess(t) for t in global_texts(4, 2)]
    import st_cached_losses.distributed as d

    d._warned.discard("CachedCLIPLoss")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = loss(feats, None)
        second = loss(feats, None)
    relevant = [w for w in caught if "no process group" in str(w.message)]
    assert len(relevant) == 1
    ref = reference_step(model_dir, "clip", global_texts(4, 2))
    assert first.item() == pytest.approx(ref["loss"], rel=1e-5) and second.item() == pytest.approx(
        ref["loss"], rel=1e-5
    )


def test_model_dir_fixture_is_reusable(model_dir):
    assert (Path(model_dir) / "modules.json").is_file()


def _router_worker(rank: int, world: int, path: str, sizes: list[int], ddp_kwargs: dict):
    """A query / document Router: each column's mini-batches reach only one route's parameters."""
    model = load_router(path)
    ddp = DDP(model, **ddp_kwargs)
    loss = make_loss("clip", model)
    loss.model = ddp
    out = []
    for step in range(STEPS):
        texts = global_texts(sum(sizes), 2, seed=step)
        start = sum(sizes[:rank])
        local = [t[start : start + sizes[rank]] for t in texts]
        ddp.zero_grad(set_to_none=True)
        feats = [model.preprocess(local[0], task="query"), model.preprocess(local[1], task="document")]
        value = loss(feats, None)
        value.backward()
        out.append({"loss": value.item(), "grads": flat_grads(model)})
    return out


def load_router(path: str):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Router

    query, document = load_model(path)[0], load_model(path)[0]
    with torch.no_grad():  # two different encoders
        for p in document.parameters():
            p.mul_(0.9)
    router = Router.for_query_document(query_modules=[query], document_modules=[document])
    return SentenceTransformer(modules=[router, Pooling(query.get_embedding_dimension())], device="cpu")


@pytest.mark.parametrize(
    "ddp_kwargs", [{"find_unused_parameters": True}, {"static_graph": True}], ids=["unused", "static"]
)
def test_router_model_every_step(model_dir, ddp_kwargs):
    sizes = [3, 2]
    per_rank = run_distributed(_router_worker, 2, model_dir, sizes, ddp_kwargs)
    torch.manual_seed(0)
    model = load_router(model_dir)
    for step in range(STEPS):
        texts = global_texts(sum(sizes), 2, seed=step)
        model.zero_grad(set_to_none=True)
        feats = [model.preprocess(texts[0], task="query"), model.preprocess(texts[1], task="document")]
        embs = [model(dict(f))["sentence_embedding"] for f in feats]
        ref_loss = reference_infonce(embs[0], embs[1:], scale=20.0, symmetric=True)
        ref_loss.backward()
        ref = flat_grads(model)
        assert ref.abs().max() > 0
        for rank, r in enumerate(per_rank):
            err = (r[step]["grads"] - ref).abs().max().item()
            assert err <= 1e-5 * ref.abs().max().item(), f"step {step} rank {rank}: max grad error {err:.2e}"
        assert sum(r[step]["loss"] for r in per_rank) / 2 == pytest.approx(ref_loss.item(), rel=1e-5)
