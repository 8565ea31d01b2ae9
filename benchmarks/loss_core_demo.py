"""The loss core at a batch no dense implementation can hold on this machine (formerly ``make demo``).

B = C = 65,536 anchors and positives, d = 384, the symmetric (CLIP-style) loss and its gradient
wrt every embedding, on the tiled path; prints the loss, the time and the peak extra memory next
to what the dense logits alone would need. Override with ``--batch`` / ``--dim`` / ``--tile``.

Run: ``.venv/bin/python benchmarks/loss_core_demo.py`` (about a minute and 300 MiB on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (the repository root first on sys.path)
import torch

from st_cached_losses.functional import infonce_loss_and_grad
from tests.support.memory import PeakMemory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=65_536, help="anchors = positives = in-batch candidates")
    parser.add_argument("--dim", type=int, default=384, help="embedding dimension")
    parser.add_argument("--tile", type=int, default=2048, help="tile side of the tiled path")
    parser.add_argument("--scale", type=float, default=20.0, help="1 / temperature")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    b, d = args.batch, args.dim
    # correlated pairs, so the loss is well below log(B)
    anchors = torch.randn(b, d)
    positives = anchors + 3.0 * torch.randn(b, d)
    emb_bytes = b * d * 4
    dense_bytes = 2 * b * b * 4  # the logits and their gradient, fp32
    print(
        f"symmetric InfoNCE, B = C = {b:,}, d = {d}, tiled ({args.tile} x {args.tile} tiles), {torch.get_num_threads()} threads"
    )
    print(
        f"embeddings: 2 x {emb_bytes / 2**20:,.0f} MiB; dense logits + their gradient would need {dense_bytes / 2**30:,.1f} GiB"
    )
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        out = infonce_loss_and_grad(
            anchors, positives, scale=args.scale, symmetric=True, path="tiled", tile_size=args.tile
        )
    seconds = time.perf_counter() - t0
    print(f"loss            {out.loss.item():.6f}  (log B = {torch.log(torch.tensor(float(b))).item():.3f})")
    print(
        f"grad norms      anchors {out.grad_anchors.norm():.3e}, positives {out.grad_candidates[0].norm():.3e}"
    )
    print(f"time            {seconds:.1f} s (forward + gradient wrt every embedding)")
    print(
        f"peak extra mem  {mem.peak_bytes / 2**20:,.0f} MiB = {mem.peak_bytes / emb_bytes:.2f} x (B x d x 4 bytes), "
        f"incl. the returned gradients; {dense_bytes / max(mem.peak_bytes, 1):,.0f}x less than the dense logits"
    )


if __name__ == "__main__":
    main()
