"""Do a negative bank and distillation from a teacher train a better retriever than plain in-batch training, at
equal compute (optimizer steps x batch)? (issue 44)

Two experiments on batch_size_quality.py's data (Python standard library: docstring summary -> function
source; held-out pairs: each summary retrieves its source among all held-out sources, MRR@10 by
sentence-transformers' ``InformationRetrievalEvaluator``), every run configured through
``CachedLossTrainingArguments`` / ``build_loss`` as a user would, one epoch over the same training pairs, with
the same seed and so the same data order, lr constant:

* ``--experiment bank``: the packaged all-MiniLM-L6-v2 trained with ``CachedMNRLoss`` at a small batch
  (``--bank-batch``, 8) without a bank, and with ``negative_bank_size`` = each of ``--bank-sizes`` (max age
  each of ``--bank-max-age``, default None: the size alone decides), the same steps; and, as the reference, without a bank at
  ``--bank-batch x --reference-factor`` (64): the same pairs in fewer, bigger steps (the same steps x batch).
* ``--experiment distill``: the student is the packaged MiniLM cut to its first ``--student-layers`` layers
  (2), the teacher the whole model. The teacher scores the training data once, before training (no grad):
  for each training query it mines ``--negatives`` hard negatives (the training sources it ranks highest, the
  query's own excluded; ``examples/train_cached_distill.py``'s ``distillation_dataset``), and its cosine
  scores of the positive and those negatives are the label column. At the same batch (``--distill-batch``
  queries) and steps: ``CachedMNRLoss`` in-batch on (query, positive) alone; ``CachedMNRLoss`` with the mined
  hard negatives (the same texts a step as the distillation runs); ``CachedDistillKLDivLoss`` (temperature
  ``--temperature``); and ``CachedDistillKLDivLoss`` plus ``--infonce-weight`` x the in-batch InfoNCE term.
  The teacher's own MRR@10 is the ceiling.

Every run is repeated for each of ``--seeds``; the table gives the median, the range over seeds and the
difference from the baseline run, and says whether the difference exceeds the seed range.

Run: ``python benchmarks/teacher_bank_quality.py --experiment both`` (``--quick``: a smoke run, written to
``teacher_bank_quality_quick.*``). With the defaults and ``--threads 1`` each experiment took about 30 minutes
on 2 cores next to other jobs (load 7-13); a batch-8 run took 49 s at a load of about 1 against about 210 s
then, so about 7 minutes an experiment on an idle machine (estimated, not measured). On a busy machine pass
``--threads 1``: with 2 threads a training step ran 3-6x slower there. Writes ``benchmarks/results/teacher_bank_quality.{csv,md}``; running one
experiment replaces its own rows and section and keeps the other's.
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
EXPERIMENTS = ("bank", "distill")
FIELDS = ["experiment", "run", "loss", "batch", "negatives", "bank", "seed", "steps", "train_s", "MRR@10"]
FIELDS += ["recall@10"]


def training_args(out_dir: str, batch: int, lr: float, seed: int, ns: argparse.Namespace, **loss: Any):
    """The quality runs' trainer arguments (``_common.quality_arguments``): whole batches only, the same
    pairs for every batch size."""
    return quality_arguments(out_dir, batch, lr, seed, drop_last=True, mini_batch_size=ns.mini_batch, **loss)


def evaluate(model, evaluator) -> dict[str, float]:
    return quality_evaluate(model, evaluator, "MRR@10", "recall@10", digits=4)


def row(experiment: str, run: str, loss: str, **values: Any) -> dict[str, Any]:
    base = {"batch": "-", "negatives": 0, "bank": 0, "seed": "-", "steps": 0, "train_s": 0.0}
    return {"experiment": experiment, "run": run, "loss": loss} | base | values


# ---------------------------------------------------------------------------------------------- bank


def bank_experiment(ns: argparse.Namespace, seeds: list[int], out_dir: str) -> list[dict[str, Any]]:
    from st_cached_losses.demo import load_model

    dataset, _, evaluator = quality_data(ns.bank_train_pairs, ns.eval_pairs)
    small, big = ns.bank_batch, ns.bank_batch * ns.reference_factor
    runs = [(f"b={small}", small, 0, None)] + [
        (f"b={small} + bank {n}" + (f" max age {age}" if age else ""), small, n, age)
        for n in ns.bank_sizes
        for age in ns.bank_max_age
    ]
    if ns.false_negative_filter:  # each small-batch run again with the positive-aware filter (issue 60)
        margin = ns.false_negative_margin
        label = f" + filter {ns.false_negative_filter}" + (f" {margin}" if margin is not None else "")
        runs += [
            (name + label, batch, bank, age, ns.false_negative_filter) for name, batch, bank, age in runs
        ]
    if ns.reference_factor > 1:
        runs.append((f"b={big} (reference)", big, 0, None))
    rows = [row("bank", "pretrained", "-") | evaluate(load_model(None, ns.max_seq_length), evaluator)]
    print(rows[-1], flush=True)
    for seed in seeds:
        for name, batch, bank, max_age, *filtered in runs:
            model = load_model(None, ns.max_seq_length)
            bank_options = {"negative_bank_size": bank, "negative_bank_max_age": max_age}
            if filtered:
                bank_options.update(
                    false_negative_filter=filtered[0], false_negative_margin=ns.false_negative_margin
                )
            args = training_args(out_dir, batch, ns.lr, seed, ns, loss="mnr", scale=ns.scale, **bank_options)
            _, seconds, steps = quality_train(model, args, dataset)
            rows.append(
                row("bank", name, "CachedMNRLoss", batch=batch, bank=bank, seed=seed, steps=steps,
                    train_s=round(seconds, 1)) | evaluate(model, evaluator)
            )  # fmt: skip
            print(rows[-1], flush=True)
            del model
            gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------- distill


def distill_experiment(ns: argparse.Namespace, seeds: list[int], out_dir: str) -> list[dict[str, Any]]:
    import torch

    from examples.train_cached_distill import distillation_dataset
    from st_cached_losses.demo import load_model

    pairs_dataset, _, evaluator = quality_data(ns.distill_train_pairs, ns.eval_pairs)
    pairs = list(zip(pairs_dataset["query"], pairs_dataset["document"]))
    teacher = load_model(None, ns.max_seq_length)
    teacher.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        scored = distillation_dataset(teacher, pairs, ns.negatives)  # once, for every run and seed
    scoring_s = time.perf_counter() - t0
    rows = [
        row("distill", "teacher (6 layers)", "-", train_s=round(scoring_s, 1)) | evaluate(teacher, evaluator)
    ]
    print(rows[-1], flush=True)
    del teacher
    student = f"student ({ns.student_layers} layers)"
    rows.append(row("distill", f"{student}, pretrained", "-") | evaluate(student_model(ns), evaluator))
    print(rows[-1], flush=True)
    texts = ["query", "positive"] + [f"negative_{j + 1}" for j in range(ns.negatives)]
    kl = {"loss": "distill_kl", "temperature": ns.temperature, "infonce_scale": ns.scale}
    runs: list[tuple[str, str, Any, dict[str, Any]]] = [
        ("in-batch", "CachedMNRLoss", scored.select_columns(texts[:2]), {"loss": "mnr", "scale": ns.scale}),
        ("in-batch + mined negatives", "CachedMNRLoss", scored.select_columns(texts),
         {"loss": "mnr", "scale": ns.scale}),
        ("distill KL", "CachedDistillKLDivLoss", scored, kl | {"infonce_weight": 0.0}),
        (f"distill KL + InfoNCE {ns.infonce_weight:g}", "CachedDistillKLDivLoss", scored,
         kl | {"infonce_weight": ns.infonce_weight}),
    ]  # fmt: skip
    for seed in seeds:
        for name, loss_name, dataset, loss in runs:
            model = student_model(ns)
            args = training_args(out_dir, ns.distill_batch, ns.distill_lr, seed, ns, **loss)
            _, seconds, steps = quality_train(model, args, dataset)
            negatives = len(dataset.column_names) - 2 - ("label" in dataset.column_names)
            rows.append(
                row("distill", f"{student}, {name}", loss_name, batch=ns.distill_batch, negatives=negatives,
                    seed=seed, steps=steps, train_s=round(seconds, 1)) | evaluate(model, evaluator)
            )  # fmt: skip
            print(rows[-1], flush=True)
            del model
            gc.collect()
    return rows


def student_model(ns: argparse.Namespace):
    from st_cached_losses.demo import load_model

    return truncate(load_model(None, ns.max_seq_length), ns.student_layers)


# ---------------------------------------------------------------------------------------------- report


def summary_lines(rows: list[dict[str, Any]], n_seeds: int) -> list[str]:
    """The table of one experiment: per run the median MRR@10 over seeds, its range, the difference from
    the first trained run (the baseline) and whether it exceeds the seeds' spread."""
    trained = [r for r in rows if r["seed"] != "-"]
    names = list(dict.fromkeys(r["run"] for r in trained))
    groups = {n: [r for r in trained if r["run"] == n] for n in names}
    base = groups[names[0]] if names else []
    base_mrr = [r["MRR@10"] for r in base]
    lines = [
        f"| run | loss | batch | hard negatives | bank | optimizer steps | train (s) | MRR@10 (min-max of {n_seeds}) "
        f"| recall@10 | MRR@10 vs {names[0] if names else '-'} | beyond the seed range? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["seed"] == "-":
            lines.append(
                f"| {r['run']} | - | - | - | - | - | - | {r['MRR@10']:.4f} | {r['recall@10']:.4f} | | |"
            )
    for name, group in groups.items():
        mrr = [r["MRR@10"] for r in group]
        median = statistics.median(mrr)
        delta = median - statistics.median(base_mrr)
        if group is base:
            verdict = ""
        elif n_seeds == 1:
            verdict = "one seed: unknown"
        elif min(mrr) > max(base_mrr) or max(mrr) < min(base_mrr):
            verdict = "yes: every seed on one side"
        else:
            verdict = "no: the seeds overlap"
        first = group[0]
        lines.append(
            f"| {name} | {first['loss']} | {first['batch']} | {first['negatives']} | {first['bank']} | "
            f"{first['steps']} | {statistics.median(float(r['train_s']) for r in group):.0f} | {median:.4f} "
            f"({min(mrr):.4f}-{max(mrr):.4f}) | {statistics.median(r['recall@10'] for r in group):.4f} | "
            f"{delta:+.4f} | {verdict} |"
        )
    return lines


def write_results(name: str, experiment: str, rows: list[dict[str, Any]], section: list[str]) -> None:
    """Replace ``experiment``'s rows in ``<name>.csv`` and its section in ``<name>.md``, keep the others'."""
    import fcntl

    RESULTS.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = RESULTS / f"{name}.csv", RESULTS / f"{name}.md"
    with open(os.path.join(tempfile.gettempdir(), f"{name}.lock"), "w") as lock:  # experiments side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write_results(csv_path, md_path, experiment, rows, section)


def _write_results(
    csv_path, md_path, experiment: str, rows: list[dict[str, Any]], section: list[str]
) -> None:
    kept: list[dict[str, Any]] = []
    if csv_path.exists():
        with open(csv_path) as f:
            kept = [r for r in csv.DictReader(f) if r["experiment"] != experiment]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for e in EXPERIMENTS:
            writer.writerows(rows if e == experiment else [r for r in kept if r["experiment"] == e])
    sections = {e: "" for e in EXPERIMENTS}
    if md_path.exists():
        for chunk in md_path.read_text().split("<!-- experiment: ")[1:]:
            key, _, body = chunk.partition(" -->\n")
            sections[key] = body
    sections[experiment] = "\n".join(section) + "\n\n"
    header = (
        "# Negative bank and distillation against plain in-batch training (issue 44)\n\n"
        "Written by `benchmarks/teacher_bank_quality.py` (its docstring: the set-up); each experiment's "
        "section by its own run.\n\n"
    )
    body = "".join(f"<!-- experiment: {e} -->\n{sections[e]}" for e in EXPERIMENTS if sections[e])
    md_path.write_text(header + body.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", choices=("bank", "distill", "both"), default="both")
    parser.add_argument("--eval-pairs", type=int, default=300, help="held-out pairs (both experiments)")
    parser.add_argument("--max-seq-length", type=int, default=48)
    parser.add_argument("--mini-batch", type=int, default=8, help="encoder mini-batch of every cached loss")
    parser.add_argument("--scale", type=float, default=20.0, help="InfoNCE scale (1 / temperature)")
    parser.add_argument("--seeds", default="0,1", help="training seeds of every run (median and range)")
    bank = parser.add_argument_group("--experiment bank")
    bank.add_argument("--bank-train-pairs", type=int, default=384)
    bank.add_argument("--bank-batch", type=int, default=8)
    bank.add_argument(
        "--bank-sizes", default="64", help="negative_bank_size of the bank runs, comma-separated"
    )
    bank.add_argument(
        "--reference-factor", type=int, default=8, help="reference batch = bank batch x this (1: none)"
    )
    bank.add_argument(
        "--bank-max-age",
        default="none",
        help="negative_bank_max_age of the bank runs, comma-separated, one run per size and age ('none': None)",
    )
    bank.add_argument("--lr", type=float, default=1e-4)
    bank.add_argument(
        "--false-negative-filter",
        choices=("relative", "absolute"),
        default=None,
        help="also run each small-batch run with this false-negative filter (issue 60)",
    )
    bank.add_argument(
        "--false-negative-margin", type=float, default=None, help="its margin (default: the loss's)"
    )
    distill = parser.add_argument_group("--experiment distill")
    distill.add_argument("--distill-train-pairs", type=int, default=384)
    distill.add_argument("--distill-batch", type=int, default=16, help="queries a step")
    distill.add_argument(
        "--negatives", type=int, default=3, help="hard negatives a query, mined by the teacher"
    )
    distill.add_argument("--student-layers", type=int, default=2)
    distill.add_argument("--temperature", type=float, default=0.05, help="both softmaxes of the KL")
    distill.add_argument("--infonce-weight", type=float, default=0.1)
    distill.add_argument("--distill-lr", type=float, default=2e-4)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch CPU threads (default: torch's; 1 on a busy machine, where 2 ran a step 3-6x slower)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 64 pairs, 64 held out, one seed")
    parser.add_argument("--name", default="teacher_bank_quality")
    ns = parser.parse_args()
    ns.bank_sizes = [int(s) for s in ns.bank_sizes.split(",") if s.strip()]
    ns.bank_max_age = [None if a.strip().lower() == "none" else int(a) for a in ns.bank_max_age.split(",")]
    if ns.quick:
        ns.bank_train_pairs = ns.distill_train_pairs = ns.eval_pairs = 64
        ns.seeds, ns.name = "0", f"{ns.name}_quick"
    quality_setup(ns.threads)
    import torch

    seeds = [int(s) for s in ns.seeds.split(",")]
    experiments = EXPERIMENTS if ns.experiment == "both" else (ns.experiment,)
    command = shlex.join(["python", "benchmarks/teacher_bank_quality.py", *sys.argv[1:]])
    for experiment in experiments:
        load_before = os.getloadavg()
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            run = bank_experiment if experiment == "bank" else distill_experiment
            rows = run(ns, seeds, tmp)
        minutes = (time.perf_counter() - started) / 60
        load_after = os.getloadavg()
        if experiment == "bank":
            setup = (
                f"all-MiniLM-L6-v2, {ns.bank_train_pairs} stdlib training pairs (1 epoch), {ns.eval_pairs} held "
                f"out; CachedMNRLoss, mini-batch {ns.mini_batch}, scale {ns.scale:g}, lr {ns.lr:g} constant; "
                f"bank sizes {ns.bank_sizes}, max ages {ns.bank_max_age} (None: the size alone decides)"
            )
        else:
            setup = (
                f"teacher all-MiniLM-L6-v2, student its first {ns.student_layers} layers; {ns.distill_train_pairs} "
                f"stdlib training queries (1 epoch) with {ns.negatives} hard negatives each mined by the teacher "
                f"(its top-ranked training sources, the query's own excluded) and the teacher's cosine scores as "
                f"labels, computed once before training; {ns.eval_pairs} held out; batch {ns.distill_batch} "
                f"queries, mini-batch {ns.mini_batch}, lr {ns.distill_lr:g} constant, KL temperature "
                f"{ns.temperature:g}, InfoNCE scale {ns.scale:g}"
            )
        section = [
            f"## {experiment}",
            "",
            f"{setup}; max_seq_length {ns.max_seq_length}, seeds {ns.seeds}, {torch.get_num_threads()} CPU "
            f"threads; {minutes:.1f} min in all (training and evaluation)",
            "",
            f"`{command}`",
            "",
            f"Machine: {os.cpu_count()} CPUs, 1-minute load average {load_before[0]:.1f} at the start, "
            f"{load_after[0]:.1f} at the end (5-minute: {load_before[1]:.1f} / {load_after[1]:.1f}).",
            "",
            *summary_lines(rows, len(seeds)),
        ]
        write_results(ns.name, experiment, rows, section)
        print("\n".join(section), flush=True)


if __name__ == "__main__":
    main()
