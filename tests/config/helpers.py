"""What the tests of CachedLossTrainingArguments share: the base arguments, the arguments class of a loss's model kind,
the command line parsed."""

from __future__ import annotations

from transformers import HfArgumentParser

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.registry import LOSS_ALIASES, MODEL_KINDS
from st_cached_losses.config.training_args import (
    ARGUMENTS_CLASSES,
    CachedLossArguments,
    CachedLossTrainingArguments,
)

BASE = {"output_dir": "unused", "use_cpu": True, "report_to": "none"}


def _class_of(loss: str) -> type[CachedLossArguments]:
    """The arguments class that trains the model kind of ``loss`` (a misspelt loss: the default class, which
    names the closest loss)."""
    name = LOSS_ALIASES.get(str(loss).lower(), "mnr")
    return ARGUMENTS_CLASSES[MODEL_KINDS[name]]


def _arguments(**kwargs) -> CachedLossArguments:
    """The arguments of the class that trains the loss's model kind (its trainer takes only that class)."""
    return _class_of(kwargs.get("loss", "mnr"))(**kwargs)


def parse_cli(
    argv: list[str], cls: type[CachedLossArguments] = CachedLossTrainingArguments
) -> CachedLossArguments:
    # sentence-transformers' MultiVectorEncoderTrainingArguments has a field HfArgumentParser refuses (max_length:
    # int | None | dict): CachedLossArgumentParser reads that class, that field included
    parser = HfArgumentParser(cls) if cls.trains != "MultiVectorEncoder" else CachedLossArgumentParser(cls)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "unused", "--use_cpu", "--report_to", "none", *argv]
    )
    return args


ARGS = {**BASE, "per_device_train_batch_size": 8, "mini_batch_size": 4, "learning_rate": 1e-4}
