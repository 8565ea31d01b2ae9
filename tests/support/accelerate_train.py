"""Train a few steps with the stock SentenceTransformerTrainer, once per loss; used by the tests both as
``accelerate launch --cpu --num_processes 2 -m tests.support.accelerate_train ...`` (gather across processes)
and in a single process (the whole global batch), to compare the per-step losses.

Writes ``{loss_name: {"losses": [...], "params": [...]}}`` as JSON to ``--out`` (from the main process).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOSSES = {
    "mnr": ("CachedMNRLoss", {}),
    "clip": ("CachedCLIPLoss", {"learnable_scale": True, "scale": 10.0}),
    "tiled": ("CachedTiledLoss", {"symmetric": True, "tile_size": 3}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--losses", default="mnr,clip,tiled")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    import st_cached_losses
    from tests.support.tiny_model import random_texts

    results = {}
    for name in args.losses.split(","):
        cls_name, kwargs = LOSSES[name]
        model = SentenceTransformer(args.model, device="cpu")
        model[0].auto_model.pooler = None
        loss = getattr(st_cached_losses, cls_name)(
            model, mini_batch_size=3, gather_across_devices=True, **kwargs
        )
        n = args.global_batch * args.steps
        data = Dataset.from_dict({"anchor": random_texts(n, seed=1), "positive": random_texts(n, seed=2)})
        world = int(os.environ.get("WORLD_SIZE", "1"))
        training_args = SentenceTransformerTrainingArguments(
            output_dir=str(Path(args.out).parent / f"run_{name}_{world}"),
            per_device_train_batch_size=args.global_batch // world,
            max_steps=args.steps,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            data_seed=0,
            disable_tqdm=True,
            dataloader_drop_last=True,
            ddp_find_unused_parameters=False,
        )
        trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=data, loss=loss)
        trainer.train()
        assert trainer.accelerator.num_processes == world, (
            "accelerate must run the expected number of processes"
        )
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        results[name] = {
            "losses": losses,
            "param_norm": float(params.norm()),
            "param_sample": params[::97].tolist(),
            "scale": float(loss.scale),
            "world": world,
        }
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    from tests.support.dist_utils import run_launched

    run_launched(main)
