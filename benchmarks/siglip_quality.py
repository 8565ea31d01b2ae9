"""Does the sigmoid loss train a retriever as well as the softmax one, at equal compute? (Issue 53's quality run,
reported, not tuned.)

all-MiniLM-L6-v2 (packaged, offline) is fine-tuned for one epoch on the same training pairs from the Python
standard library (docstring summary -> function source), with the same batch, encoder mini-batch, learning
rate and schedule (so the same forwards, backwards and optimizer steps), by

* ``clip``: ``CachedCLIPLoss`` (symmetric InfoNCE, scale 20, sentence-transformers' default);
* ``siglip``: ``CachedSigLIPLoss`` with SigLIP's initial scale 10 and bias -10, fixed;
* ``siglip learnable``: the same, the scale (through its log) and the bias learned at
  ``CachedLossTrainingArguments``' default ``scale_learning_rate`` (1e-2);
* candidate starts for fine-tuning a pretrained cosine model (issue 62): ``siglip s20`` (scale 20, bias
  -10; ``learnable``: both learned from there), ``siglip s20 b-8`` / ``b-12`` (other biases at scale 20), and
  biases set from the data at scale 10, 20 or 40 (``similarity_gap``: the pretrained model's mean positive
  and mean in-batch negative cosine on the first ``--bias-sample`` training pairs): ``mid`` puts the sigmoid's
  threshold (``scale * cos + bias = 0``) halfway between them, ``pos`` at the mean positive cosine;

and every model (and the pretrained one) is evaluated on held-out pairs: each docstring summary retrieves its
function among all held-out sources (recall@10, MRR@10, NDCG@10). Every loss is built from
``CachedLossTrainingArguments`` by ``build_loss``, as a user would.

Every run is trained once per seed of ``--seeds`` (the seed of the data order and of dropout); the table gives
the median and the range over the seeds, and whether a run's range lies above, below or across the pretrained
model's MRR@10 (which does not depend on the seed) and CLIP's range.

Run: ``.venv/bin/python benchmarks/siglip_quality.py --seeds 0,1`` (``--quick``: a smoke run; ``--render``:
the tables again from the JSON, training nothing). Writes ``benchmarks/results/<--name>.{md,json}`` (default
``siglip_quality``; the ``.md`` with every column, the table between section markers that the SigLIP guide's
"All columns" block includes) and ``<--name>_compact.md``: the same text around a table of the columns the guide
quotes, narrow enough for the guide's text column at 1,400 px (``tests/docs/test_table_width.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time

from _common import ROOT, quality_arguments, quality_data, quality_evaluate, quality_setup, quality_train

RESULTS = ROOT / "benchmarks" / "results"

#: name -> the loss fields of CachedLossTrainingArguments
RUNS: dict[str, dict] = {
    "clip": {"loss": "clip", "scale": 20.0},
    "siglip": {"loss": "siglip", "scale": 10.0, "siglip_bias": -10.0},
    "siglip learnable": {"loss": "siglip", "scale": 10.0, "siglip_bias": -10.0, "learnable": True},
    "siglip s20": {"loss": "siglip", "scale": 20.0, "siglip_bias": -10.0},
    "siglip s20 learnable": {"loss": "siglip", "scale": 20.0, "siglip_bias": -10.0, "learnable": True},
    "siglip s20 b-8": {"loss": "siglip", "scale": 20.0, "siglip_bias": -8.0},
    "siglip s20 b-12": {"loss": "siglip", "scale": 20.0, "siglip_bias": -12.0},
    # the bias from the data, at the run's scale (similarity_gap on the first --bias-sample training pairs):
    # "mid": the sigmoid's threshold halfway between the mean positive and mean negative cosine; "pos": at the
    # mean positive cosine
    "siglip mid s10": {"loss": "siglip", "scale": 10.0, "siglip_bias": "mid"},
    "siglip mid s20": {"loss": "siglip", "scale": 20.0, "siglip_bias": "mid"},
    "siglip mid s20 learnable": {"loss": "siglip", "scale": 20.0, "siglip_bias": "mid", "learnable": True},
    "siglip mid s40": {"loss": "siglip", "scale": 40.0, "siglip_bias": "mid"},
    "siglip pos s20": {"loss": "siglip", "scale": 20.0, "siglip_bias": "pos"},
    "siglip pos s20 learnable": {"loss": "siglip", "scale": 20.0, "siglip_bias": "pos", "learnable": True},
    "siglip pos s40": {"loss": "siglip", "scale": 40.0, "siglip_bias": "pos"},
}
#: the runs of the default --runs (the table of the docs)
DEFAULT_RUNS = tuple(r for r in RUNS if r not in ("siglip mid s20 learnable", "siglip pos s20 learnable"))


def similarity_gap(model, queries, documents) -> tuple[float, float]:
    """(mean positive cosine, mean negative cosine) of ``model`` on (query, document) pairs: the diagonal of
    the queries x documents cosine matrix, and its off-diagonal entries (every other row's document: the
    in-batch negatives)."""

    q = model.encode(list(queries), convert_to_tensor=True, normalize_embeddings=True)
    d = model.encode(list(documents), convert_to_tensor=True, normalize_embeddings=True)
    sim = q @ d.T
    n = sim.shape[0]
    positive = sim.diagonal().mean()
    negative = (sim.sum() - sim.diagonal().sum()) / (n * n - n)
    return float(positive), float(negative)


def summarize(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    import statistics

    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-pairs", type=int, default=4000)
    parser.add_argument("--eval-pairs", type=int, default=1000)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=8, help="encoder mini-batch of every loss")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", default="0", help="training seeds, comma-separated (e.g. 0,1)")
    parser.add_argument(
        "--bias-sample", type=int, default=256, help="training pairs bias_from_data looks at (the first ones)"
    )
    parser.add_argument(
        "--runs", default=",".join(DEFAULT_RUNS), help=f"which runs, comma-separated: {', '.join(RUNS)}"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 pairs, 100 held out")
    parser.add_argument("--name", default="siglip_quality")
    parser.add_argument(
        "--render", action="store_true", help="write <name>.md again from <name>.json, training nothing"
    )
    args = parser.parse_args()
    if args.render:
        print(write_results(json.loads((RESULTS / f"{args.name}.json").read_text()), args.name))
        return
    if args.quick:
        args.train_pairs, args.eval_pairs, args.name = 128, 100, f"{args.name}_quick"
    seeds = [int(s) for s in args.seeds.split(",")]

    quality_setup(args.threads)
    import torch

    from st_cached_losses import LossStateCallback, build_loss
    from st_cached_losses.demo import load_model

    train_dataset, held_out, evaluator = quality_data(args.train_pairs, args.eval_pairs)
    header = (
        f"all-MiniLM-L6-v2, {len(train_dataset)} stdlib training pairs (1 epoch), {len(held_out)} held-out; "
        f"batch {args.batch}, encoder mini-batch {args.mini_batch}, max_seq_length {args.max_seq_length}, lr "
        f"{args.lr:g} constant, seeds {', '.join(map(str, seeds))}, {torch.get_num_threads()} CPU threads"
    )
    print(header, flush=True)
    pretrained = load_model(None, args.max_seq_length)
    rows = [{"run": "pretrained", "seed": None, **quality_evaluate(pretrained, evaluator)}]
    print(rows[-1], flush=True)
    sample = train_dataset.select(range(min(args.bias_sample, len(train_dataset))))
    positive, negative = similarity_gap(pretrained, sample["query"], sample["document"])
    gap = {"pairs": len(sample), "positive_cosine": positive, "negative_cosine": negative}
    print(f"pretrained on {len(sample)} training pairs: mean positive cosine {positive:.4f}, "
          f"mean in-batch negative {negative:.4f}", flush=True)  # fmt: skip
    del pretrained
    for name in args.runs.split(","):
        fields = dict(RUNS[name])
        threshold = {"mid": (positive + negative) / 2, "pos": positive}.get(fields.get("siglip_bias"))
        if threshold is not None:
            fields["siglip_bias"] = round(-fields["scale"] * threshold, 4)
        start = {
            "scale": fields["scale"],
            **({"bias": fields["siglip_bias"]} if "siglip_bias" in fields else {}),
        }
        for seed in seeds:
            model = load_model(None, args.max_seq_length)
            with tempfile.TemporaryDirectory() as out:
                targs = quality_arguments(
                    out, args.batch, args.lr, seed, mini_batch_size=args.mini_batch, **fields
                )
                loss = build_loss(model, targs, train_dataset=train_dataset)
                _, seconds, steps = quality_train(
                    model, targs, train_dataset, loss, callbacks=[LossStateCallback(loss)]
                )
            learned = {"scale": float(loss.scale)}
            if hasattr(loss, "bias"):
                learned["bias"] = float(loss.bias)
            rows.append(
                {
                    "run": name,
                    "seed": seed,
                    "loss": type(loss).__name__,
                    "start": start,
                    "steps": steps,
                    "train_s": round(seconds, 1),
                    "final": learned,
                    **quality_evaluate(model, evaluator),
                }
            )
            print(rows[-1], flush=True)
    result = {
        "setting": header,
        "similarity_gap": gap,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    print(write_results(result, args.name))


def compare(low: float, high: float, other_low: float, other_high: float) -> str:
    """Whether the seed range ``[low, high]`` lies above, below or across ``[other_low, other_high]``."""
    if low > other_high:
        return "above"
    if high < other_low:
        return "below"
    return "overlap"


def write_results(result: dict, name: str) -> str:
    """Write ``result`` (the setting, the pretrained model's cosines, the command and every run's row per
    seed) to ``benchmarks/results/<name>.{md,json}``, the table with each run's median and range over the
    seeds and whether its range lies above, below or across the pretrained model's MRR@10 and CLIP's range,
    every column; and ``<name>_compact.md``, the same text around the columns the SigLIP guide quotes (the
    start, MRR@10's median and range, the two comparisons, recall@1) and a line with the learned scales and
    biases. Returns the compact text."""
    rows, gap = result["rows"], result["similarity_gap"]
    metrics = ("recall@1", "recall@10", "NDCG@10")
    base = rows[0]["MRR@10"]
    names = list(dict.fromkeys(r["run"] for r in rows[1:]))
    ranges = {n: summarize([r["MRR@10"] for r in rows if r["run"] == n]) for n in names}
    clip = ranges.get("clip")
    intro = [
        result["setting"],
        "",
        f"Pretrained model on the first {gap['pairs']} training pairs: mean positive cosine "
        f"{gap['positive_cosine']:.3f}, mean in-batch negative cosine {gap['negative_cosine']:.3f}. The "
        "biases from the data: `mid` puts the threshold (scale x cos + bias = 0) halfway between the two "
        "(bias = -scale x their midpoint), `pos` at the mean positive cosine (bias = -scale x it). MRR@10 "
        "against the pretrained model and against `clip`: the run's range over the seeds lies above, below, "
        "or overlaps (no difference beyond the seeds' spread).",
        "",
    ]
    # the guide's table (docs/guides/siglip.md): six columns, the ones its text quotes
    compact = [
        "| run | start: scale / bias | MRR@10 median (range) | vs pretrained | vs clip | recall@1 median |",
        "|---" * 6 + "|",
        f"| pretrained | - | {base:.4f} | - | - | {rows[0]['recall@1']:.4f} |",
    ]
    learned = []  # "run: scale / bias at the end, per seed" of the runs whose scale or bias moved
    lines = [
        "| run | loss | start: scale / bias | optimizer steps | train (s), median | scale / bias at the end | "
        "MRR@10 per seed | MRR@10 median (range) | vs pretrained | vs clip | "
        + " | ".join(f"{m} median" for m in metrics)
        + " |",
        "|---" * (10 + len(metrics)) + "|",
        "| pretrained | - | - | 0 | 0 | - | "
        + f"{base:.4f} | {base:.4f} | - | - | "
        + " | ".join(f"{rows[0][m]:.4f}" for m in metrics)
        + " |",
    ]
    summary = []
    for name_ in names:
        runs = [r for r in rows if r["run"] == name_]
        median, low, high = ranges[name_]
        final = (
            "; ".join(", ".join(f"{k} {v:.4g}" for k, v in r["final"].items()) for r in runs)
            if any(r["final"] != {k: float(v) for k, v in r["start"].items()} for r in runs)
            else "as at the start"
        )
        start = ", ".join(f"{k} {v:.4g}" for k, v in runs[0]["start"].items())
        vs_base = compare(low, high, base, base)
        vs_clip = "-" if name_ == "clip" or clip is None else compare(low, high, clip[1], clip[2])
        summary.append(
            {"run": name_, "MRR@10": {"median": median, "min": low, "max": high}, "vs_pretrained": vs_base,
             "vs_clip": vs_clip}
        )  # fmt: skip
        compact.append(
            f"| {name_} | {' / '.join(f'{v:.4g}' for v in runs[0]['start'].values())} | "
            f"{median:.4f} ({low:.4f}-{high:.4f}) | {vs_base} | {vs_clip} | "
            f"{summarize([r['recall@1'] for r in runs])[0]:.4f} |"
        )
        if final != "as at the start":
            learned.append(
                f"`{name_}` "
                + ", ".join(
                    f"{' / '.join(f'{v:.4g}' for v in r['final'].values())} (seed {r['seed']})" for r in runs
                )
            )
        lines.append(
            f"| {name_} | {runs[0]['loss']} | {start} | {runs[0]['steps']} | "
            f"{summarize([r['train_s'] for r in runs])[0]:.0f} | {final} | "
            + ", ".join(f"{r['MRR@10']:.4f}" for r in runs)
            + f" | {median:.4f} ({low:.4f}-{high:.4f}) | {vs_base} | {vs_clip} | "
            + " | ".join(f"{summarize([r[m] for r in runs])[0]:.4f}" for m in metrics)
            + " |"
        )
    command = ["", f"Command: `{result['command']}` ({result['date']})."]
    steps = sorted({r["steps"] for r in rows[1:]})
    compact += [
        "",
        (f"Scale / bias at the end, where learned: {'; '.join(learned)}. " if learned else "")
        + (f"Every trained run: {steps[0]} optimizer steps. " if len(steps) == 1 else "")
        + "Every column (the loss, the optimizer steps, the training time, the scale and bias at the end, "
        f"MRR@10 per seed, recall@10, NDCG@10): `benchmarks/results/{name}.md`.",
    ]
    # the full table between snippet section markers: the guide's "All columns" block includes it alone
    lines = [*intro, "<!-- --8<-- [start:all-columns] -->", *lines, "<!-- --8<-- [end:all-columns] -->"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(lines + command) + "\n", encoding="utf-8")
    (RESULTS / f"{name}_compact.md").write_text("\n".join(intro + compact + command) + "\n", encoding="utf-8")
    (RESULTS / f"{name}.json").write_text(
        json.dumps({**result, "summary": summary}, indent=2) + "\n", encoding="utf-8"
    )
    return "\n".join(intro + compact + command)


if __name__ == "__main__":
    main()
