"""Fine-tune a SentenceTransformer with CachedMNRLoss (GradCache + in-batch-negative InfoNCE).

Each query is scored against its document, a mined hard negative and every other row's document and
negative; the batch (here 64) is embedded in mini-batches of ``--mini_batch_size`` rows, so memory is
that of one mini-batch while the gradients are exactly those of the full batch.

Every option is a field of ``CachedLossTrainingArguments`` (the loss and its hyperparameters, plus all
of sentence-transformers' training arguments) or of the data arguments; ``--help`` lists them all::

    python examples/train_cached_mnr.py                                  # tiny CPU defaults, ~1 minute
    python examples/train_cached_mnr.py --per_device_train_batch_size 1024 --mini_batch_size 64 \\
        --train_pairs 4096 --temperature 0.05
    python examples/train_cached_mnr.py examples/configs/cached_mnr.yaml  # everything from a YAML file
    python examples/train_cached_mnr.py --config examples/configs/cached_mnr.yaml --max_steps 2

Defaults: the packaged all-MiniLM-L6-v2, 512 training pairs from the Python standard library
(docstring summary -> function source) with one hard negative each, 256 held-out pairs, batch 64,
mini-batch 16, 64 tokens, one epoch. Writes the model and its card to ``output/examples/cached_mnr``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_cached_losses.demo import EXAMPLE_DEFAULTS, run

DEFAULTS = {
    **EXAMPLE_DEFAULTS,
    "output_dir": "output/examples/cached_mnr",
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, scale=20.0, mini_batch_size=16, ...)
    "scale": 20.0,
}


@dataclass
class MiningArguments:
    """Hard negatives for the (query, document) pairs."""

    hard_negatives: int = field(
        default=1,
        metadata={
            "help": "Hard negatives mined per pair with the model before training (columns negative_1..n); "
            "0 trains on pairs."
        },
    )
    mining_margin: float = field(
        default=0.05,
        metadata={
            "help": "Keep a mined negative only if its similarity is below (1 - margin) x the positive's: "
            "skips near-duplicates of the positive (likely false negatives). 0 keeps the closest ones."
        },
    )


def mine(model, dataset, mining: MiningArguments):
    """(query, document) -> (query, document, negative_1, ..., negative_n), mined with the model."""
    from sentence_transformers.util import mine_hard_negatives

    if mining.hard_negatives <= 0:
        return dataset
    mined = mine_hard_negatives(
        dataset,
        model,
        num_negatives=mining.hard_negatives,
        relative_margin=mining.mining_margin or None,  # skip near-duplicates: likely false negatives
        output_format="n-tuple",
        verbose=False,
    )
    if len(mined) == 0:
        raise ValueError(
            f"mining kept no pair (no candidate below the margin {mining.mining_margin}): lower "
            "--mining_margin, or train on pairs with --hard_negatives 0."
        )
    return mined


def main(argv: list[str] | None = None) -> dict:
    """Parse, mine, train, evaluate before and after, save; returns the run's summary."""
    return run(
        argv,
        DEFAULTS,
        __doc__,
        title="examples/train_cached_mnr.py",
        extra_arguments=(MiningArguments,),
        prepare=mine,
    )


if __name__ == "__main__":
    main()
