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

from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_infonce
from tests.support.tiny_model import make_tiny_model, random_texts

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
    from st_cached_losses.functional.keys import input_hashes

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
    # the step's meeting (errors raised on every process), one all-gather per gathered tensor and one
    # gradient reduction per gathered tensor
    for rank_result in per_rank:
        calls = rank_result["mnr_2neg"][-1]["calls"]
        assert calls == {
            "all_gather_counts": 1,
            "all_gather_shapes": 1,
            "all_gather": 3,
            "all_reduce_grad": 3,
        }, calls
        calls = rank_result["clip_learnable"][-1]["calls"]
        assert calls == {
            "all_gather_counts": 1,
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
    import st_cached_losses.functional.distributed as d

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


# --------------------------------------------------------------------------- non-finite embeddings


def _poison(model, rank: int, poisoned_rank: int, column: int, rows_per_rank: int, mini_batch_size: int):
    """On ``poisoned_rank``, make one row of ``column``'s embeddings NaN: a forward hook on the pooling
    poisons the first mini-batch of that column (GradCache embeds column by column)."""
    if rank != poisoned_rank:
        return None
    per_column = -(-rows_per_rank // mini_batch_size)
    calls = [0]

    def hook(module, inputs, output):
        call = calls[0]
        calls[0] += 1
        if call != column * per_column:
            return output
        emb = output["sentence_embedding"].clone()
        emb[0] = float("nan")
        output["sentence_embedding"] = emb
        return output

    return model[1].register_forward_hook(hook), calls


def _nonfinite_worker(rank: int, world: int, path: str, cases: list[tuple[str, int]], poisoned_rank: int):
    """Per case (loss config, poisoned column): a training step under DDP and an evaluation pass with
    NaN in one column of one rank; what each raised, how long it took, which collectives ran before;
    then a clean step, which shows that no rank was left inside a collective."""
    import time

    from st_cached_losses.distributed import STATS

    rows = 3
    out = {}
    for name, column in cases:
        n_cols = CONFIGS[name][2]
        model = load_model(path)
        ddp = DDP(model)
        loss = make_loss(name, model)
        loss.model = ddp
        texts = global_texts(rows * world, n_cols)
        feats = [model.preprocess(t[rank * rows : (rank + 1) * rows]) for t in texts]
        handle, _ = _poison(model, rank, poisoned_rank, column, rows, loss.mini_batch_size) or (None, None)
        result = {}
        for mode in ("train", "eval"):
            STATS.reset()
            start = time.perf_counter()
            try:
                if mode == "train":
                    loss(feats, None).backward()
                else:
                    with torch.no_grad():
                        loss(feats, None)
                result[mode] = ("no error", None)
            except ValueError as exc:
                result[mode] = (str(exc), dict(STATS.calls))
            result[f"{mode}_seconds"] = time.perf_counter() - start
            if handle is not None and mode == "train":
                # the evaluation pass embeds column by column again: poison it afresh
                handle.remove()
                handle, _ = _poison(model, rank, poisoned_rank, column, rows, loss.mini_batch_size)
        if handle is not None:
            handle.remove()
        ddp.zero_grad(set_to_none=True)
        clean = loss(feats, None)
        clean.backward()
        result["clean_loss"] = clean.item()
        result["clean_grads_finite"] = bool(torch.isfinite(flat_grads(model)).all())
        out[name] = result
    return out


def _check_nonfinite_reports(per_rank, cases, poisoned_rank: int, world: int) -> None:
    column_names = {0: "column 0 (anchors)", 1: "column 1 (positives)", 2: "column 2 (hard negatives #1)"}
    for name, column in cases:
        results = [r[name] for r in per_rank]
        for mode in ("train", "eval"):
            messages = {res[mode][0] for res in results}
            assert len(messages) == 1, f"{name} {mode}: every rank must raise the same error: {messages}"
            (msg,) = messages
            prefix = "non-finite (NaN or inf) values in the embeddings of 1 of"
            assert msg.startswith(prefix), (name, mode, msg)
            assert f"rank {poisoned_rank}: {column_names[column]}" in msg, (name, mode, msg)
            for other in set(range(world)) - {poisoned_rank}:
                assert f"rank {other}:" not in msg, (name, mode, msg)
            assert "learning rate" in msg and "bf16" in msg and "inputs" in msg, msg
            for rank, res in enumerate(results):
                # raised at the shape exchange, before any other collective of the step but its meeting
                expected = {"all_gather_counts": 1, "all_gather_shapes": 1}
                assert res[mode][1] == expected, (name, mode, rank, res[mode][1])
                assert res[f"{mode}_seconds"] < 30, (name, mode, rank, res[f"{mode}_seconds"])
        clean = [res["clean_loss"] for res in results]
        assert bool(torch.isfinite(torch.tensor(clean)).all()), (name, clean)
        assert all(res["clean_grads_finite"] for res in results), name


NONFINITE_GATHER_CASES = [("mnr_2neg", 2), ("clip", 0)]
NONFINITE_RING_CASES = [("tiled_ring_sym", 1), ("tiled_ring_2neg", 0)]


@pytest.mark.parametrize(
    ("world", "cases"),
    [(2, NONFINITE_GATHER_CASES), (2, NONFINITE_RING_CASES), (3, NONFINITE_RING_CASES[:1])],
    ids=["gather_w2", "ring_w2", "ring_w3"],
)
def test_nonfinite_on_one_rank_raises_same_error_on_every_rank(model_dir, world, cases):
    """NaN in one column of rank 1 only: every rank raises the same ValueError naming rank 1 and the
    column, at the shape exchange, in bounded time (no 'Connection closed by peer', no NaN loss on some
    ranks and a finite one on others), in training and in evaluation; the next clean step works."""
    import time

    start = time.monotonic()
    per_rank = run_distributed(_nonfinite_worker, world, model_dir, cases, 1, timeout=120)
    assert time.monotonic() - start < 120
    _check_nonfinite_reports(per_rank, cases, 1, world)


@pytest.mark.parametrize("gather", [False, True], ids=["local", "gather_no_group"])
def test_nonfinite_single_process_raises_same_error(model_dir, gather):
    """One process (with or without gather_across_devices): the same ValueError, naming the column."""
    from st_cached_losses import CachedCLIPLoss

    model = load_model(model_dir)
    loss = CachedCLIPLoss(model, mini_batch_size=2, gather_across_devices=gather)
    feats = [model.preprocess(t) for t in global_texts(3, 2)]
    handle, _ = _poison(model, 0, 0, 1, 3, 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError) as info:
                loss(feats, None)
    finally:
        handle.remove()
    msg = str(info.value)
    assert msg.startswith("non-finite (NaN or inf) values in column 1 (positives) of the embeddings"), msg
    assert "rank" not in msg and "learning rate" in msg and "bf16" in msg, msg
