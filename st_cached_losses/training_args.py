"""Re-export of [`st_cached_losses.config`][st_cached_losses.config] under the documented path that checkpoints pickle."""

from st_cached_losses.config.factory import LABEL_COLUMNS, build_loss, check_dataset_columns
from st_cached_losses.config.registry import (
    DEFAULT_GIST_TEMPERATURE,
    DEFAULT_SCALE,
    DEFAULT_SCALE_LEARNING_RATE,
    LOSS_ALIASES,
    LOSSES,
    closest_name_hint,
)
from st_cached_losses.config.training_args import (
    LOSS_DEFAULTS,
    LOSS_FIELDS,
    SCALE_PARAMETER_PATTERN,
    CachedCrossEncoderTrainingArguments,
    CachedLossArguments,
    CachedLossTrainingArguments,
    CachedMultiVectorEncoderTrainingArguments,
    CachedSparseEncoderTrainingArguments,
)

__all__ = [
    "DEFAULT_GIST_TEMPERATURE",
    "DEFAULT_SCALE",
    "DEFAULT_SCALE_LEARNING_RATE",
    "LABEL_COLUMNS",
    "LOSSES",
    "LOSS_ALIASES",
    "LOSS_DEFAULTS",
    "LOSS_FIELDS",
    "SCALE_PARAMETER_PATTERN",
    "CachedCrossEncoderTrainingArguments",
    "CachedLossArguments",
    "CachedLossTrainingArguments",
    "CachedMultiVectorEncoderTrainingArguments",
    "CachedSparseEncoderTrainingArguments",
    "build_loss",
    "check_dataset_columns",
    "closest_name_hint",
]
