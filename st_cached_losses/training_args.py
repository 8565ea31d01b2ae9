"""Configure a cached loss through TrainingArguments: the arguments class and the loss factory.

``CachedLossTrainingArguments`` adds the loss choice and every loss hyperparameter to
sentence-transformers' ``SentenceTransformerTrainingArguments``. Invalid combinations fail when the
arguments are built, naming the field, before any model is loaded or any training step runs;
``build_loss(model, args)`` builds the loss, and ``check_dataset_columns(dataset, args)`` checks a
dataset against it. The settings are saved with every checkpoint (``training_args.bin``, they are part
of the TrainingArguments) and listed in the model card.

Two jobs that need this class live above it, each in a module of its own: reading it from the command
line, a YAML or a JSON file (:class:`st_cached_losses.cli.CachedLossArgumentParser`, which names the
closest field for a typo) and listing its loss fields in the model card
(:class:`st_cached_losses.model_card.CachedLossCardCallback`).

Example::

    from st_cached_losses import CachedLossArgumentParser, build_loss

    (args,) = CachedLossArgumentParser().parse_yaml_file("run.yaml")
    loss = build_loss(model, args, train_dataset=train_dataset)
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional  # Optional: HfArgumentParser reads these annotations at run time

from sentence_transformers import SentenceTransformerTrainingArguments
from torch import nn

from st_cached_losses.losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.options import resolve_similarity

#: canonical loss name -> class
LOSSES: dict[str, type[CachedInfoNCEBase]] = {
    "mnr": CachedMNRLoss,
    "clip": CachedCLIPLoss,
    "tiled": CachedTiledLoss,
}
#: every accepted spelling (case-insensitive) -> canonical name
LOSS_ALIASES: dict[str, str] = {
    **{name: name for name in LOSSES},
    **{cls.__name__.lower(): name for name, cls in LOSSES.items()},
}
DEFAULT_SCALE = 20.0
#: the label columns sentence-transformers' data collator takes out of a batch (the first one found)
LABEL_COLUMNS = ("label", "labels", "score", "scores")


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# frames that build the arguments on the user's behalf: a warning skips them to point at the user's line
_BUILDER_PACKAGES = ("transformers", "sentence_transformers")
_BUILDER_MODULES = (__name__, "st_cached_losses.cli")


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


@dataclass
class CachedLossTrainingArguments(SentenceTransformerTrainingArguments):
    """``SentenceTransformerTrainingArguments`` plus the choice of cached loss and all its hyperparameters.

    Every field can come from the command line (``--loss clip --temperature 0.05``), a JSON or a YAML
    file through :class:`~st_cached_losses.cli.CachedLossArgumentParser` (or ``HfArgumentParser``).
    Invalid combinations raise a ``ValueError`` naming the field when the arguments are built; a
    ``mini_batch_size`` that is not smaller than ``per_device_train_batch_size`` only warns (the batch
    then fits in one mini-batch: caching is off), at the user's line.
    """

    loss: str = field(
        default="mnr",
        metadata={
            "help": "Which cached loss: 'mnr' (CachedMNRLoss, InfoNCE anchor -> candidates), 'clip' "
            "(CachedCLIPLoss, symmetric InfoNCE) or 'tiled' (CachedTiledLoss, Inf-CL-style tiles, ring across "
            "processes). The class names are accepted too."
        },
    )
    scale: Optional[float] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": f"Similarity scale = 1 / temperature (default {DEFAULT_SCALE:g}); the initial value when "
            "learnable. Give scale or temperature; both only if they agree."
        },
    )
    temperature: Optional[float] = field(  # noqa: UP045
        default=None,
        metadata={"help": "Softmax temperature = 1 / scale, e.g. 0.05. Give scale or temperature."},
    )
    learnable_scale: bool = field(
        default=False,
        metadata={
            "help": "Learn the scale as CLIP's logit_scale = log(scale), clamped at max_scale ('clip' and "
            "'tiled' only)."
        },
    )
    max_scale: float = field(
        default=100.0, metadata={"help": "Upper clamp of a learnable scale (CLIP uses 100)."}
    )
    similarity: str = field(
        default="cosine", metadata={"help": "Similarity of embeddings: 'cosine' or 'dot' (dot product)."}
    )
    mini_batch_size: int = field(
        default=32,
        metadata={
            "help": "Rows per encoder forward (GradCache's chunk): sets the memory, never the result. Should be "
            "smaller than per_device_train_batch_size, or caching is off."
        },
    )
    mini_batch_num_tokens: Optional[int] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "Optional token budget per encoder mini-batch (rows x padded length) instead of a fixed "
            "row count: long texts get smaller mini-batches."
        },
    )
    tile_size: Optional[int] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "'tiled' only: side of a logit tile (default: from a memory budget, at most 2048)."
        },
    )
    symmetric: Optional[bool] = field(  # noqa: UP045
        default=None,
        metadata={
            "help": "'tiled' only: also the positive -> anchors direction, averaged (the CLIP loss); default "
            "false. ('mnr' is one-directional, 'clip' always symmetric.)"
        },
    )
    gather_across_devices: bool = field(
        default=False,
        metadata={
            "help": "Score each process's rows against every process's candidates (multi-GPU / multi-node, "
            "exact global-batch gradients); 'tiled' passes them around a ring instead of gathering."
        },
    )
    mask_duplicates: bool = field(
        default=False,
        metadata={
            "help": "Drop from a row's negatives the candidates whose text equals its positive (false "
            "negatives), also across processes."
        },
    )
    loss_show_progress_bar: bool = field(
        default=False, metadata={"help": "Show tqdm bars over the loss's encoder mini-batches."}
    )

    def __post_init__(self) -> None:
        # ours first: a wrong loss setting is reported before anything else is set up
        self._validate_loss_fields()
        super().__post_init__()

    # ------------------------------------------------------------------ validation

    def _validate_loss_fields(self) -> None:
        key = str(self.loss).lower()
        if key not in LOSS_ALIASES:
            raise ValueError(
                f"loss={self.loss!r} is not a cached loss; choose one of 'mnr', 'clip' or 'tiled' (or a class name: "
                f"CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss).{closest_name_hint(key, list(LOSS_ALIASES))}"
            )
        self.loss = LOSS_ALIASES[key]

        for name in ("scale", "temperature", "max_scale"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
        if (
            self.scale is not None
            and self.temperature is not None
            and not math.isclose(self.scale * self.temperature, 1.0, rel_tol=1e-6)
        ):
            raise ValueError(
                f"scale={self.scale} and temperature={self.temperature} disagree (scale = 1 / temperature = "
                f"{1 / self.temperature:g}); set only one of scale and temperature."
            )
        if self.learnable_scale and self.loss == "mnr":
            raise ValueError(
                "learnable_scale=True is supported by loss='clip' or loss='tiled', not loss='mnr' (a fixed scale)."
            )
        if self.learnable_scale and self.max_scale < self.loss_scale:
            raise ValueError(
                f"max_scale={self.max_scale} must be >= the initial scale {self.loss_scale:g} with learnable_scale."
            )
        if self.symmetric is not None and self.loss != "tiled":
            raise ValueError(
                f"symmetric applies to loss='tiled' only ('mnr' is one-directional, 'clip' always symmetric); "
                f"got loss={self.loss!r}. Remove symmetric, or use loss='tiled'."
            )
        if self.tile_size is not None and self.loss != "tiled":
            raise ValueError(
                f"tile_size applies to loss='tiled' only, got loss={self.loss!r}. Remove tile_size, or use loss='tiled'."
            )
        for name in ("mini_batch_size", "mini_batch_num_tokens", "tile_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        try:  # the names the losses themselves accept
            self.similarity = resolve_similarity(str(self.similarity))
        except ValueError:
            raise ValueError(
                f"similarity must be 'cosine' or 'dot', got {self.similarity!r}: the cached losses never build "
                "the similarity matrix, so only these two are possible."
            ) from None
        batch = self.per_device_train_batch_size
        if self.mini_batch_num_tokens is None and self.mini_batch_size >= batch:
            warnings.warn(
                f"mini_batch_size={self.mini_batch_size} >= per_device_train_batch_size={batch}: every batch fits in "
                "one encoder mini-batch, so caching is off (same result and memory as the non-cached loss). Use a "
                "mini_batch_size smaller than the batch to save memory.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    # ------------------------------------------------------------------ derived settings

    @property
    def loss_scale(self) -> float:
        """The scale the loss starts from: ``scale``, else ``1 / temperature``, else 20."""
        if self.scale is not None:
            return float(self.scale)
        if self.temperature is not None:
            return 1.0 / self.temperature
        return DEFAULT_SCALE

    @property
    def loss_class(self) -> type[CachedInfoNCEBase]:
        """The loss class ``loss`` names."""
        return LOSSES[LOSS_ALIASES[str(self.loss).lower()]]

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the loss constructor (besides the model)."""
        kwargs: dict[str, Any] = {
            "scale": self.loss_scale,
            "similarity_fct": self.similarity,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "gather_across_devices": self.gather_across_devices,
            "mask_duplicates": self.mask_duplicates,
            "show_progress_bar": self.loss_show_progress_bar,
        }
        if self.loss in ("clip", "tiled"):
            kwargs.update(learnable_scale=self.learnable_scale, max_scale=self.max_scale)
        if self.loss == "tiled":
            kwargs.update(symmetric=bool(self.symmetric), tile_size=self.tile_size)
        return kwargs

    def loss_settings(self) -> dict[str, Any]:
        """This class's own fields and their values (what the model card lists for the loss choice)."""
        return {name: getattr(self, name) for name in LOSS_FIELDS}


_INHERITED = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
#: the fields CachedLossTrainingArguments adds to SentenceTransformerTrainingArguments, and their defaults
LOSS_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(CachedLossTrainingArguments) if f.name not in _INHERITED
}
LOSS_FIELDS = tuple(LOSS_DEFAULTS)


def build_loss(
    model: nn.Module, args: CachedLossTrainingArguments, train_dataset: Any | None = None
) -> CachedInfoNCEBase:
    """The cached loss ``args`` describe, for ``model`` (pass it as ``loss=`` to the trainer).

    Args:
        model: the SentenceTransformer to train.
        args: the run's arguments; ``args.loss`` picks the class, the other loss fields its settings.
        train_dataset: optional; when given, checked against the loss with :func:`check_dataset_columns`,
            so that a dataset with too few text columns fails here rather than in the first training step.

    Returns:
        A :class:`CachedMNRLoss`, :class:`CachedCLIPLoss` or :class:`CachedTiledLoss`.
    """
    if not isinstance(args, CachedLossTrainingArguments):
        raise TypeError(
            f"build_loss needs CachedLossTrainingArguments, got {type(args).__name__}; parse the run's arguments "
            "with st_cached_losses.CachedLossArgumentParser, or build CachedLossTrainingArguments(...) directly."
        )
    if train_dataset is not None:
        check_dataset_columns(train_dataset, args)
    return args.loss_class(model, **args.loss_kwargs())


def _text_columns(column_names: Sequence[str]) -> list[str]:
    """The columns sentence-transformers' collator hands to the loss: all but one label column and
    ``dataset_name``."""
    columns = [c for c in column_names if c != "dataset_name"]
    for label in LABEL_COLUMNS:
        if label in columns:
            columns.remove(label)
            break
    return columns


def check_dataset_columns(
    dataset: Any, args: CachedLossTrainingArguments, name: str = "train_dataset"
) -> None:
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
