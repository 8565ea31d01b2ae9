"""Does the BGE-style multi-dataset recipe train a better retriever: one task per batch, and self-guided
false-negative masking? At equal steps, on two tasks of batch_size_quality.py's data.

The packaged all-MiniLM-L6-v2 is fine-tuned for one epoch on two datasets of the Python standard library's
(docstring summary, function source) pairs, disjoint: ``summary_to_code`` (query: the summary) and
``code_to_summary`` (query: the source), with the same learning-rate schedule, batch and number of steps, by

* ``mixed``: one shuffled dataset of both tasks, so a batch mixes them (what every process's gathered
  negatives look like when sentence-transformers' samplers put another dataset on each process);
* ``per-task``: a ``DatasetDict`` with ``multi_dataset_batch_sampler="same_dataset"``: one task per batch;

each with ``CachedMNRLoss`` (``loss: mnr``) and with self-guided masking: ``CachedGISTLoss(model, guide=None,
margin=0.0, contrast_anchors=False, contrast_positives=False)`` (``loss: gist`` without ``guide_model``):
the anchor -> candidates terms of ``mnr`` with GIST's mask (a negative the model rates above the positive is
dropped; ``--margin -0.1`` for Qwen3-Embedding's, which masked nothing in a smoke run), at the same scale. Every run is configured through ``CachedLossTrainingArguments``
and ``build_loss``, as a user would. Evaluation: held-out pairs of each task (sentence-transformers'
``InformationRetrievalEvaluator``: each query's one relevant document among all held-out documents),
MRR@10 per task and their mean. This runs in one process, so "mixed" is the batch a process would see; the
cross-process effect itself is shown by ``tests/config/test_same_dataset_accelerate.py``.

Run: ``python benchmarks/recipe_quality.py`` (the defaults: 29 minutes at a load of about 11 on 2 cores;
``--quick`` for a smoke run). Writes ``benchmarks/results/recipe_quality.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import ROOT, quality_arguments, quality_evaluate, quality_setup, quality_train

RESULTS = ROOT / "benchmarks" / "results"
TASKS = ("summary_to_code", "code_to_summary")


def tasks(
    n_train: int, n_eval: int
) -> tuple[dict[str, list[tuple[str, str]]], dict[str, list[tuple[str, str]]]]:
    """Per task, disjoint training and held-out (query, document) pairs."""
    from st_cached_losses.demo.data import stdlib_pairs

    pairs = stdlib_pairs(limit=2 * (n_train + n_eval))
    half = len(pairs) // 2
    first, second = pairs[:half], [(doc, summary) for summary, doc in pairs[half:]]
    train = {TASKS[0]: first[n_eval:], TASKS[1]: second[n_eval:]}
    held_out = {TASKS[0]: first[:n_eval], TASKS[1]: second[:n_eval]}
    return train, held_out


def train_one(run: str, loss_name: str, seed: int, train: dict, ns: argparse.Namespace, out_dir: str):
    from datasets import Dataset, DatasetDict, concatenate_datasets

    from st_cached_losses.demo import load_model

    model = load_model(ns.model, ns.max_seq_length)
    parts = {
        name: Dataset.from_dict({"query": [q for q, _ in p], "document": [d for _, d in p]})
        for name, p in train.items()
    }
    per_task = run == "per-task"
    dataset: Any = (
        DatasetDict(parts) if per_task else concatenate_datasets(list(parts.values())).shuffle(seed=seed)
    )
    options: dict[str, Any] = {"loss": loss_name, "scale": ns.scale, "mini_batch_size": ns.mini_batch}
    if loss_name == "gist":  # self-guided (no guide_model): mnr's terms plus the mask
        options |= {"margin": ns.margin, "contrast_anchors": False, "contrast_positives": False}
    args = quality_arguments(
        out_dir,
        ns.batch,
        ns.lr,
        seed,
        drop_last=True,  # every run the same number of full batches
        **({"multi_dataset_batch_sampler": "same_dataset"} if per_task else {}),
        **options,
    )
    _, seconds, steps = quality_train(model, args, dataset)
    return model, seconds, steps


def evaluate(model, evaluators: dict) -> dict[str, float]:
    out = {name: quality_evaluate(model, ev, "MRR@10")["MRR@10"] for name, ev in evaluators.items()}
    out["mean"] = statistics.mean(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-pairs", type=int, default=64, help="training pairs per task")
    parser.add_argument("--eval-pairs", type=int, default=100, help="held-out pairs per task")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--max-seq-length", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--scale", type=float, default=20.0)
    parser.add_argument(
        "--margin", type=float, default=0.0, help="the self-guided mask's absolute margin (-0.1: Qwen3's)"
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--model", default=None, help="local SentenceTransformer (default: packaged MiniLM)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run: 32 pairs per task, batch 16")
    parser.add_argument("--name", default="recipe_quality")
    ns = parser.parse_args()
    if ns.quick:
        ns.train_pairs, ns.eval_pairs, ns.batch, ns.mini_batch, ns.name = 32, 32, 16, 8, f"{ns.name}_quick"
    quality_setup(ns.threads)
    import torch

    from st_cached_losses.demo import load_model, retrieval_evaluator

    train, held_out = tasks(ns.train_pairs - ns.train_pairs % ns.batch, ns.eval_pairs)
    evaluators = {n: retrieval_evaluator(p, name=n, show_progress_bar=False) for n, p in held_out.items()}
    started = time.perf_counter()
    rows: list[dict[str, Any]] = [
        {"run": "pretrained", "loss": "-", "seed": "-", "steps": 0, "train_s": 0.0}
        | evaluate(load_model(ns.model, ns.max_seq_length), evaluators)
    ]
    print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in ns.seeds.split(",")):
            for run in ("mixed", "per-task"):
                for loss_name in ("mnr", "gist"):
                    model, seconds, steps = train_one(run, loss_name, seed, train, ns, tmp)
                    rows.append(
                        {
                            "run": run,
                            "loss": loss_name,
                            "seed": seed,
                            "steps": steps,
                            "train_s": round(seconds, 1),
                        }
                        | evaluate(model, evaluators)
                    )
                    print(rows[-1], flush=True)
    total = time.perf_counter() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{ns.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    label = {"mnr": "CachedMNRLoss", "gist": f"CachedGISTLoss(guide=None, margin={ns.margin:g}), q->d terms"}
    lines = [
        f"all-MiniLM-L6-v2, two tasks x {ns.train_pairs - ns.train_pairs % ns.batch} training pairs (1 epoch), "
        f"{ns.eval_pairs} held-out pairs per task; batch {ns.batch}, mini-batch {ns.mini_batch}, max_seq_length "
        f"{ns.max_seq_length}, lr {ns.lr:g} constant, scale {ns.scale:g}, seeds {ns.seeds}, "
        f"{torch.get_num_threads()} CPU threads; {total / 60:.1f} min in all",
        "",
        f"`{shlex.join(['python', *sys.argv])}`",
        "",
        "| batches | loss | seed | optimizer steps | train (s) | MRR@10 summary->code | MRR@10 code->summary | mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['run']} | {label.get(r['loss'], '-')} | {r['seed']} | {r['steps']} | {r['train_s']} | "
        f"{r[TASKS[0]]:.4f} | {r[TASKS[1]]:.4f} | {r['mean']:.4f} |"
        for r in rows
    ]
    (RESULTS / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
