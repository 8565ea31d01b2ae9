"""Train a few steps of ``CachedMNRLoss(gather_across_devices=True)`` with the stock
SentenceTransformerTrainer, with the model sharded by the trainer (``--fsdp``: FSDP2 through
``fsdp_config={"version": 2, ...}``; ``--deepspeed CONFIG``: DeepSpeed ZeRO), or in one plain process
on the whole global batch (neither flag: the reference).

Used by ``tests/engine/test_fsdp_trainer.py`` as
``accelerate launch --multi_gpu --num_processes 2 -m tests.support.fsdp_train --fsdp ...`` and as
``python -m tests.support.fsdp_train ...``, from the repository root. SGD without momentum or weight decay, so that one step's update is
the gradient times the learning rate and the comparison is of gradients, not of Adam's normalisation.

Writes ``{"losses": [...], "params": [...], "world": W, "wrapper": ...}`` as JSON to ``--out`` (from
the main process).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def full_params(model) -> list[float]:
    """Every parameter, gathered in full where it is sharded (an FSDP2 DTensor or a ZeRO-3 partition);
    the same collective sequence on every process."""
    import torch

    parts = []
    for p in model.parameters():
        if hasattr(p, "full_tensor"):
            t = p.full_tensor()
        elif hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3 partition
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                t = p.detach().clone()
        else:
            t = p
        parts.append(t.detach().float().flatten())
    return torch.cat(parts).tolist()


class CollectiveCounter:
    """Counts FSDP2's collectives (it calls them through the ``torch.distributed`` module) and, with
    ``deepspeed=True``, DeepSpeed ZeRO's gradient reduce-scatters (``deepspeed.comm.reduce_scatter_fn``,
    which ZeRO-3 calls, through the module, once per bucket of gradients it reduces)."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self, deepspeed: bool = False) -> None:
        import torch.distributed as dist

        self.calls = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        if deepspeed:
            import deepspeed.comm as ds_comm

            self.calls["deepspeed.reduce_scatter_fn"] = 0
            ds_comm.reduce_scatter_fn = self._wrap("deepspeed.reduce_scatter_fn", ds_comm.reduce_scatter_fn)

    def _wrap(self, name, orig):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return orig(*args, **kwargs)

        return counted


def force_fsdp_on_cpu(trainer_cls):
    """A trainer class whose accelerator runs FSDP on gloo CPU processes.

    accelerate 1.15 (``AcceleratorState.__init__``, accelerate/state.py) sets ``DistributedType.FSDP``
    only when the state is one of the MULTI_<accelerator> types; on CPU (``use_cpu=True``: MULTI_CPU)
    the trainer's FSDP plugin is silently dropped and the model is wrapped in DDP. Everything after that
    gate (``fsdp2_prepare_model``: ``fully_shard`` per layer and at the root, the optimizer's parameters
    swapped for the sharded ones, ``no_sync``, clipping) is device-independent, so setting the state
    here runs the trainer's own FSDP2 path on gloo."""
    from accelerate.utils import DistributedType

    class CpuFsdpTrainer(trainer_cls):
        def create_accelerator_and_postprocess(self) -> None:
            plugin = None
            if self.args.fsdp_plugin_args is not None:
                from accelerate.utils import FullyShardedDataParallelPlugin

                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            # what accelerate made of the trainer's FSDP request (the test checks it: a change in
            # accelerate shows there)
            self.accelerate_before = {
                "distributed_type": DistributedType(state.distributed_type).value,
                "fsdp_plugin": getattr(state, "fsdp_plugin", None) is not None,
            }
            assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = plugin
            self.is_fsdp_enabled = True

    return CpuFsdpTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mini-batch-size", type=int, default=2)
    parser.add_argument("--layer-cls", default="BertLayer", help="the class FSDP2 shards one by one")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through the trainer's fsdp_config")
    parser.add_argument(
        "--force-cpu-fsdp",
        action="store_true",
        help="with --fsdp on a machine without an accelerator: turn accelerate's MULTI_CPU state into FSDP "
        "after the trainer built it (accelerate drops the FSDP plugin on CPU, see force_fsdp_on_cpu)",
    )
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config (ZeRO stage 2 or 3)")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.engine.wrappers import fsdp2_modules, is_deepspeed
    from tests.support.tiny_model import random_texts

    torch.set_num_threads(1)
    model = SentenceTransformer(args.model, device="cpu")
    model[0].auto_model.pooler = None
    loss = CachedMNRLoss(model, mini_batch_size=args.mini_batch_size, gather_across_devices=True)
    n = args.global_batch * args.steps
    data = Dataset.from_dict({"anchor": random_texts(n, seed=1), "positive": random_texts(n, seed=2)})
    # evaluated after every step: a no-grad forward of the sharded model between two training steps
    eval_data = Dataset.from_dict(
        {
            "anchor": random_texts(args.global_batch, seed=3),
            "positive": random_texts(args.global_batch, seed=4),
        }
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {}
    if args.fsdp:
        extra = {
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": [args.layer_cls],
                "reshard_after_forward": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
        }
    elif args.deepspeed:
        extra = {"deepspeed": args.deepspeed}
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.out).parent / f"run_{world}"),
        per_device_train_batch_size=args.global_batch // world,
        per_device_eval_batch_size=args.global_batch // world,
        eval_strategy="steps",
        eval_steps=1,
        max_steps=args.steps,
        learning_rate=0.5,
        optim="sgd",
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        # on CPU (gloo) the trainer needs use_cpu=True to see the processes at all
        use_cpu=args.force_cpu_fsdp or not torch.cuda.is_available(),
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
        ddp_find_unused_parameters=False,
        **extra,
    )
    trainer_cls = SentenceTransformerTrainer
    if args.fsdp and args.force_cpu_fsdp:
        trainer_cls = force_fsdp_on_cpu(SentenceTransformerTrainer)
    trainer = trainer_cls(
        model=model, args=training_args, train_dataset=data, eval_dataset=eval_data, loss=loss
    )
    counter = CollectiveCounter(deepspeed=bool(args.deepspeed))
    trainer.train()
    assert trainer.accelerator.num_processes == world, "accelerate must run the expected number of processes"
    wrapped = trainer.model_wrapped
    if args.fsdp:
        wrapper = f"fsdp2 ({len(fsdp2_modules(wrapped))} FSDPModules)"
        assert fsdp2_modules(wrapped), f"the trainer did not shard the model: {type(wrapped)}"
    elif args.deepspeed:
        wrapper = f"deepspeed {type(wrapped).__name__}"
        assert is_deepspeed(wrapped), f"the trainer did not wrap the model in DeepSpeed: {type(wrapped)}"
    else:
        wrapper = type(wrapped).__name__
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    eval_losses = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    groups = len(fsdp2_modules(wrapped))
    params = full_params(trainer.model)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "losses": losses,
                    "eval_losses": eval_losses,
                    "params": params,
                    "world": world,
                    "wrapper": wrapper,
                    "fsdp_groups": groups,
                    "calls": counter.calls,
                    "accelerate_before": getattr(trainer, "accelerate_before", None),
                }
            )
        )


if __name__ == "__main__":
    from tests.support.dist_utils import run_launched

    run_launched(main)
