"""Where a warning should point: the user's line, not the library frames between it and the warning.

A loss warns from inside ``forward``, which the trainer calls through transformers, sentence-transformers and
torch's module machinery; the arguments warn from a dataclass ``__init__`` that ``HfArgumentParser`` may call.
A fixed ``stacklevel`` points into one of those libraries on some route, so [`user_stacklevel`][st_cached_losses.engine.caller.user_stacklevel] walks the
stack out of them (``warnings.warn``'s ``skip_file_prefixes`` would do it from Python 3.12 only).
"""

from __future__ import annotations

import inspect
from types import FrameType

__all__ = ["LIBRARY_PACKAGES", "user_stacklevel"]

#: top-level packages whose frames stand between the user's line and a warning
LIBRARY_PACKAGES = ("torch", "transformers", "sentence_transformers", "accelerate", "datasets")
#: this package's library layers (the demo and the examples are a user's code: a warning points at them)
_OUR_LAYERS = (
    "functional",
    "engine",
    "losses",
    "config",
    "training_args",
    "model_card",
    "distributed",
    "data",
)


def _is_library(frame: FrameType) -> bool:
    module = str(frame.f_globals.get("__name__", ""))
    parts = module.split(".")
    if frame.f_code.co_filename.startswith("<") and frame.f_code.co_name == "__init__":
        return (
            True  # the __init__ dataclasses generate (the arguments classes), called by the user or a parser
        )
    if parts[0] in LIBRARY_PACKAGES:
        return True
    return parts[0] == "st_cached_losses" and (len(parts) == 1 or parts[1] in _OUR_LAYERS)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` point at the first frame outside the
    libraries (`LIBRARY_PACKAGES` and this package's layers): the user's line.

    Call it in the argument list of ``warnings.warn`` (``stacklevel=user_stacklevel()``). Where every frame
    is a library's, the outermost one is named."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_back is not None and _is_library(frame):
        frame = frame.f_back
        level += 1
    return level
