"""The loss stage with a negative bank of N against the in-batch loss of the same width: time at d = 384.

Question: does scoring ``N`` banked embeddings (no gradient) cost at most what ``N`` more in-batch columns
cost? Contenders, per ``(B, N)`` and loss (one direction; symmetric), measured side by side in one run
(medians of ``--repeats`` after a warm-up, rounds interleaved: every contender once per round, in turn):

* ``bank``: ``infonce_loss_and_grad(q, [p], bank=Bank(...))``: ``B`` rows against ``B`` in-batch
  columns and a bank of ``N`` candidates (symmetric: and ``N`` anchors), the loss and the gradients wrt
  ``q`` and ``p``;
* ``in-batch B + N``: the same rows against ``B + N`` in-batch columns that all take a gradient
  (symmetric: ``B + N`` anchors too), the loss of the same width, as a batch of ``B + N`` candidates
  would be (the gathered layout: ``B`` rows, their positives the first ``B`` columns);
* ``in-batch B``: no bank, the loss the bank extends.

``bank / in-batch B + N`` is the ratio the issue bounds (at most 1.3); below 1 the bank is cheaper than the
same width in the batch (its columns take no gradient: two matrix products per tile instead of three).

Run: ``.venv/bin/python benchmarks/negative_bank.py`` (``--sizes B:N,...``, ``--repeats``, ``--path``, ``--threads``;
``--quick`` for a smoke run). Writes ``benchmarks/results/<--name, default negative_bank>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from _common import ROOT

from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import Bank

D = 384


def contenders(b: int, n: int, symmetric: bool, path: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, p = (torch.randn(b, D, generator=gen) for _ in range(2))
    bank_c, bank_q = (torch.randn(n, D, generator=gen) for _ in range(2))
    wide_p = torch.cat([p, bank_c])  # (B + N, d): every column in the batch
    wide_q = torch.cat([q, bank_q])
    kw = {"symmetric": symmetric, "path": path, "scale": 20.0}
    bank = Bank(bank_c, bank_q if symmetric else None)
    return {
        "bank": lambda: infonce_loss_and_grad(q, [p], bank=bank, **kw),
        "in-batch B + N": lambda: infonce_loss_and_grad(
            q, [wide_p], anchors_all=wide_q if symmetric else None, **kw
        ),
        "in-batch B": lambda: infonce_loss_and_grad(q, [p], **kw),
    }


def measure(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024:1024,1024:4096,4096:4096", help="B:N pairs")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--path", default="auto", choices=["auto", "chunked", "tiled"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steady on a shared machine, where two threads wait on each other)",
    )
    parser.add_argument("--name", default="negative_bank", help="the results files' stem")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 2 repeats, no files")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.repeats = [(128, 128)], 2
    torch.manual_seed(0)
    rows = []
    for b, n in sizes:
        for symmetric in (False, True):
            med = measure(contenders(b, n, symmetric, args.path), args.repeats)
            row = {
                "B": b, "N": n, "loss": "symmetric" if symmetric else "one direction", "path": args.path,
                **{f"{k}_s": v for k, v in med.items()},
                "bank / in-batch B + N": med["bank"] / med["in-batch B + N"],
                "bank / in-batch B": med["bank"] / med["in-batch B"],
            }  # fmt: skip
            rows.append(row)
            print(
                f"B={b:5d} N={n:5d} {row['loss']:13s} bank {med['bank']:.3f}s  in-batch B+N "
                f"{med['in-batch B + N']:.3f}s  in-batch B {med['in-batch B']:.3f}s  ratio "
                f"{row['bank / in-batch B + N']:.2f}",
                flush=True,
            )
    if args.quick:
        return
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, fp32, d = {D}"
    )
    command = "python benchmarks/negative_bank.py " + " ".join(
        f"--{k} {v}"
        for k, v in (
            ("sizes", args.sizes),
            ("repeats", args.repeats),
            ("path", args.path),
            ("threads", args.threads),
        )
    )
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(
        json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1)
    )
    lines = [
        "# The loss stage with a negative bank",
        "",
        f"`{command}`; {machine}; medians of {args.repeats} rounds after a warm-up, contenders interleaved.",
        "",
        "| B | N | loss | bank (s) | in-batch B + N (s) | in-batch B (s) | bank / in-batch B + N | bank / in-batch B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['B']:,} | {r['N']:,} | {r['loss']} | {r['bank_s']:.3f} | {r['in-batch B + N_s']:.3f} | "
        f"{r['in-batch B_s']:.3f} | {r['bank / in-batch B + N']:.2f} | {r['bank / in-batch B']:.2f} |"
        for r in rows
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (args.name + '.md')}")


if __name__ == "__main__":
    main()
