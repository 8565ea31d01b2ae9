"""The loss factory: the cached loss a run's arguments describe, and the check of a dataset against it.

[`build_loss`][st_cached_losses.config.factory.build_loss] builds the loss from ``CachedLossTrainingArguments`` (its class from the registry, its
settings from the arguments, GIST's guide loaded on the model's device); [`check_dataset_columns`][st_cached_losses.config.factory.check_dataset_columns]
checks, before any training step, that a dataset has the text columns that loss needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

from torch import nn

from st_cached_losses.config.registry import BASE_LOSSES, DISTILLATION_LOSSES, MODEL_KINDS
from st_cached_losses.config.training_args import ARGUMENTS_CLASSES, CachedLossArguments, user_stacklevel
from st_cached_losses.losses import CachedGISTLoss, CachedLoss

__all__ = ["LABEL_COLUMNS", "build_loss", "check_dataset_columns"]

#: the label columns sentence-transformers' data collator takes out of a batch (the first one found)
LABEL_COLUMNS = ("label", "labels", "score", "scores")


def build_loss(model: nn.Module, args: CachedLossArguments, train_dataset: Any | None = None) -> CachedLoss:
    """The cached loss ``args`` describe, for ``model`` (pass it as ``loss=`` to the trainer).

    Args:
        model: the model to train, of the kind the loss needs (``args.model_kind``): a SentenceTransformer
            for 'mnr', 'clip', 'tiled' and 'gist', a SparseEncoder for 'sparse' (and 'sparse_distill_kl',
            'sparse_margin_mse'), a MultiVectorEncoder for
            'multi_vector', a CrossEncoder for 'cross_encoder' (another of these kinds raises a ``ValueError`` naming the one needed).
        args: the run's arguments; ``args.loss`` picks the class, the other loss fields its settings.
        train_dataset: optional; when given, checked against the loss with [`check_dataset_columns`][st_cached_losses.config.factory.check_dataset_columns],
            so that a dataset with too few text columns fails here rather than in the first training step.

    Returns:
        A [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss], [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss], [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss], [`CachedGISTLoss`][st_cached_losses.losses.cached_gist.CachedGISTLoss]
        (its guide loaded from ``args.guide_model`` on the model's device; self-guided without one), [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss] (its base
        loss a ``SparseMultipleNegativesRankingLoss`` built from the fields, or for 'sparse_distill_kl' /
        'sparse_margin_mse' a ``SparseDistillKLDivLoss`` / ``SparseMarginMSELoss``; the regularisers ``FlopsLoss``),
        [`CachedMultiVectorLoss`][st_cached_losses.losses.cached_multi_vector.CachedMultiVectorLoss] or [`CachedCrossEncoderLoss`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss].
    """
    if not isinstance(args, CachedLossArguments):
        raise TypeError(
            f"build_loss needs CachedLossTrainingArguments (or CachedSparseEncoderTrainingArguments / "
            f"CachedMultiVectorEncoderTrainingArguments), got {type(args).__name__}; parse the run's arguments "
            "with st_cached_losses.CachedLossArgumentParser, or build CachedLossTrainingArguments(...) directly."
        )
    check_model_kind(model, args)
    if train_dataset is not None:
        check_dataset_columns(train_dataset, args)
    base = BASE_LOSSES.get(args.loss)
    if base is not None:
        return cast(Any, args.loss_class)(model, base(model, **args.base_loss_kwargs()), **args.loss_kwargs())
    if args.loss == "gist":
        from sentence_transformers import SentenceTransformer

        device = next(model.parameters()).device
        guide = SentenceTransformer(str(args.guide_model), device=str(device)) if args.guide_model else None
        return CachedGISTLoss(model, guide, **args.loss_kwargs())  # no guide_model: self-guided
    if args.loss == "embed_distill" and args.teacher_model:
        from sentence_transformers import SentenceTransformer

        device = next(model.parameters()).device
        teacher = SentenceTransformer(str(args.teacher_model), device=str(device)).requires_grad_(False)
        return cast(Any, args.loss_class)(model, teacher=teacher, **args.loss_kwargs())
    return args.loss_class(model, **args.loss_kwargs())


def check_model_kind(model: nn.Module, args: CachedLossArguments) -> None:
    """A sentence-transformers model of another kind than the loss trains (a SentenceTransformer for
    'sparse', say) raises a ``ValueError`` naming the kind the loss needs and its trainer; a module of none
    of these kinds (a user's own) is left to the loss."""
    import sentence_transformers

    kinds = {kind: getattr(sentence_transformers, kind) for kind in set(MODEL_KINDS.values())}
    needed = args.model_kind
    found = [kind for kind, cls in kinds.items() if isinstance(model, cls)]
    if found and needed not in found:
        raise ValueError(
            f"loss={args.loss!r} ({args.loss_class.__name__}) trains a {needed}, got a {found[0]}: load the model "
            f"as sentence_transformers.{needed}(...) and train it with {needed}Trainer and "
            f"{ARGUMENTS_CLASSES[needed].__name__}, or choose a loss for a "
            f"{found[0]}: "
            + ", ".join(repr(name) for name, kind in MODEL_KINDS.items() if kind == found[0])
            + "."
        )


def _text_columns(column_names: Sequence[str]) -> list[str]:
    """The columns sentence-transformers' collator hands to the loss: all but one label column and
    ``dataset_name``."""
    columns = [c for c in column_names if c != "dataset_name"]
    for label in LABEL_COLUMNS:
        if label in columns:
            columns.remove(label)
            break
    return columns


def check_dataset_columns(dataset: Any, args: CachedLossArguments, name: str = "train_dataset") -> None:
    """Check, before any training step, that ``dataset`` suits the loss ``args`` describe.

    The cached losses need at least two text columns, ``(anchor, positive[, negative_1, ...])``; a label
    or score column is not one. A ``DatasetDict`` (or a dict of datasets, one loss for all) is checked
    dataset by dataset. A dataset smaller than one batch only warns, and so does a negative bank that holds
    much of an epoch in a run of several epochs (rows would meet their own earlier copy among its negatives).

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
    # a loss of one column's rows (embedding distillation) says so; the contrastive losses need two
    minimum = getattr(args.loss_class, "min_text_columns", 2)
    if len(texts) < minimum < 2:
        raise ValueError(
            f"{name} has columns {list(column_names)}, so {loss_name} (loss={args.loss!r}) would get no text "
            "column; it needs at least one. A 'label'/'score' column is not a text column."
        )
    if len(texts) < minimum:
        raise ValueError(
            f"{name} has columns {list(column_names)}, so {loss_name} (loss={args.loss!r}) would get "
            f"{len(texts)} text column(s) {texts}; it needs at least two: (anchor, positive[, negative_1, ...]). "
            "A 'label'/'score' column is not a text column. Add a positive column, e.g. "
            "dataset.add_column('positive', ...)."
        )
    if args.loss in DISTILLATION_LOSSES:
        labels = [c for c in LABEL_COLUMNS if c in column_names]
        if len(texts) < 3 or not labels:
            raise ValueError(
                f"{name} has columns {list(column_names)}, so {loss_name} (loss={args.loss!r}) would get "
                f"{len(texts)} text column(s) {texts} and {'label column ' + repr(labels[0]) if labels else 'no label column'}; "
                "it needs (query, positive, negative_1[, ...]) text columns and the teacher's scores in a 'label' "
                "(or 'score') column: one score per candidate column (or, for a margin loss, the margins)."
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
            stacklevel=user_stacklevel(),
        )
    if num_rows:
        _warn_if_the_bank_sees_an_epoch_again(num_rows, len(texts) - 1, args, name)


def _reaches_a_second_epoch(args: Any, steps: int) -> bool:
    """Whether a run of ``args`` trains past its first epoch of ``steps`` loss calls (micro-batches) per
    process: ``max_steps`` (optimizer steps, each of ``gradient_accumulation_steps`` micro-batches) when it is
    set, which overrides ``num_train_epochs`` as in the trainer; else ``num_train_epochs`` above 1."""
    max_steps = getattr(args, "max_steps", -1)
    if max_steps is not None and max_steps > 0:
        accumulation = max(getattr(args, "gradient_accumulation_steps", 1) or 1, 1)
        return max_steps * accumulation > steps
    return getattr(args, "num_train_epochs", 1) > 1


#: the share of a later epoch's rows meeting their own earlier copy in the negative bank above which
#: ``check_dataset_columns`` warns
BANK_REPEAT_WARNING = 0.05


def _warn_if_the_bank_sees_an_epoch_again(num_rows: int, candidates: int, args: Any, name: str) -> None:
    """A negative bank spanning ``K`` steps of an epoch of ``S`` (per process) holds, from the second epoch on,
    the earlier copy of a row whose two visits are at most ``K`` steps apart: reshuffled, a share of about
    ``K (K + 1) / (2 S^2)`` of the rows (all of them once ``K >= 2 S``), each scored against its own positive
    embedded an epoch earlier, a negative nearly as strong as the positive. Warn above
    ``BANK_REPEAT_WARNING``."""
    size = getattr(args, "negative_bank_size", 0) or 0
    batch = args.per_device_train_batch_size
    steps = max(1, -(-num_rows // (batch * max(args.world_size, 1))))  # S: one loss call per micro-batch
    if not size or not _reaches_a_second_epoch(args, steps):
        return
    span = -(-size // (batch * max(candidates, 1)))  # K: steps of rows the bank holds
    age = getattr(args, "negative_bank_max_age", None)
    if age is not None:
        span = min(span, age)
    share = 1.0 if span >= 2 * steps else min(1.0, span * (span + 1) / (2 * steps * steps))
    if share >= BANK_REPEAT_WARNING:
        warnings.warn(
            f"{name}: negative_bank_size={size} holds the rows of the last {span} steps of an epoch of {steps} "
            f"per process, so from the second epoch on about {share:.0%} of the rows meet their own positive, "
            "embedded an epoch earlier, among the bank's negatives (scored nearly as the positive). Keep the bank "
            "to a small part of an epoch (a smaller negative_bank_size, or negative_bank_max_age), or train one "
            "epoch.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
