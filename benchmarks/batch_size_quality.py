"""Does a bigger contrastive batch train a better retriever, at the same number of pairs seen? (GradCache's
finding, on our data.)

all-MiniLM-L6-v2 (packaged, offline) is fine-tuned for one epoch on the same training pairs from the Python
standard library (docstring summary -> function source), with the same learning-rate schedule, by

* ``mnrl b=8``: sentence-transformers' non-cached ``MultipleNegativesRankingLoss`` at batch 8: what fits
  in the memory of an 8-row encoder forward without caching;
* ``cached b=64 / 256 / 1024``: our ``CachedMNRLoss`` with ``mini_batch_size=8``: the same memory, a
  larger batch (more in-batch negatives, fewer optimizer steps);

and every model (and the pretrained one) is evaluated on held-out pairs: each docstring summary
retrieves its function among all held-out sources (sentence-transformers' InformationRetrievalEvaluator),
recall@10 and MRR@10. The cached runs are configured through ``CachedLossTrainingArguments`` /
``build_loss``, as a user would. Every run is repeated with several training seeds (data order and
dropout; the held-out pairs stay the same): the table gives the median and the range over seeds, so a
difference can be told apart from run-to-run noise.

Run: ``.venv/bin/python benchmarks/batch_size_quality.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/batch_size_quality.{csv,md,png}``.

``--scale-sweep`` asks another question, on the same data and evaluation: does a learnable temperature find
a scale at least as good as the best fixed one? It trains ``CachedCLIPLoss`` (and ``CachedMNRLoss``, see
``--sweep-losses``) at each fixed scale of ``--sweep-scales``, then ``CachedCLIPLoss(learnable_scale=True)``
from scale ``--scale`` with the learnable scale at ``CachedLossTrainingArguments``' default
``scale_learning_rate`` (its own optimizer group) and, for reference, at the plain ``learning_rate``
(``scale_learning_rate=0``); it records the scale after every optimizer step. Writes
``benchmarks/results/scale_sweep.{md,json}``. ``--learnable-starts 10,50`` starts the learnable runs from
each of these scales instead of ``--scale``; ``--sweep-losses ''`` skips the fixed runs and ``--sweep-name``
sets the results file stem.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, quality_arguments, quality_data, quality_evaluate, quality_setup, quality_train

RESULTS = ROOT / "benchmarks" / "results"


def train_one(batch: int, cached: bool, seed: int, train_dataset, args_ns, out_dir: str):
    """Fine-tune a fresh MiniLM with the non-cached loss (``cached=False``) or CachedMNRLoss; returns
    the model and the training time."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from st_cached_losses.demo import load_model

    model = load_model(args_ns.model, args_ns.max_seq_length)
    if cached:
        args = quality_arguments(
            out_dir, batch, args_ns.lr, seed, schedule=args_ns.schedule, loss="mnr", scale=args_ns.scale,
            mini_batch_size=args_ns.mini_batch,
        )  # fmt: skip
        loss = None  # the arguments' loss (build_loss)
    else:
        args = quality_arguments(out_dir, batch, args_ns.lr, seed, schedule=args_ns.schedule, cached=False)
        loss = MultipleNegativesRankingLoss(model, scale=args_ns.scale)
    trainer, seconds, _ = quality_train(model, args, train_dataset, loss)
    return model, seconds, trainer.state.global_step


def plot(summary: list[dict], path: Path, title: str) -> None:
    """Median over seeds, bars from the worst to the best seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    before = summary[0]
    for ax, metric in zip(axes, ("recall@10", "MRR@10")):
        for loss, style, label in (
            ("CachedMNRLoss", "o-", "CachedMNRLoss (mini-batch 8)"),
            ("MultipleNegativesRankingLoss", "s", "MNRL, no cache"),
        ):
            group = [r for r in summary if r["loss"] == loss]
            medians = [r[metric] for r in group]
            errors = [
                [m - r[f"{metric}_min"] for m, r in zip(medians, group)],
                [r[f"{metric}_max"] - m for m, r in zip(medians, group)],
            ]
            ax.errorbar(
                [r["batch"] for r in group], medians, yerr=errors, fmt=style, ms=7, capsize=4, label=label
            )
        ax.axhline(before[metric], ls="--", color="gray", label="pretrained")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (same pairs seen, same LR schedule)")
        ax.set_ylabel(f"{metric} (median, min-max over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-pairs", type=int, default=4000)
    parser.add_argument("--eval-pairs", type=int, default=1000)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=8, help="encoder mini-batch of the cached loss")
    parser.add_argument("--baseline-batch", type=int, default=8, help="batch of the non-cached loss")
    parser.add_argument("--batches", default="64,256,1024", help="batches of the cached loss")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--schedule", default="constant", help="lr_scheduler_type, the same for every run")
    parser.add_argument("--scale", type=float, default=20.0)
    parser.add_argument("--model", default=None, help="local SentenceTransformer (default: packaged MiniLM)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds of every run (median and range)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 128 pairs, batches 8 and 32, one seed"
    )
    parser.add_argument("--name", default="batch_size_quality")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy machine)"
    )
    sweep = parser.add_argument_group("--scale-sweep: fixed temperatures against a learnable one")
    sweep.add_argument("--scale-sweep", action="store_true", help="run the temperature sweep instead")
    sweep.add_argument("--sweep-scales", default="10,20,30,50", help="the fixed scales (1 / temperature)")
    sweep.add_argument("--sweep-losses", default="clip,mnr", help="losses of the fixed scales: clip, mnr")
    sweep.add_argument("--sweep-batch", type=int, default=64, help="batch of every sweep run")
    sweep.add_argument(
        "--scale-lrs",
        default="default",
        help="scale_learning_rate of the learnable runs, one run each ('default': CachedLossTrainingArguments' "
        "default)",
    )
    sweep.add_argument(
        "--no-plain-rate-run",
        action="store_true",
        help="skip the learnable run at the plain learning_rate (scale_learning_rate=0)",
    )
    sweep.add_argument(
        "--learnable-starts",
        default=None,
        help="start scales of the learnable runs, e.g. 10,50; each with every --scale-lrs rate (and the plain "
        "rate) (default: --scale)",
    )
    sweep.add_argument(
        "--sweep-name",
        default="scale_sweep",
        help="results file stem under benchmarks/results/ (an empty --sweep-losses skips the fixed runs)",
    )
    args = parser.parse_args()
    quality_setup(args.threads)
    if args.scale_sweep:
        scale_sweep(args)
        return
    if args.quick:
        args.train_pairs, args.eval_pairs, args.batches, args.seeds = 128, 100, "32", "0"
        args.name = f"{args.name}_quick"
    batches = [int(b) for b in args.batches.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]

    import torch

    from st_cached_losses.demo import load_model

    train_dataset, held_out, evaluator = quality_data(args.train_pairs, args.eval_pairs)
    print(
        f"{len(train_dataset)} training pairs, {len(held_out)} held-out pairs, max_seq_length {args.max_seq_length}, "
        f"lr {args.lr:g} ({args.schedule}), scale {args.scale:g}, {torch.get_num_threads()} threads",
        flush=True,
    )
    rows: list[dict] = []  # one per (run, seed)
    model = load_model(args.model, args.max_seq_length)
    t0 = time.perf_counter()
    rows.append(
        {
            "run": "pretrained",
            "loss": "-",
            "batch": 0,
            "mini_batch": 0,
            "seed": "-",
            "steps": 0,
            "train_s": 0.0,
        }
        | quality_evaluate(model, evaluator)
    )
    print(f"pretrained: {rows[-1]} ({time.perf_counter() - t0:.0f} s to evaluate)", flush=True)
    del model
    runs = [(f"mnrl b={args.baseline_batch}", args.baseline_batch, False)] + [
        (f"cached b={b}", b, True) for b in batches
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, batch, cached in runs:
                model, seconds, steps = train_one(batch, cached, seed, train_dataset, args, tmp)
                row = {
                    "run": name,
                    "loss": "CachedMNRLoss" if cached else "MultipleNegativesRankingLoss",
                    "batch": batch,
                    "mini_batch": args.mini_batch if cached else batch,
                    "seed": seed,
                    "steps": steps,
                    "train_s": round(seconds, 1),
                } | quality_evaluate(model, evaluator)
                rows.append(row)
                print(f"{name}, seed {seed}: {row}", flush=True)
                del model
                gc.collect()

    RESULTS.mkdir(parents=True, exist_ok=True)
    fields = ["run", "loss", "batch", "mini_batch", "seed", "steps", "train_s", *METRICS]
    with open(RESULTS / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    title = (
        f"all-MiniLM-L6-v2, {len(train_dataset)} stdlib training pairs (1 epoch), {len(held_out)} held-out; "
        f"max_seq_length {args.max_seq_length}, lr {args.lr:g} {args.schedule}, scale {args.scale:g}, "
        f"seeds {args.seeds}, {torch.get_num_threads()} CPU threads"
    )
    summary = summarise(rows, [name for name, _, _ in runs])
    lines = [title, "", *markdown_table(summary, len(seeds))]
    base = summary[1]
    cached = [r for r in summary if r["loss"] == "CachedMNRLoss"]
    # a win that noise cannot explain: every seed of the cached run above every seed of the baseline
    clear = [r for r in cached if r["MRR@10_min"] > base["MRR@10_max"]]
    median_wins = [r for r in cached if r["MRR@10"] > base["MRR@10"] and r["recall@10"] >= base["recall@10"]]
    lines += [
        "",
        f"- cached runs beating `{base['run']}` on median MRR@10 without losing median recall@10: "
        f"{len(median_wins)} of {len(cached)} ({', '.join(r['run'] for r in median_wins) or 'none'})",
        f"- cached runs whose worst seed beats the best seed of `{base['run']}` on MRR@10: "
        f"{len(clear)} of {len(cached)} ({', '.join(r['run'] for r in clear) or 'none'})",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    plot(summary, RESULTS / f"{args.name}.png", title)
    print("\n".join(lines))


METRICS = ["recall@1", "recall@10", "MRR@10", "NDCG@10"]


# ---------------------------------------------------------------------------------------------- scale sweep


def train_sweep_run(run: dict[str, Any], seed: int, train_dataset, args_ns, out_dir: str):
    """Fine-tune a fresh MiniLM with the cached loss ``run`` describes (``loss``, ``scale``, and for a
    learnable scale ``scale_learning_rate``); returns the model, the training time, the number of steps
    and the scale after each optimizer step (its start value first)."""
    from sentence_transformers import SentenceTransformerTrainer
    from transformers import TrainerCallback

    from st_cached_losses import build_loss
    from st_cached_losses.demo import load_model

    model = load_model(args_ns.model, args_ns.max_seq_length)
    learnable = run["learnable"]
    extra: dict[str, Any] = {}
    if learnable and run["scale_learning_rate"] is not None:
        extra["scale_learning_rate"] = run["scale_learning_rate"]
    args = quality_arguments(
        out_dir,
        args_ns.sweep_batch,
        args_ns.lr,
        seed,
        schedule=args_ns.schedule,
        loss=run["loss"],
        scale=run["scale"],
        learnable_scale=learnable,
        mini_batch_size=args_ns.mini_batch,
        **extra,
    )
    loss = build_loss(model, args)
    scales = [loss.scale]

    class RecordScale(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            scales.append(loss.scale)

    if learnable:  # what the trainer's optimizer gives the scale
        probe = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)
        optimizer = probe.create_optimizer()
        run["scale_group_lr"] = next(
            g["lr"] for g in optimizer.param_groups if any(p is loss.logit_scale for p in g["params"])
        )
    _, seconds, steps = quality_train(model, args, train_dataset, loss, callbacks=[RecordScale()])
    return model, seconds, steps, scales


def scale_sweep(args) -> None:
    """Fixed scales against a learnable one; writes ``<RESULTS>/scale_sweep.{md,json}``."""
    import torch

    from st_cached_losses.config.registry import DEFAULT_SCALE_LEARNING_RATE
    from st_cached_losses.demo import load_model

    name = f"{args.sweep_name}_quick" if args.quick else args.sweep_name
    if args.quick:
        args.train_pairs, args.eval_pairs, args.seeds, args.sweep_scales = 64, 64, "0", "10,50"
        args.sweep_batch = min(args.sweep_batch, 32)
    seeds = [int(s) for s in args.seeds.split(",")]
    fixed = [float(s) for s in args.sweep_scales.split(",")]
    losses = [s.strip().lower() for s in args.sweep_losses.split(",") if s.strip()]
    scale_lrs = [
        DEFAULT_SCALE_LEARNING_RATE if s.strip() == "default" else float(s) for s in args.scale_lrs.split(",")
    ]
    starts = [float(s) for s in args.learnable_starts.split(",")] if args.learnable_starts else [args.scale]
    runs: list[dict[str, Any]] = [
        {
            "run": f"{loss} scale={s:g}",
            "loss": loss,
            "scale": s,
            "learnable": False,
            "scale_learning_rate": None,
        }
        for loss in losses
        for s in fixed
    ]
    for start in starts:
        runs += [
            {
                "run": f"clip learnable from {start:g}, scale lr {rate:g}"
                + (" (default)" if rate == DEFAULT_SCALE_LEARNING_RATE else ""),
                "loss": "clip",
                "scale": start,
                "learnable": True,
                "scale_learning_rate": rate,
            }
            for rate in scale_lrs
        ]
        if not args.no_plain_rate_run:
            runs.append(
                {
                    "run": f"clip learnable from {start:g}, plain lr {args.lr:g}",
                    "loss": "clip",
                    "scale": start,
                    "learnable": True,
                    "scale_learning_rate": 0.0,
                }
            )
    command = "HF_HUB_OFFLINE=1 .venv/bin/python " + shlex.join(
        ["benchmarks/batch_size_quality.py", *sys.argv[1:]]
    )
    train_dataset, held_out, evaluator = quality_data(args.train_pairs, args.eval_pairs)
    setup = (
        f"all-MiniLM-L6-v2, {len(train_dataset)} stdlib training pairs (1 epoch), {len(held_out)} held-out; batch "
        f"{args.sweep_batch} (encoder mini-batch {args.mini_batch}), max_seq_length {args.max_seq_length}, lr "
        f"{args.lr:g} {args.schedule}, seeds {args.seeds}, {torch.get_num_threads()} CPU threads"
    )
    print(setup, flush=True)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    model = load_model(args.model, args.max_seq_length)
    rows.append({"run": "pretrained", "loss": "-", "scale": None, "seed": "-", "steps": 0, "train_s": 0.0})
    rows[-1] |= quality_evaluate(model, evaluator)
    print(f"pretrained: {rows[-1]}", flush=True)
    del model
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for run in runs:
                model, seconds, steps, scales = train_sweep_run(run, seed, train_dataset, args, tmp)
                row = {
                    "run": run["run"],
                    "loss": run["loss"],
                    "scale": run["scale"],
                    "learnable": run["learnable"],
                    "scale_group_lr": run.get("scale_group_lr"),
                    "batch": args.sweep_batch,
                    "mini_batch": args.mini_batch,
                    "seed": seed,
                    "steps": steps,
                    "train_s": round(seconds, 1),
                    "scale_start": scales[0],
                    "scale_end": scales[-1],
                    "scale_min": min(scales),
                    "scale_max": max(scales),
                    "scale_trajectory": [round(s, 3) for s in scales],
                } | quality_evaluate(model, evaluator)
                rows.append(row)
                print(
                    f"{run['run']}, seed {seed}: { ({k: v for k, v in row.items() if k != 'scale_trajectory'}) }",
                    flush=True,
                )
                del model
                gc.collect()
    total = time.perf_counter() - t_start
    summary = summarise(rows, [r["run"] for r in runs])
    for r in summary[1:]:
        group = [x for x in rows if x["run"] == r["run"]]
        r["scale_end"] = statistics.median(x["scale_end"] for x in group)
        r["learnable"] = group[0]["learnable"]
        r["scale_start"] = group[0]["scale_start"]
    lines = [
        f"# Fixed temperatures against a learnable one ({setup})",
        "",
        f"Command: `{command}` ({total / 60:.1f} min in all, training and evaluation)",
        "",
        f"| run | optimizer steps | train (s) | scale start -> end | recall@1 | recall@10 | MRR@10 (min-max of "
        f"{len(seeds)}) | NDCG@10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        moved = "" if r["run"] == "pretrained" else f"{r['scale_start']:.2f} -> {r['scale_end']:.2f}"
        spread = "" if r["run"] == "pretrained" else f" ({r['MRR@10_min']:.4f}-{r['MRR@10_max']:.4f})"
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['train_s']:.0f} | {moved} | {r['recall@1']:.4f} | "
            f"{r['recall@10']:.4f} | {r['MRR@10']:.4f}{spread} | {r['NDCG@10']:.4f} |"
        )
    best_fixed = {}
    for loss in losses:
        fixed_rows = [r for r in summary[1:] if r["loss"] == loss and not r["learnable"]]
        if fixed_rows:
            best_fixed[loss] = max(fixed_rows, key=lambda r: r["MRR@10"])
    learned = [r for r in summary[1:] if r["learnable"]]
    lines.append("")
    for loss, best in best_fixed.items():
        lines.append(f"- best fixed scale, {loss}: `{best['run']}`, MRR@10 {best['MRR@10']:.4f}")
    if "clip" in best_fixed:
        best = best_fixed["clip"]
        for r in learned:
            verdict = "matches or beats" if r["MRR@10"] >= best["MRR@10"] else "falls short of"
            lines.append(
                f"- `{r['run']}`: scale {r['scale_start']:.2f} -> {r['scale_end']:.2f} (median end over seeds); "
                f"MRR@10 {r['MRR@10']:.4f}, {r['MRR@10'] - best['MRR@10']:+.4f} vs the best fixed clip scale: "
                f"{verdict} it"
            )
    if len(seeds) == 1:
        lines.append(
            "- one seed: a difference of MRR@10 below about 0.01 is within run-to-run noise (the seed range of one "
            "run in batch_size_quality.md spans up to 0.01)"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"command": command, "setup": setup, "total_s": round(total, 1), "runs": rows}, indent=1)
        + "\n"
    )
    print("\n".join(lines))


def summarise(rows: list[dict], run_names: list[str]) -> list[dict]:
    """Per run: the median of each metric and of the training time over seeds, and each metric's range."""
    out = [next(r for r in rows if r["run"] == "pretrained")]
    out[0] = {**out[0], **{f"{m}_{k}": out[0][m] for m in METRICS for k in ("min", "max")}}
    for name in run_names:
        group = [r for r in rows if r["run"] == name]
        row = {k: group[0][k] for k in ("run", "loss", "batch", "mini_batch", "steps")}
        row["train_s"] = statistics.median(r["train_s"] for r in group)
        for m in METRICS:
            values = [r[m] for r in group]
            row.update({m: statistics.median(values), f"{m}_min": min(values), f"{m}_max": max(values)})
        out.append(row)
    return out


def markdown_table(summary: list[dict], n_seeds: int) -> list[str]:
    base = summary[1]
    lines = [
        f"| run | loss | batch | encoder mini-batch | optimizer steps | train (s) | recall@10 | MRR@10 "
        f"(min-max of {n_seeds}) | NDCG@10 | MRR@10 vs {base['run']} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        delta = "" if r["run"] == "pretrained" else f"{r['MRR@10'] - base['MRR@10']:+.4f}"
        spread = "" if r["run"] == "pretrained" else f" ({r['MRR@10_min']:.4f}-{r['MRR@10_max']:.4f})"
        lines.append(
            f"| {r['run']} | {r['loss']} | {r['batch'] or '-'} | {r['mini_batch'] or '-'} | {r['steps']} | "
            f"{r['train_s']:.0f} | {r['recall@10']:.4f} | {r['MRR@10']:.4f}{spread} | {r['NDCG@10']:.4f} | {delta} |"
        )
    return lines


if __name__ == "__main__":
    main()
