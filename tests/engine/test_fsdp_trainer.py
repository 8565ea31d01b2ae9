"""Sharded models through the stock SentenceTransformerTrainer under ``accelerate launch`` (two
processes, each with half of every global batch, ``CachedMNRLoss(gather_across_devices=True)`` at
two rows per mini-batch): per-step training and evaluation losses and the parameters after two SGD
steps equal one plain process on the whole global batches.

* FSDP2 (``fsdp=True, fsdp_config={"version": 2, ...}``). On CPU, accelerate 1.15 drops the trainer's
  FSDP plugin without a word (``AcceleratorState.__init__`` in accelerate/state.py turns
  ``DistributedType`` into FSDP only from a MULTI_<accelerator> type, not from MULTI_CPU) and wraps the
  model in DDP; with ``use_cpu=False`` accelerate finds no accelerator, its state is
  ``DistributedType.NO`` (``PartialState._prepare_backend``: the CPU branch needs ``cpu=True``) and
  transformers refuses (``ValueError: Using fsdp only works in distributed training.``,
  ``Trainer.__init__`` in transformers/trainer.py). So on a
  machine with fewer than two GPUs the script sets the state to FSDP after the trainer built it
  (``tests/support/fsdp_train.py --force-cpu-fsdp``): the rest of the trainer's FSDP2 path (accelerate's
  ``fsdp2_prepare_model``, the optimizer on the sharded parameters, evaluation) runs as is on gloo, and
  the test checks that accelerate still drops the plugin (a change there shows here). With two GPUs it
  runs the unpatched path on NCCL. One reduce-scatter per FSDP2 parameter group per step, however
  many replays.
* DeepSpeed ZeRO-2 and ZeRO-3 on DeepSpeed's CPU accelerator (gloo), when ``deepspeed`` is installed
  (the first run compiles its shared-memory comm op, about two minutes). ZeRO-2's replays but the last
  back-propagate into ``.grad`` by hand (``sync.LocalBackward``); ZeRO-3's, whose parameters are
  partitioned, run inside DeepSpeed's ``coalesce_grad_reduction()`` (``sync.CoalescedBackward``): one
  gradient reduce-scatter per bucket per step, however many replays.
* A canary on torch's FSDP2 itself (no trainer, no cached loss): backward, a no-grad forward,
  ``zero_grad(set_to_none=True)``, backward doubles the root group's gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.dist_utils import accelerate_launch
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
#: run as a module from ROOT (every run's working directory), so that it imports this checkout's tests.support
SCRIPT = ["-m", "tests.support.fsdp_train"]
STEPS = 2
#: GPUs for the unpatched FSDP2 / DeepSpeed path: two processes cannot share one GPU under NCCL
ON_GPUS = torch.cuda.device_count() >= 2
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = (
    "deepspeed is not installed (it is in the dev extra: `make install`, or `.venv/bin/pip install deepspeed`: "
    "a pure-Python wheel built from the sdist; on CPU it JIT-compiles one comm op with the system C++ compiler "
    "and ninja)"
)


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not ON_GPUS:
        # a single GPU cannot hold two NCCL ranks: the CPU path, also where one GPU is present
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _run(cmd: list[str], out: Path, timeout: float = 600) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fsdp_trainer")
    model = make_tiny_model(base / "bert")
    model.save(str(base / "st"))
    return base / "st"


def _args(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--global-batch", "8", "--steps", str(STEPS), "--mini-batch-size", "2"]


@pytest.fixture(scope="module")
def one_process(model_dir: Path) -> dict:
    out = model_dir.parent / "one" / "out.json"
    out.parent.mkdir()
    return _run([sys.executable, *SCRIPT, *_args(model_dir), "--out", str(out)], out)


@pytest.fixture(scope="module")
def initial_params(model_dir: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model[0].auto_model.pooler = None
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _launch(model_dir: Path, name: str, *extra: str) -> dict:
    out = model_dir.parent / name / "out.json"
    out.parent.mkdir()
    return _run([*accelerate_launch(2), *SCRIPT, *_args(model_dir), "--out", str(out), *extra], out)


def _check_same_training(two: dict, one: dict, initial: torch.Tensor) -> None:
    assert two["world"] == 2 and one["world"] == 1
    assert len(two["losses"]) == STEPS and len(two["eval_losses"]) == STEPS
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["eval_losses"] == pytest.approx(one["eval_losses"], rel=1e-5)
    p2, p1 = torch.tensor(two["params"]), torch.tensor(one["params"])
    moved = (p1 - initial).abs().max().item()
    assert moved > 1e-2, "the steps must move the parameters for the comparison to mean anything"
    # one global tolerance over the whole vector (some gradients are analytically zero)
    err = (p2 - p1).abs().max().item()
    assert err <= 1e-4 * moved, f"parameters differ by {err:.2e} (the steps moved them by {moved:.2e})"


@pytest.mark.slow
def test_fsdp2_through_trainer_matches_one_process(model_dir, one_process, initial_params):
    extra = ["--fsdp"] if ON_GPUS else ["--fsdp", "--force-cpu-fsdp"]
    two = _launch(model_dir, "fsdp2", *extra)
    assert two["wrapper"].startswith("fsdp2"), two["wrapper"]
    if not ON_GPUS:
        # what accelerate did with the trainer's FSDP request before the script overrode it
        assert two["accelerate_before"] == {"distributed_type": "MULTI_CPU", "fsdp_plugin": False}, (
            "accelerate now keeps the FSDP plugin on CPU: drop --force-cpu-fsdp",
            two["accelerate_before"],
        )
    _check_same_training(two, one_process, initial_params)
    # 4 replays per step on each process (2 columns x 2 mini-batches), one reduce-scatter per group
    groups = two["fsdp_groups"]
    assert groups >= 3, "accelerate shards each BertLayer and the root"
    assert two["calls"]["reduce_scatter_single"] == STEPS * groups, two["calls"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_deepspeed_zero2_through_trainer_matches_one_process(
    model_dir, one_process, initial_params, tmp_path
):
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps(_zero_config(2)))
    two = _launch(model_dir, "zero2", "--deepspeed", str(config))
    assert two["wrapper"] == "deepspeed DeepSpeedEngine", two["wrapper"]
    _check_same_training(two, one_process, initial_params)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
def test_deepspeed_zero3_through_trainer_matches_one_process(
    model_dir, one_process, initial_params, tmp_path
):
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps(_zero_config(3)))
    two = _launch(model_dir, "zero3", "--deepspeed", str(config))
    assert two["wrapper"] == "deepspeed DeepSpeedEngine", two["wrapper"]
    _check_same_training(two, one_process, initial_params)
    # 4 replays per step on each process, one gradient reduce-scatter per step: the tiny model's
    # gradients fit in one of ZeRO-3's buckets (reduce_bucket_size), reduced once, after the last replay
    assert two["calls"]["deepspeed.reduce_scatter_fn"] == STEPS, two["calls"]


def _zero_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # the trainer's plain SGD, so that an update is the gradient times the learning rate
        "zero_allow_untested_optimizer": True,
    }


def _stale_root_worker(rank: int, world: int, path: str, root_reshard: bool | None) -> dict:
    """Plain (non-cached) backward twice; between them a no-grad forward and ``zero_grad`` in either
    order. Returns, per order, the ratio of the second backward's gradients to a clean one's, per
    parameter group (the root's: the embeddings; a layer's)."""
    from torch.distributed.fsdp import fully_shard

    from tests.engine.test_sharded import full_grads
    from tests.losses.test_distributed import load_model
    from tests.support.tiny_model import random_texts

    def build():
        model = load_model(path)
        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer)
        fully_shard(model, reshard_after_forward=root_reshard)  # None: FSDP2's default (False at the root)
        return model

    feats = load_model(path).preprocess(random_texts(4, seed=rank))

    def backward(model):
        model(dict(feats))["sentence_embedding"].pow(2).sum().backward()

    out = {}
    for order in ("clean", "no_grad_then_zero", "zero_then_no_grad"):
        model = build()
        backward(model)
        if order == "no_grad_then_zero":
            with torch.no_grad():
                model(dict(feats))
            model.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
            if order == "zero_then_no_grad":
                with torch.no_grad():
                    model(dict(feats))
        backward(model)
        out[order] = full_grads(model)
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    ratios = {}
    for order in ("no_grad_then_zero", "zero_then_no_grad"):
        ratio, start = {}, 0
        for name, size in zip(names, sizes):
            g, ref = out[order][start : start + size], out["clean"][start : start + size]
            start += size
            if ref.abs().max() > 0:
                group = "layer" if ".encoder.layer." in name else "root"
                ratio.setdefault(group, set()).add(round(float(g @ ref / (ref @ ref)), 4))
        ratios[order] = ratio
    return ratios


def test_fsdp2_stale_root_gradient_after_no_grad_forward(model_dir):
    """torch's FSDP2, not our code: backward -> a no-grad forward -> zero_grad(set_to_none=True) ->
    backward doubles the gradients of the root's parameter group when the root keeps its parameters
    gathered after forward (``reshard_after_forward=None``, FSDP2's default, resolves to False at the
    root; accelerate's ``fsdp2_prepare_model`` shards the root so). zero_grad before the no-grad forward
    (the trainer's order: ``model.zero_grad()`` after the optimizer step, evaluation after that) and a
    root with ``reshard_after_forward=True`` are exact. A canary: if torch fixes it, this fails."""
    from tests.support.dist_utils import run_distributed

    default, resharded = (
        run_distributed(_stale_root_worker, 2, str(model_dir), r, timeout=300)[0] for r in (None, True)
    )
    assert default["no_grad_then_zero"] == {"root": {2.0}, "layer": {1.0}}, default
    assert default["zero_then_no_grad"] == {"root": {1.0}, "layer": {1.0}}, default
    assert resharded["no_grad_then_zero"] == {"root": {1.0}, "layer": {1.0}}, resharded
