"""Does the sigmoid loss train a retriever as well as the softmax one, at equal compute? (Issue 53's quality run,
reported, not tuned.)

all-MiniLM-L6-v2 (packaged, offline) is fine-tuned for one epoch on the same training pairs from the Python
standard library (docstring summary -> function source), with the same batch, encoder mini-batch, learning
rate and schedule (so the same forwards, backwards and optimizer steps), by

* ``clip``: ``CachedCLIPLoss`` (symmetric InfoNCE, scale 20, sentence-transformers' default);
* ``siglip``: ``CachedSigLIPLoss`` with SigLIP's initial scale 10 and bias -10, fixed;
* ``siglip learnable``: the same, the scale (through its log) and the bias learned at
  ``CachedLossTrainingArguments``' default ``scale_learning_rate``;

and every model (and the pretrained one) is evaluated on held-out pairs: each docstring summary retrieves its
function among all held-out sources (recall@10, MRR@10, NDCG@10). Every loss is built from
``CachedLossTrainingArguments`` by ``build_loss``, as a user would.

Run: ``.venv/bin/python benchmarks/siglip_quality.py`` (``--quick``: a smoke run). Writes
``benchmarks/results/siglip_quality.{md,json}``.
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
}


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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default=",".join(RUNS), help="which runs, comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 pairs, 100 held out")
    parser.add_argument("--name", default="siglip_quality")
    args = parser.parse_args()
    if args.quick:
        args.train_pairs, args.eval_pairs, args.name = 128, 100, f"{args.name}_quick"

    quality_setup(args.threads)
    import torch

    from st_cached_losses import LossStateCallback
    from st_cached_losses.demo import load_model

    train_dataset, held_out, evaluator = quality_data(args.train_pairs, args.eval_pairs)
    header = (
        f"all-MiniLM-L6-v2, {len(train_dataset)} stdlib training pairs (1 epoch), {len(held_out)} held-out; "
        f"batch {args.batch}, encoder mini-batch {args.mini_batch}, max_seq_length {args.max_seq_length}, lr "
        f"{args.lr:g} constant, seed {args.seed}, {torch.get_num_threads()} CPU threads"
    )
    print(header, flush=True)
    rows = [{"run": "pretrained", **quality_evaluate(load_model(None, args.max_seq_length), evaluator)}]
    print(rows[-1], flush=True)
    for name in args.runs.split(","):
        fields = RUNS[name]
        model = load_model(None, args.max_seq_length)
        with tempfile.TemporaryDirectory() as out:
            targs = quality_arguments(
                out, args.batch, args.lr, args.seed, mini_batch_size=args.mini_batch, **fields
            )
            from st_cached_losses import build_loss

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
                "loss": type(loss).__name__,
                "steps": steps,
                "train_s": round(seconds, 1),
                "final": learned,
                **quality_evaluate(model, evaluator),
            }
        )
        print(rows[-1], flush=True)
    metrics = [k for k in rows[0] if k != "run"]
    lines = [
        header,
        "",
        "| run | loss | optimizer steps | train (s) | scale / bias at the end | "
        + " | ".join(metrics)
        + " |",
        "|---" * (5 + len(metrics)) + "|",
    ]
    for r in rows:
        final = ", ".join(f"{k} {v:.4g}" for k, v in r.get("final", {}).items())
        values = " | ".join(f"{r[m]:.4f}" for m in metrics)
        lines.append(
            f"| {r['run']} | {r.get('loss', '-')} | {r.get('steps', 0)} | {r.get('train_s', 0)} | {final} | {values} |"
        )
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines += ["", f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
