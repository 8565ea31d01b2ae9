"""Fine-tune a SentenceTransformer with CachedCLIPLoss (GradCache + symmetric InfoNCE, learnable temperature).

The loss averages two cross-entropies: each query picks its document among all documents of the batch,
and each document picks its query among all queries. With ``--learnable_scale`` (on here) the scale
(1 / temperature) is learned as CLIP's ``logit_scale``, clamped at ``--max_scale``; it is optimised by
the stock trainer, logged as ``scale`` and saved with every checkpoint. Being one log-parameter, it
gets its own learning rate here through sentence-transformers' ``learning_rate_mapping`` (default
``{"logit_scale": 0.01}``); at the encoder's 1e-4 it would hardly move in a short run.

Every option is a field of ``CachedLossTrainingArguments`` or of the data arguments (``--help``)::

    python examples/train_cached_clip.py                                   # tiny CPU defaults, ~1 minute
    python examples/train_cached_clip.py --temperature 0.07 --max_scale 100 --per_device_train_batch_size 2048
    python examples/train_cached_clip.py examples/configs/cached_clip.yaml

Defaults: the packaged all-MiniLM-L6-v2, 512 training pairs from the Python standard library, 256
held-out pairs, batch 64, mini-batch 16, temperature 0.05 (learnable, learning rate 0.01), 64 tokens, one
epoch. Writes the
model and its card to ``output/examples/cached_clip``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_cached_losses.demo import EXAMPLE_DEFAULTS, run

DEFAULTS = {
    **EXAMPLE_DEFAULTS,
    "output_dir": "output/examples/cached_clip",
    "loss": "clip",  # build_loss -> CachedCLIPLoss(model, scale=20.0, learnable_scale=True, ...)
    "temperature": 0.05,
    "learnable_scale": True,
    "max_scale": 100.0,
    # the temperature is one log-parameter: its own learning rate, or it hardly moves in a short run
    "learning_rate_mapping": {"logit_scale": 0.01},
}


def main(argv: list[str] | None = None) -> dict:
    """Parse, train, evaluate before and after, save; returns the run's summary."""
    return run(argv, DEFAULTS, __doc__, title="examples/train_cached_clip.py")


if __name__ == "__main__":
    main()
