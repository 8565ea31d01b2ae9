"""Train one epoch on three datasets of different sizes with the stock SentenceTransformerTrainer and a dict of
``CachedMNRLoss(gather_across_devices=True)``, one per dataset; run by ``tests/losses/test_same_dataset_sampler.py``
as ``accelerate launch --cpu --num_processes N -m tests.support.multi_dataset_train ...``.

At every optimizer step (before the optimizer moves the parameters, gradients all-reduced, no clipping) the
processes gather what each loss call saw (its dataset, its rows' anchors and positives); the main process
records, per micro-step and process, the dataset and the rows (each anchor begins with its row's id, token
``w<id>``), and compares the step's gradient with one process's gradient of the naive InfoNCE (the oracle) on
the same global batches (every micro-step's rows of every process, concatenated; averaged over micro-steps as
the trainer does). Writes ``{scenario: {"world": N, "steps": [...]}}`` as JSON to ``--out``.

Scenarios: ``same`` (``multi_dataset_batch_sampler="same_dataset"`` through CachedLossTrainingArguments,
``dataloader_drop_last=False``, checkpoints every ``--save-steps``), ``same_resume`` (``same`` resumed from its checkpoint at ``--save-steps``),
``same_rr_accum`` (a ``functools.partial`` of the class given to the stock arguments: round-robin, two
micro-batches per optimizer step on one dataset), ``round_robin`` (sentence-transformers' ROUND_ROBIN).
``--accumulation`` applies to ``same`` and ``same_resume`` (with ``same_dataset_per_optimizer_step``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {"a": 26, "b": 14, "c": 9}  # rows; batch 4 per process: uneven last batches
SPECIALS = 5  # the tiny tokenizer's special tokens come first: token id of "w<i>" = 5 + i


def _datasets(seed: int = 0) -> Any:
    from datasets import Dataset, DatasetDict

    from tests.support.tiny_model import random_texts

    out, start = {}, 0
    for name, n in SIZES.items():
        tails = random_texts(n, seed=seed + start, max_words=8)
        out[name] = Dataset.from_dict(
            {
                "anchor": [f"w{start + i} {t}" for i, t in enumerate(tails)],
                "positive": random_texts(n, seed=seed + 100 + start, max_words=8),
            }
        )
        start += n
    return DatasetDict(out)


class StepChecker:
    """Records each loss call's inputs (a forward pre-hook per loss) and, at each optimizer step, the step's
    datasets, rows and gradient error against the oracle (the main process)."""

    def __init__(self, model: Any, losses: dict[str, Any], accumulation: int) -> None:
        self.model = model
        self.accumulation = accumulation
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []
        self.steps: list[dict[str, Any]] = []
        for name, loss in losses.items():
            loss.register_forward_pre_hook(functools.partial(self._record, name))

    def _record(self, name: str, module: Any, args: tuple[Any, ...]) -> None:
        features = [{k: v.detach().clone() for k, v in f.items() if hasattr(v, "detach")} for f in args[0]]
        self.calls.append((name, features))

    def on_step(self) -> None:
        import torch
        import torch.distributed as dist

        from tests.support.reference import reference_infonce

        mine, self.calls = self.calls, []
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        if int(os.environ.get("RANK", "0")) != 0:
            return
        micro = len(everyone[0])
        assert all(len(calls) == micro for calls in everyone), [len(c) for c in everyone]
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        oracle = copy.deepcopy(self.model)
        oracle.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(micro):
            anchors = [oracle(calls[j][1][0])["sentence_embedding"] for calls in everyone]
            positives = [oracle(calls[j][1][1])["sentence_embedding"] for calls in everyone]
            loss = reference_infonce(torch.cat(anchors), [torch.cat(positives)], scale=20.0)
            # the trainer divides each micro-step's loss by the micro-steps of the optimizer step
            (loss / micro).backward()
            total += float(loss) / micro
        ref_params = [p for p in oracle.parameters() if p.requires_grad]
        ref = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in ref_params]
        )
        self.steps.append(
            {
                "datasets": [[calls[j][0] for calls in everyone] for j in range(micro)],
                "rows": [
                    [(calls[j][1][0]["input_ids"][:, 1] - SPECIALS).tolist() for calls in everyone]
                    for j in range(micro)
                ],
                "grad_error": float((grad - ref).norm() / ref.norm()),
                "grad_norm": float(ref.norm()),
                "loss": total,
            }
        )


def _train(
    model_path: str, out_dir: Path, scenario: str, save_steps: int, accumulation: int, epochs: int = 1
) -> dict[str, Any]:
    import torch
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import TrainerCallback

    import st_cached_losses
    from st_cached_losses import CachedLossTrainingArguments, SameDatasetBatchSampler

    torch.manual_seed(0)
    model = SentenceTransformer(model_path, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP would wait for its gradients
    losses = {
        name: st_cached_losses.CachedMNRLoss(model, mini_batch_size=3, gather_across_devices=True)
        for name in SIZES
    }
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common: dict[str, Any] = {
        "output_dir": str(out_dir / f"{scenario.removesuffix('_resume')}_{world}"),
        "per_device_train_batch_size": 4,
        "num_train_epochs": epochs,
        "learning_rate": 1e-3,
        "max_grad_norm": 0.0,  # no clipping: the gradients compared are the backward's
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "ddp_find_unused_parameters": False,
    }
    resume = None
    if scenario in ("same", "same_resume"):
        args: Any = CachedLossTrainingArguments(
            **{**common, "save_strategy": "steps", "save_steps": save_steps},
            multi_dataset_batch_sampler="same_dataset",
            same_dataset_per_optimizer_step=accumulation > 1,
            gradient_accumulation_steps=accumulation,
            mini_batch_size=3,
        )
        # sentence-transformers turns dataloader_drop_last on under DDP; off again, so that every dataset's
        # short last batch reaches the sampler (and a process holds fewer rows in that step)
        args.dataloader_drop_last = False
        if scenario == "same_resume":
            resume = str(Path(common["output_dir"]) / f"checkpoint-{save_steps}")
    elif scenario == "same_rr_accum":
        sampler = functools.partial(
            SameDatasetBatchSampler, order="round_robin", gradient_accumulation_steps=2
        )
        args = SentenceTransformerTrainingArguments(
            **common, multi_dataset_batch_sampler=sampler, gradient_accumulation_steps=2
        )
    elif scenario == "round_robin":
        args = SentenceTransformerTrainingArguments(**common, multi_dataset_batch_sampler="round_robin")
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    accumulation = args.gradient_accumulation_steps
    checker = StepChecker(model, losses, accumulation)

    class Check(TrainerCallback):
        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            checker.on_step()

    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=_datasets(), loss=losses, callbacks=[Check()]
    )
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.accelerator.num_processes == world, "accelerate must run the expected number of processes"
    return {"world": world, "steps": checker.steps, "global_step": trainer.state.global_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="same,same_resume,same_rr_accum,round_robin")
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    results = {
        name: _train(args.model, Path(args.out).parent, name, args.save_steps, args.accumulation, args.epochs)
        for name in args.scenarios.split(",")
    }
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    from tests.support.dist_utils import run_launched

    run_launched(main)
