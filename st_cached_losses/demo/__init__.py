"""The demo layer: ``make demo`` (``python -m st_cached_losses.demo``) fine-tunes all-MiniLM-L6-v2 with a
cached loss on text pairs from the Python standard library ([`st_cached_losses.demo.data`][st_cached_losses.demo.data]).

The top layer: may import the configuration, the losses and everything below them; nothing imports it (but
the ``st_cached_losses.data`` re-export). The app's names load on first use (PEP 562), so that the
standard-library pairs (``data``, the standard library only) load without the trainer's stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: the app's public names (``st_cached_losses.demo.main`` is what ``make demo`` and the tests call)
__all__ = [
    "DemoArguments",
    "load_model",
    "main",
    "pick_metrics",
    "retrieval_evaluator",
    "stdlib_data",
    "train_and_evaluate",
]

if TYPE_CHECKING:
    from st_cached_losses.demo.app import (
        DemoArguments,
        load_model,
        main,
        pick_metrics,
        retrieval_evaluator,
        stdlib_data,
        train_and_evaluate,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("st_cached_losses.demo.app"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'st_cached_losses.demo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
