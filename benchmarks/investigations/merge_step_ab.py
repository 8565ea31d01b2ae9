"""One side of an A/B run between two trees of this repository (issue 58-62's merges against the tree before
them): the functional loss stage (B = C = 16,384, d = 384, one direction, chunked; median of 3 after a warm-up)
and one ``CachedMNRLoss`` step on the suite's tiny BERT (B = 256 pairs, mini-batch 32; median of
``--step-repeats``), torch on one thread. It imports whichever tree is first on ``PYTHONPATH``; run it from
each tree's root, rounds interleaved, as ``results/merge_step_ab.md`` says. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import st_cached_losses
from st_cached_losses import CachedMNRLoss
from st_cached_losses.functional import infonce_loss_and_grad
from st_cached_losses.functional.softmax.options import InfoNCEOptions
from tests.support.tiny_model import make_tiny_model, random_texts


def median_seconds(f: Any, repeats: int) -> float:
    f()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage-repeats", type=int, default=3)
    parser.add_argument("--step-repeats", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"tree": str(Path(st_cached_losses.__file__).parents[1])}
    if args.stage_repeats:
        g = torch.Generator().manual_seed(0)
        q, c = torch.randn(16384, 384, generator=g), torch.randn(16384, 384, generator=g)
        options = InfoNCEOptions(scale=20.0, path="chunked")
        out["stage_s"] = median_seconds(
            lambda: infonce_loss_and_grad(q, [c], options=options), args.stage_repeats
        )
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "bert")
    features = [model.preprocess(random_texts(256, seed=k)) for k in range(2)]
    loss = CachedMNRLoss(model, mini_batch_size=32)

    def step() -> None:
        model.zero_grad()
        loss(features, None).backward()

    out["step_s"] = median_seconds(step, args.step_repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
