"""Memory-efficient, exact contrastive losses for sentence-transformers.

The top-level names load on first use (PEP 562), so that ``import st_cached_losses.functional`` (pure
torch) does not pull in sentence-transformers, transformers and accelerate.

The packages, each importing only those before it: ``functional`` (pure torch: the InfoNCE family's value
and gradient, the cross-process strategies) < ``engine`` (GradCache, the wrappers) < ``losses`` <
``config`` (arguments, registry and factory, CLI, model card) < ``demo``. The top-level modules besides
``distributed`` only re-export names under their documented paths.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: public name -> the module that defines it
_EXPORTS = {
    "CachedCLIPLoss": "st_cached_losses.losses",
    "CachedCrossEncoderLoss": "st_cached_losses.losses",
    "CachedDistillKLDivLoss": "st_cached_losses.losses",
    "CachedMarginMSELoss": "st_cached_losses.losses",
    "CachedMultiVectorDistillKLDivLoss": "st_cached_losses.losses",
    "CachedMultiVectorMarginMSELoss": "st_cached_losses.losses",
    "CachedGISTLoss": "st_cached_losses.losses",
    "CachedMNRLoss": "st_cached_losses.losses",
    "CachedMultiVectorLoss": "st_cached_losses.losses",
    "CachedSigLIPLoss": "st_cached_losses.losses",
    "CachedEmbedDistillLoss": "st_cached_losses.losses",
    "CachedSparseLoss": "st_cached_losses.losses",
    "CachedTiledLoss": "st_cached_losses.losses",
    "LossStateCallback": "st_cached_losses.losses.callbacks",
    "CachedLossTrainingArguments": "st_cached_losses.config.training_args",
    "CachedSparseEncoderTrainingArguments": "st_cached_losses.config.training_args",
    "CachedMultiVectorEncoderTrainingArguments": "st_cached_losses.config.training_args",
    "CachedCrossEncoderTrainingArguments": "st_cached_losses.config.training_args",
    "build_loss": "st_cached_losses.config.factory",
    "CachedLossArgumentParser": "st_cached_losses.config.cli",
    "SameDatasetBatchSampler": "st_cached_losses.config.sampling",
    "ListDataCollator": "st_cached_losses.config.collator",
}

__all__ = [
    "CachedCLIPLoss",
    "CachedCrossEncoderLoss",
    "CachedCrossEncoderTrainingArguments",
    "CachedDistillKLDivLoss",
    "CachedEmbedDistillLoss",
    "CachedGISTLoss",
    "CachedLossArgumentParser",
    "CachedLossTrainingArguments",
    "CachedMNRLoss",
    "CachedMarginMSELoss",
    "CachedMultiVectorDistillKLDivLoss",
    "CachedMultiVectorEncoderTrainingArguments",
    "CachedMultiVectorLoss",
    "CachedMultiVectorMarginMSELoss",
    "CachedSigLIPLoss",
    "CachedSparseEncoderTrainingArguments",
    "CachedSparseLoss",
    "CachedTiledLoss",
    "ListDataCollator",
    "LossStateCallback",
    "SameDatasetBatchSampler",
    "__version__",
    "build_loss",
    "functional",
]

if TYPE_CHECKING:
    from st_cached_losses import functional
    from st_cached_losses.config.cli import CachedLossArgumentParser
    from st_cached_losses.config.collator import ListDataCollator
    from st_cached_losses.config.factory import build_loss
    from st_cached_losses.config.sampling import SameDatasetBatchSampler
    from st_cached_losses.config.training_args import (
        CachedCrossEncoderTrainingArguments,
        CachedLossTrainingArguments,
        CachedMultiVectorEncoderTrainingArguments,
        CachedSparseEncoderTrainingArguments,
    )
    from st_cached_losses.losses import (
        CachedCLIPLoss,
        CachedCrossEncoderLoss,
        CachedDistillKLDivLoss,
        CachedEmbedDistillLoss,
        CachedGISTLoss,
        CachedMarginMSELoss,
        CachedMNRLoss,
        CachedMultiVectorDistillKLDivLoss,
        CachedMultiVectorLoss,
        CachedMultiVectorMarginMSELoss,
        CachedSigLIPLoss,
        CachedSparseLoss,
        CachedTiledLoss,
    )
    from st_cached_losses.losses.callbacks import LossStateCallback


def __getattr__(name: str) -> Any:
    if name == "functional":
        return importlib.import_module("st_cached_losses.functional")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'st_cached_losses' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
