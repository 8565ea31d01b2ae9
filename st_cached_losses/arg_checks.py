"""The checks of CachedLossTrainingArguments' loss fields and of a dataset against them.

:func:`validate_loss_fields` runs when the arguments are built (``CachedLossTrainingArguments.__post_init__``)
and raises a ``ValueError`` naming the field of an invalid combination, before any model is loaded or any
training step runs; it also puts the fields in their canonical form (the loss's name, the similarity's,
``directions`` as a comma-separated string). :func:`check_dataset_columns` checks a dataset against the loss
the arguments describe. Both warn at the user's line (:func:`_user_stacklevel`), whichever route built the
arguments.

This module sits below :mod:`st_cached_losses.training_args` (which re-exports its public names): it takes
the arguments object and never imports the arguments class at run time.
"""

from __future__ import annotations

import difflib
import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from st_cached_losses.losses import CachedCLIPLoss, CachedGISTLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.options import (
    ONE_DIRECTION,
    TWO_DIRECTIONS,
    check_directions,
    check_hardness,
    resolve_similarity,
)

#: A ``CachedLossTrainingArguments`` (only its loss fields are read). Not imported: training_args imports
#: these checks, and imports point one way.
LossArgs = Any

#: canonical loss name -> class
LOSSES: dict[str, type[CachedInfoNCEBase]] = {
    "mnr": CachedMNRLoss,
    "clip": CachedCLIPLoss,
    "tiled": CachedTiledLoss,
    "gist": CachedGISTLoss,
}
#: every accepted spelling (case-insensitive) -> canonical name
LOSS_ALIASES: dict[str, str] = {
    **{name: name for name in LOSSES},
    **{cls.__name__.lower(): name for name, cls in LOSSES.items()},
}
#: the default learning rate of a learnable scale (its own optimizer group, see ``scale_learning_rate``)
DEFAULT_SCALE_LEARNING_RATE = 1e-2
#: the label columns sentence-transformers' data collator takes out of a batch (the first one found)
LABEL_COLUMNS = ("label", "labels", "score", "scores")


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# frames that build the arguments on the user's behalf: a warning skips them to point at the user's line
_BUILDER_PACKAGES = ("transformers", "sentence_transformers")
_BUILDER_MODULES = ("st_cached_losses.training_args", __name__, "st_cached_losses.cli")


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` point at the user's line.

    The arguments are built by the user's own ``CachedLossTrainingArguments(...)`` call, or inside
    ``CachedLossArgumentParser`` / ``HfArgumentParser`` (through the ``__init__`` dataclasses generate),
    so a fixed stacklevel points into a library on one of the routes; this skips those frames.
    """
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_back is not None:
        module = str(frame.f_globals.get("__name__", ""))
        generated_init = frame.f_code.co_filename.startswith("<") and frame.f_code.co_name == "__init__"
        if not (generated_init or module.split(".")[0] in _BUILDER_PACKAGES or module in _BUILDER_MODULES):
            break
        frame = frame.f_back
        level += 1
    return level


# ---------------------------------------------------------------------- the loss fields


def validate_loss_fields(args: LossArgs) -> None:
    """Check the loss fields of ``args`` and put them in canonical form (``args.loss``, ``args.similarity``).

    Raises:
        ValueError: naming the field of an invalid value or combination.
    """
    key = str(args.loss).lower()
    if key not in LOSS_ALIASES:
        raise ValueError(
            f"loss={args.loss!r} is not a cached loss; choose one of 'mnr', 'clip', 'tiled' or 'gist' (or a class "
            f"name: CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss, CachedGISTLoss).{closest_name_hint(key, list(LOSS_ALIASES))}"
        )
    args.loss = LOSS_ALIASES[key]

    for name in ("scale", "temperature", "max_scale"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    if (
        args.scale is not None
        and args.temperature is not None
        and not math.isclose(args.scale * args.temperature, 1.0, rel_tol=1e-6)
    ):
        raise ValueError(
            f"scale={args.scale} and temperature={args.temperature} disagree (scale = 1 / temperature = "
            f"{1 / args.temperature:g}); set only one of scale and temperature."
        )
    validate_option_fields(args)
    if args.learnable_scale and args.loss in ("mnr", "gist"):
        raise ValueError(
            f"learnable_scale=True is supported by loss='clip' or loss='tiled', not loss={args.loss!r} (a fixed "
            "scale)."
        )
    rate = args.scale_learning_rate
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0
    ):
        raise ValueError(
            f"scale_learning_rate must be a finite number >= 0 (0 or None: the scale trains at learning_rate), "
            f"got {rate!r}; e.g. {DEFAULT_SCALE_LEARNING_RATE:g}."
        )
    if args.learnable_scale and args.max_scale < args.loss_scale:
        raise ValueError(
            f"max_scale={args.max_scale} must be >= the initial scale {args.loss_scale:g} with learnable_scale."
        )
    if args.symmetric is not None and args.loss != "tiled":
        raise ValueError(
            f"symmetric applies to loss='tiled' only ('mnr' is one-directional, 'clip' always symmetric); "
            f"got loss={args.loss!r}. Remove symmetric, or use loss='tiled'."
        )
    if args.tile_size is not None and args.loss != "tiled":
        raise ValueError(
            f"tile_size applies to loss='tiled' only, got loss={args.loss!r}. Remove tile_size, or use loss='tiled'."
        )
    for name in ("mini_batch_size", "mini_batch_num_tokens", "tile_size"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    try:  # the names the losses themselves accept
        args.similarity = str(resolve_similarity(str(args.similarity)))  # a name: always "cosine" or "dot"
    except ValueError:
        raise ValueError(
            f"similarity must be 'cosine' or 'dot', got {args.similarity!r}: the cached losses never build "
            "the similarity matrix, so only these two are possible."
        ) from None
    batch = args.per_device_train_batch_size
    if args.mini_batch_num_tokens is None and args.mini_batch_size >= batch:
        warnings.warn(
            f"mini_batch_size={args.mini_batch_size} >= per_device_train_batch_size={batch}: every batch fits in "
            "one encoder mini-batch, so caching is off (same result and memory as the non-cached loss). Use a "
            "mini_batch_size smaller than the batch to save memory.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )


def validate_option_fields(args: LossArgs) -> None:
    """The MNRL options (as the losses check them) and GIST's fields, each only where it applies."""
    gist_fields = {
        "guide_model": None,
        "margin_strategy": "absolute",
        "margin": 0.0,
        "contrast_anchors": True,
        "contrast_positives": True,
    }
    mnrl_fields = {
        "directions": None,
        "partition_mode": None,
        "hardness_mode": None,
        "hardness_strength": 0.0,
    }
    if args.loss == "gist":
        if not args.guide_model:
            raise ValueError(
                "loss='gist' needs guide_model: the path of the guide SentenceTransformer (e.g. the model "
                "before fine-tuning, or a stronger one)."
            )
        for name, default in {**mnrl_fields, "mask_duplicates": False}.items():
            if getattr(args, name) != default:
                raise ValueError(f"{name} does not apply to loss='gist' (GISTEmbed's own terms); remove it.")
        if args.similarity != "cosine":
            raise ValueError("loss='gist' compares cosine similarities; remove similarity (or set 'cosine').")
        if args.margin_strategy not in ("absolute", "relative"):
            raise ValueError(
                f"margin_strategy must be 'absolute' or 'relative', got {args.margin_strategy!r}."
            )
        if not math.isfinite(args.margin):
            raise ValueError(f"margin must be a finite number, got {args.margin!r}.")
        return
    for name, unset in gist_fields.items():
        if getattr(args, name) != unset:
            raise ValueError(f"{name} applies to loss='gist' only, got loss={args.loss!r}. Remove {name}.")
    if isinstance(args.directions, (list, tuple)):  # given as a list in Python or YAML
        args.directions = ",".join(args.directions)
    if args.directions is not None or args.partition_mode is not None:
        directions = args.loss_directions or (TWO_DIRECTIONS if args.loss == "clip" else ONE_DIRECTION)
        check_directions(directions, args.loss_partition_mode, "directions")
        if args.symmetric is not None:
            raise ValueError("give either symmetric or directions / partition_mode, not both.")
    check_hardness(args.hardness_mode, args.hardness_strength, "hardness_mode")


# ---------------------------------------------------------------------- a dataset against the loss


def _text_columns(column_names: Sequence[str]) -> list[str]:
    """The columns sentence-transformers' collator hands to the loss: all but one label column and
    ``dataset_name``."""
    columns = [c for c in column_names if c != "dataset_name"]
    for label in LABEL_COLUMNS:
        if label in columns:
            columns.remove(label)
            break
    return columns


def check_dataset_columns(dataset: Any, args: LossArgs, name: str = "train_dataset") -> None:
    """Check, before any training step, that ``dataset`` suits the loss ``args`` describe.

    The cached losses need at least two text columns, ``(anchor, positive[, negative_1, ...])``; a label
    or score column is not one. A ``DatasetDict`` (or a dict of datasets, one loss for all) is checked
    dataset by dataset. A dataset smaller than one batch only warns.

    Args:
        dataset: a ``datasets.Dataset``, ``IterableDataset`` or a dict of them.
        args: the run's arguments.
        name: how to call the dataset in messages.

    Raises:
        ValueError: naming the dataset, its columns and the loss.
    """
    if isinstance(dataset, Mapping):
        for key, part in dataset.items():
            check_dataset_columns(part, args, name=f"{name}[{key!r}]")
        return
    column_names = getattr(dataset, "column_names", None)
    if column_names is None:  # an IterableDataset whose features are unknown until iterated
        return
    texts = _text_columns(list(column_names))
    loss_name = args.loss_class.__name__
    if len(texts) < 2:
        raise ValueError(
            f"{name} has columns {list(column_names)}, so {loss_name} (loss={args.loss!r}) would get "
            f"{len(texts)} text column(s) {texts}; it needs at least two: (anchor, positive[, negative_1, ...]). "
            "A 'label'/'score' column is not a text column. Add a positive column, e.g. "
            "dataset.add_column('positive', ...)."
        )
    num_rows = getattr(dataset, "num_rows", None)
    if num_rows == 0:
        raise ValueError(f"{name} is empty: there is nothing to train {loss_name} on.")
    if num_rows is not None and num_rows < args.per_device_train_batch_size * max(args.world_size, 1):
        warnings.warn(
            f"{name} has {num_rows} rows, fewer than one global batch "
            f"({args.per_device_train_batch_size} x {args.world_size} processes): each step sees fewer in-batch "
            "negatives than configured.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )
