"""Sharded models across processes (gloo on CPU, processes spawned from pytest): FSDP2 (``fully_shard``
per encoder layer and at the root) gives parameter gradients equal to one process on the global batch,
for equal and unequal per-process batches and token budgets that cut different numbers of
mini-batches per process; one reduce-scatter per parameter group per step and none inside gradient
accumulation; with ``keep_params_unsharded`` one all-gather per group per step as well; the same agreed plans under DDP; a LoRA adapter, a Router whose document encoder is
frozen, a left-padded rotary decoder (fp32 and bf16 autocast) sharded the same way; a learnable scale
equal on every process after an optimizer step; a bad input, a loss-level check or NaN embeddings on
one rank only fail every rank in bounded time with an error naming that rank and the cause."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist

from tests.losses.test_distributed import CONFIGS, global_texts, load_model, reference_step
from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_infonce
from tests.support.tiny_model import load_tiny_decoder, make_tiny_decoder, make_tiny_model

#: steps per sharded model: FSDP2's state across steps is part of what is tested
STEPS = 2


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sharded_decoder") / "qwen2"
    make_tiny_decoder(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("sharded_model")
    model = make_tiny_model(base / "bert")
    path = base / "st"
    model.save(str(path))
    return str(path)


def make_loss(name: str, model, keep_params_unsharded: bool = False, **extra):
    import st_cached_losses

    cls_name, kwargs, _, _ = CONFIGS[name]
    options = {"mini_batch_size": 2, "gather_across_devices": True, **kwargs, **extra}
    loss = getattr(st_cached_losses, cls_name)(model, **options)
    # an engine knob, a setting like any other (assigned after construction here)
    loss.keep_params_unsharded = keep_params_unsharded
    return loss


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


def fsdp2_settings(model) -> list[tuple]:
    """Per FSDP2 parameter group: (sharded now, reshards after forward, reshards after backward, the
    state's auto flag); FSDP2 has no getters, so from its state."""
    from st_cached_losses.engine.wrappers import fsdp2_modules

    out = []
    for m in fsdp2_modules(model):
        state = m._get_fsdp_state()
        for g in state._fsdp_param_groups:
            after_forward = g.post_forward_mesh_info is not None
            out.append(
                (g.is_sharded, after_forward, g.reshard_after_backward, state._auto_reshard_after_forward)
            )
    return out


def default_settings(model) -> list[tuple]:
    """FSDP2's defaults once the root ran (``fully_shard`` without options): every group sharded, every
    one but the root's resharded after forward, all after backward."""
    return [(True, i > 0, True, True) for i in range(len(fsdp2_settings(model)))]


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
            settings = fsdp2_settings(model)
            grads = full_grads(model)
            per_step.append(
                {
                    "settings": settings,
                    "default_settings": default_settings(model),
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
        if getattr(loss, "learnable_scale", False):
            # an optimizer step on the scale: every process must then hold the same value
            torch.optim.SGD([loss.logit_scale], lr=SCALE_LR).step()
            per_step[-1]["scale_after_step"] = float(loss.logit_scale.detach())
        results[name] = per_step
    return results


#: learning rate of the optimizer step on a learnable scale (large enough to move it visibly)
SCALE_LR = 0.5


def _check(model_dir, names, sizes, per_rank, all_gathers: int | None = None) -> None:
    """``all_gathers``: FSDP2 all-gathers per step expected on every rank, in training and in evaluation
    (None: not checked)."""
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
                if all_gathers is not None:
                    assert r["calls"]["all_gather_single"] == all_gathers, (where, rank, r["calls"])
                    assert r["eval_calls"]["all_gather_single"] == all_gathers, (where, rank, r["eval_calls"])
                if r["scale_grad"] is not None:
                    assert r["scale_grad"] == pytest.approx(ref["scale_grad"], rel=1e-4, abs=1e-7), where
            # the same collective sequence on every rank, in training and in evaluation
            assert len({tuple(sorted(r["calls"].items())) for r in results}) == 1, where
            assert len({tuple(sorted(r["eval_calls"].items())) for r in results}) == 1, where
            if results[0]["scale_grad"] is not None:
                assert len({r["scale_grad"] for r in results}) == 1, "every rank: the same scale gradient"
            if step == STEPS - 1 and "scale_after_step" in results[0]:
                # log(scale) - lr * the reference's gradient wrt log(scale), on every rank
                expected = math.log(CONFIGS[name][1]["scale"]) - SCALE_LR * ref["scale_grad"]
                assert abs(expected - math.log(CONFIGS[name][1]["scale"])) > 1e-3, "the step must move it"
                after = {r["scale_after_step"] for r in results}
                assert len(after) == 1, f"{where}: scale after the optimizer step differs by rank: {after}"
                assert after.pop() == pytest.approx(expected, rel=1e-5, abs=1e-6), where


FSDP_NAMES = ["mnr_2neg", "clip_learnable", "tiled_ring_sym"]


@pytest.mark.parametrize("sizes", [[4, 4], [5, 3], [2, 5, 3]], ids=["w2_equal", "w2_unequal", "w3_unequal"])
def test_fsdp2_gradients_equal_single_process_global_batch(model_dir, sizes):
    names = FSDP_NAMES
    per_rank = run_distributed(_fsdp_worker, len(sizes), model_dir, names, sizes, {}, timeout=300)
    _check(model_dir, names, sizes, per_rank)


def _unsharded_worker(rank: int, world: int, path: str, names: list[str], sizes: list[int]):
    """:func:`_fsdp_worker` with ``keep_params_unsharded``, then a step whose loss stage raises (on every
    rank): FSDP2's settings and sharding must be restored then too, and a clean step must still work."""
    results = _fsdp_worker(rank, world, path, names, sizes, {"keep_params_unsharded": True})
    model = shard(load_model(path))
    loss = make_loss("mnr_pairs", model, keep_params_unsharded=True)
    feats = [model.preprocess(t) for t in local_columns(global_texts(sum(sizes), 2, seed=5), sizes, rank)]

    def failing(embeddings):
        raise RuntimeError("loss stage failed")

    with contextlib.suppress(RuntimeError):
        loss.cache.step(model, feats, failing).backward()
    after_failure = (fsdp2_settings(model), default_settings(model))
    model.zero_grad(set_to_none=True)
    value = loss(feats, None)
    value.backward()
    clean = (value.item(), bool(torch.isfinite(full_grads(model)).all()), fsdp2_settings(model))
    return {"steps": results, "after_failure": after_failure, "clean": clean}


def test_fsdp2_keep_params_unsharded_one_all_gather_per_group(model_dir):
    """``keep_params_unsharded``: W=2 with 5 and 3 rows, every rank's gradients equal to one process on
    the global batch (rtol 1e-5), and per step (training, and evaluation before it) one all-gather and
    one reduce-scatter per FSDP2 parameter group, instead of an all-gather per mini-batch forward and per
    replay; after each step every group is sharded again with FSDP2's own settings, also after a step
    that raised."""
    sizes = [5, 3]
    names = FSDP_NAMES
    out = run_distributed(_unsharded_worker, 2, model_dir, names, sizes, timeout=300)
    _check(model_dir, names, sizes, [r["steps"] for r in out], all_gathers=GROUPS)
    for rank, r in enumerate(out):
        for name in names:
            for step, res in enumerate(r["steps"][name]):
                assert res["settings"] == res["default_settings"], (name, step, rank, res["settings"])
        settings, expected = r["after_failure"]
        assert settings == expected, ("after a failed step", rank, settings)
        value, finite, settings = r["clean"]
        assert math.isfinite(value) and finite and settings == expected, (rank, r["clean"])


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


def _accumulation_worker(rank: int, world: int, path: str, keep_params_unsharded: bool):
    from st_cached_losses import CachedMNRLoss

    model = shard(load_model(path))
    counter = _Counter()
    loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True)
    loss.keep_params_unsharded = keep_params_unsharded
    sizes = [5, 3]
    counts, gathers = [], []
    for micro, seed in enumerate((1, 2)):
        texts = global_texts(8, 2, seed=seed)
        # what accelerate's no_sync does for FSDP2
        model.set_requires_gradient_sync(micro == 1)
        loss([model.preprocess(c) for c in local_columns(texts, sizes, rank)], None).backward()
        calls = counter.reset()
        counts.append(calls["reduce_scatter_single"])
        gathers.append(calls["all_gather_single"])
    return {"counts": counts, "gathers": gathers, "grads": full_grads(model)}


@pytest.mark.parametrize("keep_params_unsharded", [False, True], ids=["default", "kept_unsharded"])
def test_fsdp2_no_reduce_scatter_inside_accumulation(model_dir, keep_params_unsharded):
    per_rank = run_distributed(_accumulation_worker, 2, model_dir, keep_params_unsharded, timeout=300)
    refs = [reference_step(model_dir, "mnr_pairs", global_texts(8, 2, seed=s)) for s in (1, 2)]
    expected = refs[0]["grads"] + refs[1]["grads"]
    for r in per_rank:
        assert r["counts"] == [0, GROUPS], "accumulation step: none; sync step: one per parameter group"
        if keep_params_unsharded:
            assert r["gathers"] == [GROUPS, GROUPS], "one all-gather per parameter group per step"
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
        loss.cache = dataclasses.replace(loss.cache, agree_mini_batches=True)  # the engine is frozen
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
    from st_cached_losses.losses.base import StepData

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
        loss.cache.step(model, feats, lambda e: loss._stage2(e, None, StepData())).backward()
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_bad_input_on_one_rank_fails_every_rank(model_dir):
    start = time.monotonic()
    per_rank = run_distributed(_bad_input_worker, 2, model_dir, timeout=120)
    assert time.monotonic() - start < 120
    (kind0, msg0, t0), (kind1, msg1, t1) = per_rank
    assert kind1 == "ValueError" and "no batch" in msg1, msg1
    assert kind0 == "RuntimeError" and "rank 1 of 2 failed" in msg0 and "no batch" in msg0, (msg0, msg1)
    assert t0 < 30 and t1 < 30


# --------------------------------------------------------------------------- other models under FSDP2


def build_lora(path: str):
    """The tiny BERT with a LoRA adapter on the attention's query and value: only the adapter trains."""
    from peft import LoraConfig

    model = load_model(path)
    torch.manual_seed(0)  # the same adapter weights on every process and in the reference
    # random A and B: with B = 0 (peft's default) A's gradient would be zero
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    model.add_adapter(config)
    return model


def build_router_frozen(path: str):
    """A query / document Router whose document encoder is frozen (requires_grad=False)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Router

    query, document = load_model(path)[0], load_model(path)[0]
    with torch.no_grad():  # two different encoders
        for p in document.parameters():
            p.mul_(0.9)
    document.requires_grad_(False)
    router = Router.for_query_document(query_modules=[query], document_modules=[document])
    return SentenceTransformer(modules=[router, Pooling(query.get_embedding_dimension())], device="cpu")


def build_decoder(path: str):
    """The tiny left-padded Qwen2 with last-token pooling, written by the ``decoder_dir`` fixture."""
    return load_tiny_decoder(path)


#: case -> (builder, loss config, FSDP2 groups with trainable parameters: one reduce-scatter each per step)
CASES = {
    # the root group (embeddings) is frozen under LoRA: only the two layers reduce-scatter
    "lora": (build_lora, "mnr_pairs", 2),
    # the document encoder's layers are frozen; the query's two layers and the root (its embeddings) train
    "router_frozen": (build_router_frozen, "clip", 3),
    "decoder": (build_decoder, "mnr_pairs", 3),
    "decoder_bf16": (build_decoder, "mnr_pairs", 3),
}


def shard_layers(model):
    """FSDP2 on every transformer layer (BERT's or Qwen2's, of every route) and at the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in [m for m in model.modules() if type(m).__name__ in ("BertLayer", "Qwen2DecoderLayer")]:
        fully_shard(layer)
    fully_shard(model)
    return model


def case_features(case: str, model, texts: list[list[str]]) -> list[dict]:
    if case == "router_frozen":
        return [model.preprocess(t, task="query" if k == 0 else "document") for k, t in enumerate(texts)]
    return [model.preprocess(t) for t in texts]


def case_autocast(case: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.endswith("bf16") else contextlib.nullcontext()


def _case_worker(rank: int, world: int, path: str, case: str, sizes: list[int]):
    from st_cached_losses.distributed import STATS

    build, name, _ = CASES[case]
    model = shard_layers(build(path))
    counter = _Counter()
    loss = make_loss(name, model)
    per_step = []
    for step in range(STEPS):
        texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step)
        feats = case_features(case, model, local_columns(texts, sizes, rank))
        model.zero_grad(set_to_none=True)
        counter.reset()
        STATS.reset()
        with case_autocast(case):
            value = loss(feats, None)
        value.backward()
        per_step.append(
            {
                "loss": value.item(),
                "grads": full_grads(model),
                "calls": counter.reset(),
                "stats": dict(STATS.calls),
                "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
            }
        )
    return per_step


def case_reference(case: str, path: str, texts: list[list[str]], autocast: bool) -> dict:
    """One process, the whole global batch, no cache: the naive loss on the embeddings (under the same
    autocast as the sharded run when ``autocast``; the loss itself in fp32, as the cached loss's)."""
    build, name, _ = CASES[case]
    _, kwargs, _, symmetric = CONFIGS[name]
    model = build(path)
    feats = case_features(case, model, texts)
    with case_autocast(case) if autocast else contextlib.nullcontext():
        embs = [model(dict(f))["sentence_embedding"] for f in feats]
    scale = float(kwargs.get("scale", 20.0))
    loss = reference_infonce(embs[0].float(), [e.float() for e in embs[1:]], scale=scale, symmetric=symmetric)
    loss.backward()
    grads = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )
    return {"loss": loss.item(), "grads": grads}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_models_equal_single_process_global_batch(model_dir, decoder_dir, case):
    """LoRA, a Router with a frozen document encoder (that column is never replayed: no hang although
    every forward is a collective) and a left-padded rotary decoder, sharded per layer + root, W=2
    with 5 and 3 rows: every rank's parameter gradients are the single-process global-batch ones; one
    reduce-scatter per trainable parameter group per step. Under bf16 autocast (CPU) the reference is the
    same autocast on one process, see below for the tolerance."""
    if case == "lora":
        pytest.importorskip("peft")  # a dev dependency
    sizes = [5, 3]
    base = decoder_dir if case.startswith("decoder") else model_dir
    per_rank = run_distributed(_case_worker, 2, base, case, sizes, timeout=300)
    _, name, groups = CASES[case]
    bf16 = case.endswith("bf16")
    for step in range(STEPS):
        texts = global_texts(sum(sizes), CONFIGS[name][2], seed=step)
        ref = case_reference(case, base, texts, autocast=bf16)
        assert ref["grads"].abs().max() > 0
        where = f"{case} step {step}"
        results = [r[step] for r in per_rank]
        if case == "lora":
            trainable = results[0]["trainable"]
            assert trainable and all("lora_" in n for n in trainable), trainable
        if case == "router_frozen":
            assert not any("document" in n for n in results[0]["trainable"]), results[0]["trainable"]
        mean_loss = sum(r["loss"] for r in results) / len(results)
        if not bf16:
            tol = 1e-5 * ref["grads"].abs().max().item()
            assert mean_loss == pytest.approx(ref["loss"], rel=1e-5), where
            for rank, r in enumerate(results):
                err = (r["grads"] - ref["grads"]).abs().max().item()
                assert err <= tol, f"{where} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
        else:
            # bf16 rounds each matmul's inputs; the sharded run's matmuls have other shapes (mini-batches,
            # trimmed padding), so it rounds differently from the one-process run. Both are bf16
            # approximations of the fp32 gradient: the sharded one must be no further from it than twice
            # the one-process bf16 run (the suite's bf16 rule), and both close to each other.
            ref32 = case_reference(case, base, texts, autocast=False)
            naive = (ref["grads"] - ref32["grads"]).norm().item()
            assert naive > 0, "autocast had no effect: the test would prove nothing"
            assert mean_loss == pytest.approx(ref["loss"], rel=2e-2), where
            for rank, r in enumerate(results):
                ours = (r["grads"] - ref32["grads"]).norm().item()
                assert ours <= 2 * naive, f"{where} rank {rank}: bf16 error {ours:.2e} > 2 x {naive:.2e}"
                rel = (r["grads"] - ref["grads"]).norm().item() / ref["grads"].norm().item()
                assert rel < 2e-2, f"{where} rank {rank}: relative error vs one-process bf16 {rel:.2e}"
        for rank, r in enumerate(results):
            assert r["calls"]["reduce_scatter_single"] == groups, (where, rank, r["calls"])
            assert r["stats"].get("all_gather_counts") == 1, (where, rank, r["stats"])
        assert len({tuple(sorted(r["calls"].items())) for r in results}) == 1, where


# --------------------------------------------------------------------------- one rank fails


def _failure_worker(rank: int, world: int, path: str, cases: list[str]):
    """Per case, a training step and an evaluation pass through the loss itself (``loss(features)``),
    where only rank 1's input is bad; what each rank raised and how long it took; then a clean step on
    every rank, which shows that none was left inside a collective (or FSDP2 in a broken state)."""
    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.losses.base import check_columns

    model = shard(load_model(path))
    out = {}
    for case in cases:
        budget = {"mini_batch_num_tokens": 40} if case == "no_mask" else {}
        loss = CachedMNRLoss(model, mini_batch_size=2, gather_across_devices=True, **budget)
        clean = [model.preprocess(t) for t in global_texts(4, 2, seed=7)]
        feats = [dict(f) for f in clean]
        handle = None
        if rank == 1:
            if case in ("rows", "rows_engine"):
                # a column with a different row count: the loss's own check (check_columns) refuses it
                feats[1] = model.preprocess(global_texts(3, 2, seed=7)[1])
            elif case == "no_mask":
                # nothing to count tokens by: the engine's plan refuses the token budget
                del feats[1]["attention_mask"]
            elif case == "nan":

                def poison(module, inputs, output):
                    output["sentence_embedding"] = output["sentence_embedding"].clone()
                    output["sentence_embedding"][0] = float("nan")
                    return output

                handle = model[1].register_forward_hook(poison)
        result = {}
        for mode in ("train", "eval"):
            start = time.monotonic()
            try:
                with torch.no_grad() if mode == "eval" else contextlib.nullcontext():
                    if case == "rows_engine" and rank == 1:
                        # what the loss's forward is to do with its own check's error: hand it to the engine
                        try:
                            check_columns(feats, "CachedMNRLoss")
                        except ValueError as exc:
                            loss.cache.raise_on_every_process(model, exc)
                    value = loss(feats, None)
                    if mode == "train":
                        value.backward()
                result[mode] = ("no error", "", time.monotonic() - start)
            except (ValueError, RuntimeError) as exc:
                result[mode] = (type(exc).__name__, str(exc), time.monotonic() - start)
        if handle is not None:
            handle.remove()
        model.zero_grad(set_to_none=True)
        value = loss(clean, None)
        value.backward()
        result["clean"] = (value.item(), bool(torch.isfinite(full_grads(model)).all()))
        out[case] = result
    return out


#: case -> (what rank 1 raises, a phrase of its cause)
FAILURES = {
    "no_mask": ("ValueError", "needs each row's token count"),
    "rows_engine": ("ValueError", "all columns must have the same number of rows"),
    "nan": ("ValueError", "non-finite (NaN or inf) values"),
}


def _check_failures(per_rank, cases) -> None:
    for case in cases:
        kind, cause = FAILURES.get(case, FAILURES["rows_engine"])
        for mode in ("train", "eval"):
            (kind0, msg0, t0), (kind1, msg1, t1) = (r[case][mode] for r in per_rank)
            where = f"{case} {mode}"
            assert kind1 == kind and cause in msg1, (where, kind1, msg1)
            if case == "nan":
                # found in the shape exchange of the loss stage: the same error on every rank
                assert kind0 == kind1 and msg0 == msg1 and "rank 1: column" in msg0, (where, msg0, msg1)
            else:
                # not gloo's "Connection closed by peer": the other rank names rank 1 and the cause
                assert kind0 == "RuntimeError" and "rank 1 of 2 failed" in msg0, (where, msg0)
                assert f"Rank 1: {msg1}" in msg0, (where, msg0, msg1)
            assert t0 < 30 and t1 < 30, (where, t0, t1)
        for rank, r in enumerate(per_rank):
            value, finite = r[case]["clean"]
            assert math.isfinite(value) and finite, (case, rank)


def test_failure_on_one_rank_fails_every_rank_through_the_loss(model_dir):
    """Only rank 1's input is bad, found by the engine's plan (no attention mask for a token budget), in
    the loss stage (NaN embeddings), or by the loss's own column check handed to the engine
    (``GradCache.raise_on_every_process``): every rank raises, in training and evaluation, in bounded
    time, and the next clean step works on every rank."""
    cases = list(FAILURES)
    start = time.monotonic()
    per_rank = run_distributed(_failure_worker, 2, model_dir, cases, timeout=180)
    assert time.monotonic() - start < 180
    _check_failures(per_rank, cases)


def test_column_check_on_one_rank_fails_every_rank_through_the_loss(model_dir):
    """A column with a different row count on rank 1 only, refused by CachedMNRLoss.forward's own check."""
    per_rank = run_distributed(_failure_worker, 2, model_dir, ["rows"], timeout=60)
    _check_failures(per_rank, ["rows"])
