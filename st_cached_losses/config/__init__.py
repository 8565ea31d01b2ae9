"""The configuration layer: a run's arguments (``CachedLossTrainingArguments`` and its sparse and multi-vector
counterparts, their checks), the loss
registry and factory (``build_loss``), the command-line / YAML / JSON parser, the model card and the
multi-dataset batch sampler (``SameDatasetBatchSampler``) and the data collator for list-valued columns
(``ListDataCollator``).

May import the losses, the engine and the functional layer; nothing above it (the demo).
"""

from st_cached_losses.config.cli import CachedLossArgumentParser
from st_cached_losses.config.collator import ListDataCollator
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.model_card import CachedLossCardCallback
from st_cached_losses.config.sampling import SameDatasetBatchSampler
from st_cached_losses.config.training_args import (
    CachedCrossEncoderTrainingArguments,
    CachedLossArguments,
    CachedLossTrainingArguments,
    CachedMultiVectorEncoderTrainingArguments,
    CachedSparseEncoderTrainingArguments,
)

__all__ = [
    "CachedCrossEncoderTrainingArguments",
    "CachedLossArgumentParser",
    "CachedLossArguments",
    "CachedLossCardCallback",
    "CachedLossTrainingArguments",
    "CachedMultiVectorEncoderTrainingArguments",
    "CachedSparseEncoderTrainingArguments",
    "ListDataCollator",
    "SameDatasetBatchSampler",
    "build_loss",
    "check_dataset_columns",
]
