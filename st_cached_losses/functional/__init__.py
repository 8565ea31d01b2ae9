"""Pure-torch loss math (InfoNCE, SigLIP's sigmoid loss): exact, chunked or tiled, with gradients wrt the
embeddings.

Imports nothing from sentence_transformers or accelerate. Its rooms, each importing only those before it:
the shared floor (``checks``, ``precision``, ``distributed``, ``keys``; ``kernels/``, the tiles' building blocks
and the Triton kernels; ``score``; ``placement``: where the rows are, for every family) <
``representations/`` (multi-vector and sparse rows) < the families, ``softmax/`` (InfoNCE) and ``sigmoid/``
(SigLIP's loss), which never import each other; ``distill/`` (distillation) reads the shared floor only.

The names below load on first use (PEP 562), so that importing one family loads nothing of the other. The
modules' paths from before the rooms keep importing ([`old_paths`][st_cached_losses.functional.old_paths])."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from st_cached_losses.functional.old_paths import install

#: public name -> the module that defines it
_EXPORTS = {
    "DEFAULT_MEMORY_BUDGET": "st_cached_losses.functional.kernels.tiles",
    "Guide": "st_cached_losses.functional.softmax.options",
    "InfoNCEOptions": "st_cached_losses.functional.softmax.options",
    "InfoNCEOutput": "st_cached_losses.functional.softmax.loss",
    "LossPath": "st_cached_losses.functional.placement",
    "SigmoidOptions": "st_cached_losses.functional.sigmoid.options",
    "SigmoidOutput": "st_cached_losses.functional.sigmoid.options",
    "Similarity": "st_cached_losses.functional.score",
    "check_positive_int": "st_cached_losses.functional.checks",
    "infonce": "st_cached_losses.functional.softmax.loss",
    "infonce_loss_and_grad": "st_cached_losses.functional.softmax.loss",
    "scale_value": "st_cached_losses.functional.checks",
    "sigmoid_loss": "st_cached_losses.functional.sigmoid.loss",
    "sigmoid_loss_and_grad": "st_cached_losses.functional.sigmoid.loss",
}

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Guide",
    "InfoNCEOptions",
    "InfoNCEOutput",
    "LossPath",
    "SigmoidOptions",
    "SigmoidOutput",
    "Similarity",
    "check_positive_int",
    "infonce",
    "infonce_loss_and_grad",
    "scale_value",
    "sigmoid_loss",
    "sigmoid_loss_and_grad",
]

if TYPE_CHECKING:
    from st_cached_losses.functional.checks import check_positive_int, scale_value
    from st_cached_losses.functional.kernels.tiles import DEFAULT_MEMORY_BUDGET
    from st_cached_losses.functional.placement import LossPath
    from st_cached_losses.functional.score import Similarity
    from st_cached_losses.functional.sigmoid.loss import sigmoid_loss, sigmoid_loss_and_grad
    from st_cached_losses.functional.sigmoid.options import SigmoidOptions, SigmoidOutput
    from st_cached_losses.functional.softmax.loss import InfoNCEOutput, infonce, infonce_loss_and_grad
    from st_cached_losses.functional.softmax.options import Guide, InfoNCEOptions


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Face(ModuleType):
    """The package's module. An old path named like one of its entry points (``functional.infonce``, the module
    now at ``softmax.loss``) imported through [`old_paths`][st_cached_losses.functional.old_paths] is bound on
    this module by the import system, as any submodule is: the name stays the entry point's."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and name in _EXPORTS:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
install()
