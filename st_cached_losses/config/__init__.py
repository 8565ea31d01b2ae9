"""The configuration layer: a run's arguments (``CachedLossTrainingArguments``, their checks), the loss
registry and factory (``build_loss``), the command-line / YAML / JSON parser and the model card.

May import the losses, the engine and the functional layer; nothing above it (the demo).
"""

from st_cached_losses.config.cli import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.model_card import CachedLossCardCallback
from st_cached_losses.config.training_args import (
    CachedCrossEncoderTrainingArguments,
    CachedLossTrainingArguments,
)

__all__ = [
    "CachedCrossEncoderTrainingArguments",
    "CachedLossArgumentParser",
    "CachedLossCardCallback",
    "CachedLossTrainingArguments",
    "build_loss",
    "check_dataset_columns",
]
