"""The demo layer: ``make demo`` (``python -m st_cached_losses.demo``) fine-tunes all-MiniLM-L6-v2 with a
cached loss on text pairs from the Python standard library (:mod:`st_cached_losses.demo.data`).

The top layer: may import the configuration, the losses and everything below them; nothing imports it
(but the ``st_cached_losses.data`` re-export).
"""

from st_cached_losses.demo.app import (
    DemoArguments,
    load_model,
    main,
    pick_metrics,
    retrieval_evaluator,
    stdlib_data,
    train_and_evaluate,
)

__all__ = [
    "DemoArguments",
    "load_model",
    "main",
    "pick_metrics",
    "retrieval_evaluator",
    "stdlib_data",
    "train_and_evaluate",
]
