"""Does distilling a teacher's embeddings train a better student than plain in-batch training, and does the
listwise term (the teacher's softmax over every candidate of the batch) help, at equal steps x batch? (issue 61)

The data and the evaluation are ``teacher_bank_quality.py``'s (Python standard library: docstring summary ->
function source; each held-out summary retrieves its source among all held-out sources, MRR@10 by
sentence-transformers' ``InformationRetrievalEvaluator``). The teacher is the packaged all-MiniLM-L6-v2, the
student its first ``--student-layers`` layers (3; both 384-d, so no projection). The teacher embeds the training
queries and sources once, before training (no grad): its embeddings of each row's two texts are the label
column ``(batch, 2, 384)``. Every run is configured through ``CachedLossTrainingArguments`` / ``build_loss`` as a
user would, one epoch over the same (query, source) pairs at the same batch, seed and so data order, lr constant:

* ``infonce``: ``CachedMNRLoss`` on (query, source), no teacher;
* ``pointwise``: ``CachedEmbedDistillLoss``, cosine distance of each student embedding to the teacher's
  (EmbedDistillLoss's loss);
* ``listwise``: ``CachedEmbedDistillLoss`` with ``pointwise_weight=0``, ``listwise_weight=1``: per query, the KL of
  the student's softmax over every source of the batch from the teacher's (both at ``--listwise-scale``);
* ``listwise+infonce``: the same plus ``--infonce-weight`` x the in-batch InfoNCE term.

The teacher's and the untrained student's MRR@10 are the references. Every run is repeated for each of
``--seeds``; the table gives the median, the range over seeds and the difference from ``infonce``, and says
whether the difference exceeds the seed range (every seed of one run above, or below, every seed of the other).

Run: ``python benchmarks/embed_distill_quality.py --threads 1`` (``--runs`` a subset, ``--name`` another
results file). With the defaults (2,048 pairs, batch 64: 32 steps a run) it took 24.9 minutes on one thread of
the shared 2-core machine (1-minute load average 1.4-7.4 during the run); a run of 24 steps at batch 16 took
16 s of training there at a load of about 1. Writes ``benchmarks/results/embed_distill_quality.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import (
    ROOT,
    quality_arguments,
    quality_data,
    quality_evaluate,
    quality_setup,
    quality_train,
    truncate,
)

RESULTS = ROOT / "benchmarks" / "results"
RUNS = ("infonce", "pointwise", "listwise", "listwise+infonce")
FIELDS = ["run", "loss", "seed", "steps", "train_s", "MRR@10", "recall@10"]


def loss_fields(run: str, ns: argparse.Namespace) -> dict[str, Any]:
    """The ``CachedLossTrainingArguments`` loss fields of ``run``."""
    listwise = {"loss": "embed_distill", "pointwise_weight": 0.0, "listwise_weight": 1.0}
    listwise["listwise_scale"] = ns.listwise_scale
    return {
        "infonce": {"loss": "mnr", "scale": ns.scale},
        "pointwise": {"loss": "embed_distill", "distance_metric": "cosine"},
        "listwise": listwise,
        "listwise+infonce": listwise | {"infonce_weight": ns.infonce_weight, "infonce_scale": ns.scale},
    }[run]


def evaluate(model, evaluator) -> dict[str, float]:
    return quality_evaluate(model, evaluator, "MRR@10", "recall@10", digits=4)


def student_model(ns: argparse.Namespace):
    from st_cached_losses.demo import load_model

    return truncate(load_model(None, ns.max_seq_length), ns.student_layers)


def experiment(ns: argparse.Namespace, seeds: list[int], out_dir: str) -> list[dict[str, Any]]:
    import torch

    from st_cached_losses.demo import load_model

    pairs, _, evaluator = quality_data(ns.train_pairs, ns.eval_pairs)
    teacher = load_model(None, ns.max_seq_length)
    teacher.eval()
    t0 = time.perf_counter()
    with torch.no_grad():  # once, for every run and seed: (n, 2, 384), the query's and the source's
        columns = [teacher.encode(pairs[c], convert_to_tensor=True) for c in ("query", "document")]
    labelled = pairs.add_column("label", torch.stack(columns, dim=1).tolist())
    base = {"seed": "-", "steps": 0}
    rows = [{"run": "teacher (6 layers)", "loss": "-", **base, "train_s": round(time.perf_counter() - t0, 1)}]
    rows[-1] |= evaluate(teacher, evaluator)
    print(rows[-1], flush=True)
    del teacher
    rows.append({"run": "student, untrained", "loss": "-", **base, "train_s": 0.0})
    rows[-1] |= evaluate(student_model(ns), evaluator)
    print(rows[-1], flush=True)
    for seed in seeds:
        for run in ns.runs:
            fields = loss_fields(run, ns)
            dataset = pairs if fields["loss"] == "mnr" else labelled
            model = student_model(ns)
            args = quality_arguments(
                out_dir, ns.batch, ns.lr, seed, drop_last=True, mini_batch_size=ns.mini_batch, **fields
            )
            trainer, seconds, steps = quality_train(model, args, dataset)
            loss = type(trainer.loss).__name__
            rows.append(
                {"run": run, "loss": loss, "seed": seed, "steps": steps, "train_s": round(seconds, 1)}
            )
            rows[-1] |= evaluate(model, evaluator)
            print(rows[-1], flush=True)
            del model, trainer
            gc.collect()
    return rows


def summary_lines(rows: list[dict[str, Any]], n_seeds: int) -> list[str]:
    """Per run the median MRR@10 over seeds, its range, the difference from the first trained run and whether
    it exceeds the seeds' spread; the references first."""
    trained = [r for r in rows if r["seed"] != "-"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in trained:
        groups.setdefault(r["run"], []).append(r)
    names = list(groups)
    base = [r["MRR@10"] for r in groups[names[0]]] if names else []
    lines = [
        f"| run | loss | optimizer steps | train (s) | MRR@10 median (min-max of {n_seeds}) | recall@10 | "
        f"MRR@10 vs {names[0] if names else '-'} | beyond the seed range? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["seed"] == "-":
            lines.append(f"| {r['run']} | - | - | - | {r['MRR@10']:.4f} | {r['recall@10']:.4f} | | |")
    for name, group in groups.items():
        mrr = [r["MRR@10"] for r in group]
        if name == names[0]:
            verdict = ""
        elif n_seeds == 1:
            verdict = "one seed: unknown"
        elif min(mrr) > max(base) or max(mrr) < min(base):
            verdict = "yes: every seed on one side"
        else:
            verdict = "no: the seeds overlap"
        delta = statistics.median(mrr) - statistics.median(base)
        lines.append(
            f"| {name} | {group[0]['loss']} | {group[0]['steps']} | "
            f"{statistics.median(float(r['train_s']) for r in group):.0f} | {statistics.median(mrr):.4f} "
            f"({min(mrr):.4f}-{max(mrr):.4f}) | {statistics.median(r['recall@10'] for r in group):.4f} | "
            f"{delta:+.4f} | {verdict} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-pairs", type=int, default=2048, help="training (query, source) pairs")
    parser.add_argument("--eval-pairs", type=int, default=300, help="held-out pairs")
    parser.add_argument("--batch", type=int, default=64, help="pairs a step")
    parser.add_argument("--mini-batch", type=int, default=16, help="encoder mini-batch of every cached loss")
    parser.add_argument("--max-seq-length", type=int, default=48)
    parser.add_argument("--student-layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--scale", type=float, default=20.0, help="InfoNCE scale (1 / temperature)")
    parser.add_argument("--listwise-scale", type=float, default=20.0, help="both listwise softmaxes' scale")
    parser.add_argument("--infonce-weight", type=float, default=1.0, help="of the listwise+infonce run")
    parser.add_argument("--seeds", default="0,1", help="training seeds of every run (median and range)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {', '.join(RUNS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy machine)")
    parser.add_argument("--name", default="embed_distill_quality")
    ns = parser.parse_args()
    ns.runs = [r.strip() for r in ns.runs.split(",") if r.strip()]
    unknown = set(ns.runs) - set(RUNS)
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
    quality_setup(ns.threads)
    import torch

    seeds = [int(s) for s in ns.seeds.split(",")]
    command = shlex.join(["python", "benchmarks/embed_distill_quality.py", *sys.argv[1:]])
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = experiment(ns, seeds, tmp)
    minutes, load_after = (time.perf_counter() - started) / 60, os.getloadavg()
    setup = (
        f"teacher all-MiniLM-L6-v2 (6 layers), student its first {ns.student_layers} layers (both 384-d, no "
        f"projection); {ns.train_pairs} stdlib training pairs (1 epoch), the teacher's embeddings of both texts "
        f"as labels, computed once before training; {ns.eval_pairs} held out; batch {ns.batch}, mini-batch "
        f"{ns.mini_batch}, lr {ns.lr:g} constant, InfoNCE scale {ns.scale:g}, listwise scale {ns.listwise_scale:g} "
        f"(student and teacher), InfoNCE weight {ns.infonce_weight:g} in listwise+infonce"
    )
    section = [
        "# Distilling a teacher's embeddings: InfoNCE, pointwise, listwise (issue 61)",
        "",
        "Written by `benchmarks/embed_distill_quality.py` (its docstring: the set-up).",
        "",
        f"{setup}; max_seq_length {ns.max_seq_length}, seeds {ns.seeds}, {torch.get_num_threads()} CPU thread(s); "
        f"{minutes:.1f} min in all (training and evaluation)",
        "",
        f"`{command}`",
        "",
        f"Machine: {os.cpu_count()} CPUs, 1-minute load average {load_before[0]:.1f} at the start, "
        f"{load_after[0]:.1f} at the end (5-minute: {load_before[1]:.1f} / {load_after[1]:.1f}).",
        "",
        *summary_lines(rows, len(seeds)),
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{ns.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (RESULTS / f"{ns.name}.md").write_text("\n".join(section) + "\n")
    print("\n".join(section), flush=True)


if __name__ == "__main__":
    main()
