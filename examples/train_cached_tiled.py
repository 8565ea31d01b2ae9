"""Fine-tune a SentenceTransformer with CachedTiledLoss (GradCache + Inf-CL-style tiled InfoNCE).

The loss stage never holds more than one ``tile_size x tile_size`` block of logits: the log-sum-exp of
each row (and column, with ``--symmetric``) is accumulated tile by tile and the gradient recomputed in
a second pass, so its memory is O((B + C) d) whatever the batch. Across processes the candidate blocks
travel around a ring instead of being gathered. ``--symmetric true`` (the default here) is the CLIP
loss, ``false`` the one-directional InfoNCE.

Every option is a field of ``CachedLossTrainingArguments`` or of the data arguments (``--help``)::

    python examples/train_cached_tiled.py                                  # tiny CPU defaults, ~1 minute
    python examples/train_cached_tiled.py --per_device_train_batch_size 4096 --mini_batch_size 64 \\
        --tile_size 1024 --train_pairs 4096
    python examples/train_cached_tiled.py examples/configs/cached_tiled.yaml

Defaults: the packaged all-MiniLM-L6-v2, 512 training pairs from the Python standard library, 256
held-out pairs, batch 64, mini-batch 16, tiles of 32 (tiny, to make the tiling visible at batch 64; use
1024-2048 for real batches, or leave ``tile_size`` unset to size tiles from the memory budget), 64
tokens, one epoch. Writes the model and its card to ``output/examples/cached_tiled``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_cached_losses.demo import EXAMPLE_DEFAULTS, run

DEFAULTS = {
    **EXAMPLE_DEFAULTS,
    "output_dir": "output/examples/cached_tiled",
    "loss": "tiled",  # build_loss -> CachedTiledLoss(model, symmetric=True, tile_size=32, ...)
    "symmetric": True,
    "tile_size": 32,
    "scale": 20.0,
}


def main(argv: list[str] | None = None) -> dict:
    """Parse, train, evaluate before and after, save; returns the run's summary."""
    return run(argv, DEFAULTS, __doc__, title="examples/train_cached_tiled.py")


if __name__ == "__main__":
    main()
