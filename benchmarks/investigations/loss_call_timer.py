"""Times one loss-stage call (``infonce_loss_and_grad`` at B = C = 4,096, d = 384) and a matmul bound (the
logits and the two gradient products), each a median of 9 calls after a warm-up, to compare two trees
directly in seconds; run it from each tree, alternating:

    PYTHONPATH=. .venv/bin/python benchmarks/investigations/loss_call_timer.py tiled one   # chunked / sym
"""

import statistics
import sys
import time

import torch

from st_cached_losses.functional import infonce_loss_and_grad


def median_seconds(call, repeats: int = 9) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    q, p = torch.randn(4096, 384), torch.randn(4096, 384)
    path, symmetric = sys.argv[1], sys.argv[2] == "sym"
    ours = median_seconds(lambda: infonce_loss_and_grad(q, p, scale=20.0, symmetric=symmetric, path=path))

    def bound() -> None:
        logits = q @ p.T
        _ = (logits @ p, logits.T @ q)

    print(f"{ours:.4f} {median_seconds(bound):.4f}")


if __name__ == "__main__":
    main()
