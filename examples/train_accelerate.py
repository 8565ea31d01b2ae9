"""Multi-process training with a cached loss: ``accelerate launch`` and the stock trainer.

Each process holds ``--per_device_train_batch_size`` rows of every global batch and, with
``--gather_across_devices`` (on here), scores them against the candidates of every process: the
gradients are exactly those of the global batch (per-device batch x processes), with the memory of one
encoder mini-batch per process. ``--loss tiled`` passes the candidate blocks around a ring instead.

Launch (every option is a field of ``CachedLossTrainingArguments`` or of the data arguments)::

    # two gloo processes on a CPU-only machine (accelerate's --cpu launcher would start only one)
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py
    # 8 GPUs, global batch 8 x 1024, ring exchange
    accelerate launch --multi_gpu --num_processes 8 examples/train_accelerate.py \\
        --loss tiled --symmetric true --per_device_train_batch_size 1024 --mini_batch_size 64
    # several machines: the usual accelerate flags on each (--num_machines, --machine_rank,
    # --main_process_ip, --main_process_port), the same script and arguments
    # one process also works (gather_across_devices then warns once and does nothing):
    python examples/train_accelerate.py --max_steps 2

Defaults: the packaged all-MiniLM-L6-v2, 512 training pairs from the Python standard library, 256
held-out pairs, 32 rows per process, mini-batch 8, CachedMNRLoss with duplicate masking, 64 tokens, one
epoch. Writes to ``output/examples/accelerate`` (main process).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from st_cached_losses.demo import EXAMPLE_DEFAULTS, run

DEFAULTS = {
    **EXAMPLE_DEFAULTS,
    "output_dir": "output/examples/accelerate",
    "loss": "mnr",
    "gather_across_devices": True,  # negatives from every process: the gradients of the global batch
    "mask_duplicates": True,
    "per_device_train_batch_size": 32,
    "mini_batch_size": 8,
}


def main(argv: list[str] | None = None) -> dict:
    """Parse, train on every process, evaluate before and after, save from the main process."""
    return run(argv, DEFAULTS, __doc__, title="examples/train_accelerate.py")


if __name__ == "__main__":
    main()
