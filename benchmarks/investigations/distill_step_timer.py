"""Times one distillation training step, sentence-transformers' ``DistillKLDivLoss`` against our
``CachedDistillKLDivLoss``, alternating the two (theirs, ours, theirs, ours, ...) on one CPU thread, so that
whatever else runs on the machine slows both alike: a cleaner ratio than ``benchmarks/distill_memory.py``'s
step times on a busy 2-core machine. The batch is ``distill_memory.py``'s (B queries, a positive and K hard
negatives each, random teacher scores) on all-MiniLM-L6-v2 cut to 2 layers, 32 tokens; each contender runs
one warm-up step, then ``rounds`` timed steps::

    .venv/bin/python benchmarks/investigations/distill_step_timer.py --batch 64 --negatives 31 --mini-batch 64
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common, distill_memory

from _common import minilm, truncate
from distill_memory import distill_batch, one_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--negatives", type=int, default=31)
    parser.add_argument("--mini-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss

    from st_cached_losses import CachedDistillKLDivLoss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = truncate(minilm(32), 2)
    model.train()
    features, labels = distill_batch(model, args.batch, args.negatives)
    losses = {
        "theirs": DistillKLDivLoss(model),
        "ours": CachedDistillKLDivLoss(model, mini_batch_size=args.mini_batch),
    }
    for loss in losses.values():
        one_step(model, loss, features, labels)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(args.rounds):
        for name, loss in losses.items():
            start = time.perf_counter()
            one_step(model, loss, features, labels)
            times[name].append(time.perf_counter() - start)
            print(name, round(times[name][-1], 3), flush=True)
    theirs, ours = statistics.median(times["theirs"]), statistics.median(times["ours"])
    print(f"medians: theirs {theirs:.1f} s, ours {ours:.1f} s, ours / theirs {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
