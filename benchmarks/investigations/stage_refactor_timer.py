"""Issue 51's guard: the loss stage and a training step of the cached losses, timed in two checkouts side by
side (the stage redesign against the release before it), alternating checkout by checkout, medians.

Each round runs this file once per checkout in a subprocess (``PYTHONPATH`` = that checkout, one thread), which
times, after a warm-up, ``--repeats`` calls of:

* ``stage-mnr``: ``CachedMNRLoss.calculate_loss(reps, with_backward=True)`` on random embeddings (``--rows``
  rows, 3 columns, d = 384): GradCache's stage 2 through the loss class (the layer the redesign rebuilt);
* ``stage-distill``: the same for ``CachedDistillKLDivLoss`` (teacher scores as labels);
* ``step-mnr`` / ``step-gist``: forward + backward of ``CachedMNRLoss`` / self-guided ``CachedGISTLoss`` on the
  tests' tiny random BERT (``--batch`` rows, 3 columns, mini-batch 16): the whole cached step.

Run: ``python benchmarks/investigations/stage_refactor_timer.py --trees NEW OLD`` (``--rounds``). Prints one
table of the medians over rounds of each checkout's per-round medians, and new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rows: int, batch: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    from st_cached_losses import CachedDistillKLDivLoss, CachedGISTLoss, CachedMNRLoss, CachedSigLIPLoss
    from tests.support.tiny_model import make_tiny_model, random_texts

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m")
        g = torch.Generator().manual_seed(0)
        emb = [torch.nn.functional.normalize(torch.randn(rows, 384, generator=g), dim=-1) for _ in range(3)]
        teacher = torch.randn(rows, 2, generator=g)

        def stage(loss, labels=None):
            def run():
                reps = [[e.clone().requires_grad_()] for e in emb]
                loss.calculate_loss(reps, labels, with_backward=True)

            return run

        out["stage-mnr"] = _median_time(stage(CachedMNRLoss(model)), repeats)
        out["stage-distill"] = _median_time(stage(CachedDistillKLDivLoss(model), teacher), repeats)
        out["stage-siglip"] = _median_time(stage(CachedSigLIPLoss(model)), repeats)

        texts = [random_texts(batch, seed=s, min_words=5, max_words=30) for s in range(3)]
        features = [model.tokenize(t) for t in texts]

        def step(loss):
            def run():
                model.zero_grad(set_to_none=True)
                loss([dict(f) for f in features], None).backward()

            return run

        out["step-mnr"] = _median_time(step(CachedMNRLoss(model, mini_batch_size=16)), repeats)
        out["step-gist"] = _median_time(step(CachedGISTLoss(model, guide=None, mini_batch_size=16)), repeats)
        learned = CachedMNRLoss(model, mini_batch_size=16, learnable_scale=True)
        with torch.no_grad():  # a scale that moved: its settings read as a trained loss's are
            learned.logit_scale.fill_(3.5)
        out["step-mnr-learned"] = _median_time(step(learned), repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", nargs=2, metavar=("NEW", "OLD"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows, args.batch, args.repeats)))
        return
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees if r % 2 == 0 else reversed(args.trees):  # alternating which goes first
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--child", "--rows", str(args.rows), "--batch", str(args.batch)]
            cmd += ["--repeats", str(args.repeats)]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
            results[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {tree}: {results[tree][-1]}", flush=True)
    new, old = args.trees
    print(
        f"\n| measure | new (s) | old (s) | new / old |  ({args.rounds} rounds, medians)\n|---|---|---|---|"
    )
    for key in results[new][0]:
        a = statistics.median(x[key] for x in results[new])
        b = statistics.median(x[key] for x in results[old])
        print(f"| {key} | {a:.4f} | {b:.4f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
