"""Pure-torch loss math (InfoNCE, SigLIP's sigmoid loss): exact, chunked or tiled, with gradients wrt the
embeddings.

Imports nothing from sentence_transformers or accelerate. The modules' paths from before the rooms keep
importing ([`old_paths`][st_cached_losses.functional.old_paths])."""

import sys
from types import ModuleType
from typing import Any

from st_cached_losses.functional.checks import check_positive_int, scale_value
from st_cached_losses.functional.old_paths import install
from st_cached_losses.functional.sigmoid.loss import (
    SigmoidOptions,
    SigmoidOutput,
    sigmoid_loss,
    sigmoid_loss_and_grad,
)
from st_cached_losses.functional.softmax.loss import (
    DEFAULT_MEMORY_BUDGET,
    Guide,
    InfoNCEOptions,
    InfoNCEOutput,
    LossPath,
    Similarity,
    infonce,
    infonce_loss_and_grad,
)

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


class _Face(ModuleType):
    """The package's module. An old path named like one of its entry points (``functional.infonce``, the module
    now at ``softmax.loss``) imported through [`old_paths`][st_cached_losses.functional.old_paths] is bound on
    this module by the import system, as any submodule is: the name stays the entry point's."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and name in __all__:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
install()
