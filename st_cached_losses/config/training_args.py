"""Configure a cached loss through TrainingArguments: the arguments classes and the checks of their fields.

``CachedLossArguments`` holds the loss choice and every loss hyperparameter, one field per setting; mixed
into each model kind's arguments, it makes the class that kind's trainer takes ([`ARGUMENTS_CLASSES`][st_cached_losses.config.training_args.ARGUMENTS_CLASSES]):
``CachedLossTrainingArguments`` (``SentenceTransformerTrainingArguments``),
``CachedSparseEncoderTrainingArguments``, ``CachedMultiVectorEncoderTrainingArguments`` and
``CachedCrossEncoderTrainingArguments`` (``SparseEncoder...``, ``MultiVectorEncoder...``,
``CrossEncoderTrainingArguments``). Invalid combinations fail when the arguments are built
([`validate_loss_fields`][st_cached_losses.config.training_args.validate_loss_fields], run by ``__post_init__``), naming the field, before any model is loaded or any
training step runs. The settings are saved with every checkpoint (``training_args.bin``) and listed in the
model card.

Below this module: the loss registry ([`st_cached_losses.config.registry`][st_cached_losses.config.registry]). Above it: the factory that
builds the loss and checks a dataset against it ([`st_cached_losses.config.factory`][st_cached_losses.config.factory]), the parser for the
command line, YAML and JSON ([`st_cached_losses.config.cli`][st_cached_losses.config.cli]) and the model card
([`st_cached_losses.config.model_card`][st_cached_losses.config.model_card]).

Example:

```python
from st_cached_losses import CachedLossArgumentParser, build_loss

(args,) = CachedLossArgumentParser().parse_yaml_file("run.yaml")
loss = build_loss(model, args, train_dataset=train_dataset)
```
"""

# No ``from __future__ import annotations`` here: the fields' annotations are real objects, so that
# ``typing.get_type_hints`` (HfArgumentParser, the CLI) needs no module namespace to resolve them; the
# class's ``__module__`` is its documented path (set just below the class).

import dataclasses
import difflib
import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union  # HfArgumentParser reads these annotations at run time

import torch
from sentence_transformers import SentenceTransformerTrainingArguments
from sentence_transformers.base.training_args import BaseTrainingArguments
from sentence_transformers.cross_encoder import CrossEncoderTrainingArguments
from sentence_transformers.multi_vector_encoder import MultiVectorEncoderTrainingArguments
from sentence_transformers.sparse_encoder import SparseEncoderTrainingArguments

from st_cached_losses.config.registry import (
    BASE_LOSSES,
    BASE_SIMILARITY,
    DEFAULT_SCALE_LEARNING_RATE,
    FIELD_NAMES,
    LOSS_ALIASES,
    LOSSES,
    MODEL_KINDS,
    NOT_FIELDS,
    ST_LOSS_NAMES,
    accepts,
    base_parameters,
    canonical_loss,
    closest_name_hint,
    declaration,
    field_takers,
    loss_default,
    loss_parameters,
    own_parameters,
)
from st_cached_losses.config.sampling import DATASET_ORDERS, SameDatasetBatchSampler
from st_cached_losses.engine.caller import user_stacklevel  # the warnings point at the user's line
from st_cached_losses.engine.checks import check_auto_budget, is_auto, rows_fit_in_one, warn_caching_off
from st_cached_losses.losses import CachedLoss, registry
from st_cached_losses.losses.ranking import RankingSettings, check_directions, check_hardness
from st_cached_losses.losses.settings import Settings, check_bool, check_nonnegative
from st_cached_losses.losses.similarity import SimilarityKind

__all__ = [
    "ARGUMENTS_CLASSES",
    "BIAS_PARAMETER_PATTERN",
    "LOSS_DEFAULTS",
    "LOSS_FIELDS",
    "SAME_DATASET",
    "SCALE_PARAMETER_PATTERN",
    "CachedCrossEncoderTrainingArguments",
    "CachedLossArguments",
    "CachedLossTrainingArguments",
    "CachedMultiVectorEncoderTrainingArguments",
    "CachedSparseEncoderTrainingArguments",
    "loss_field",
    "user_stacklevel",
    "validate_loss_fields",
]

#: the ``learning_rate_mapping`` pattern of a loss's learnable scale, as the trainer names it among the loss's
#: parameters: ``logit_scale`` (one loss), ``<name>.logit_scale`` (a dict of losses), ``loss.logit_scale``
#: (inside MatryoshkaLoss); never a parameter of the model the loss holds (``model.0...logit_scale``, as in a
#: CLIP encoder)
SCALE_PARAMETER_PATTERN = r"^(?!(?:.*\.)?model\.)(?:.*\.)?logit_scale$"
#: the same pattern for a learned bias (SigLIP's ``logit_bias``, 'siglip' with ``learnable``), which trains at
#: the scale's rate
BIAS_PARAMETER_PATTERN = r"^(?!(?:.*\.)?model\.)(?:.*\.)?logit_bias$"
#: what the loss's scale is called among the trainer's parameter names (a user pattern matching one of these
#: already sets the scale's learning rate)
_SCALE_PARAMETER_NAMES = ("logit_scale", "loss.logit_scale")
_BIAS_PARAMETER_NAMES = ("logit_bias", "loss.logit_bias")

#: the value of sentence-transformers' ``multi_dataset_batch_sampler`` that picks
#: `SameDatasetBatchSampler`
SAME_DATASET = "same_dataset"

#: the fields that take a count or "auto" (sized from mini_batch_memory_budget), read so by the command line
COUNT_OR_AUTO_FIELDS = frozenset({"mini_batch_size", "mini_batch_num_tokens"})
#: the fields that take a count or "all" (every one there is), read so by the command line
COUNT_OR_ALL_FIELDS = frozenset({"num_negatives"})


def _names(losses: list[str]) -> str:
    quoted = [f"'{name}'" for name in losses]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _doc(setting: str) -> str:
    """A setting's meaning as its declaration says it (a field's doc, or a view's docstring)."""
    found = declaration(setting)
    if found is not None:
        return str(found.metadata["doc"])
    view = RankingSettings.views().get(setting)
    return " ".join((view.__doc__ or "").split()) if view is not None else ""


#: field name -> the loss setting it sets (every loss field's, filled as the fields are declared)
FIELD_SETTINGS: dict[str, str] = {}
#: field name -> its help without the list of losses that take it (the configuration page lists them apart)
FIELD_MEANINGS: dict[str, str] = {}


def loss_field(setting: str, default: Any = dataclasses.MISSING, *, text: str | None = None) -> Any:
    """The arguments' field of the loss setting ``setting``: its help is the setting's declaration (what it
    means, [`st_cached_losses.losses.settings`][st_cached_losses.losses.settings]) and the losses that take it;
    its default the declaration's (or ``default``: None where the losses' defaults differ, each its own)."""
    losses = field_takers(setting)
    meaning = text if text is not None else _doc(setting)
    help_text = meaning + (f" Losses: {_names(losses)}." if len(losses) < len(LOSSES) else "")
    found = declaration(setting)
    if default is dataclasses.MISSING:
        default = found.default if found is not None else None
    FIELD_SETTINGS[FIELD_NAMES.get(setting, setting)] = setting
    FIELD_MEANINGS[FIELD_NAMES.get(setting, setting)] = meaning
    return field(default=default, metadata={"help": help_text})


def _loss_help() -> str:
    """The help of the ``loss`` field, read from the registry."""
    kinds: dict[str, list[str]] = {}
    for name, cls in LOSSES.items():
        base = BASE_LOSSES.get(name)
        with_base = f" with {base.__name__}" if base is not None and name != cls.name else ""
        kinds.setdefault(cls.model_kind, []).append(f"'{name}' ({cls.__name__}{with_base})")
    listed = "; ".join(f"for a {kind}: {', '.join(names)}" for kind, names in kinds.items())
    theirs = ", ".join(sorted({st for e in registry.names().values() for st in e.st_names}))
    return (
        f"Which cached loss: {listed}. Our class names are accepted too, and sentence-transformers' class names "
        f"for the loss that replaces each ({theirs}, any case)."
    )


_LOSS_HELP = _loss_help()


@dataclass
class CachedLossArguments(BaseTrainingArguments):
    """The choice of cached loss and all its hyperparameters, on top of sentence-transformers' training
    arguments: the one set of fields of the arguments classes, one per model kind, each accepted by that
    kind's trainer (whose data collator stamps each column's task, e.g. ``"query"`` for the first):
    [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] (``SentenceTransformerTrainer``),
    [`CachedSparseEncoderTrainingArguments`][st_cached_losses.training_args.CachedSparseEncoderTrainingArguments] (``SparseEncoderTrainer``),
    [`CachedMultiVectorEncoderTrainingArguments`][st_cached_losses.training_args.CachedMultiVectorEncoderTrainingArguments] (``MultiVectorEncoderTrainer``) and
    [`CachedCrossEncoderTrainingArguments`][st_cached_losses.training_args.CachedCrossEncoderTrainingArguments] (``CrossEncoderTrainer``). Build one of those.

    A loss field sets the loss setting of its name (``similarity`` sets ``similarity_fct``,
    ``loss_show_progress_bar`` ``show_progress_bar``, ``guide_model`` the guide): its help, its check and
    which losses take it are read from the losses' settings declarations
    ([`st_cached_losses.losses.settings`][st_cached_losses.losses.settings]); a setting without a field (a
    loss of your own's) goes in ``loss_options``. Every field can come from the command line (``--loss clip
    --temperature 0.05``), a JSON or a YAML file through
    [`CachedLossArgumentParser`][st_cached_losses.config.cli.CachedLossArgumentParser] (or ``HfArgumentParser``).
    Invalid values and combinations raise a ``ValueError`` naming the field when the arguments are built (the
    chosen loss's settings are built from the fields and checked as a whole), and so do a field set for a
    loss that does not take it and a loss for another model kind than the class trains (naming the class to
    use); a ``mini_batch_size`` of at least twice ``per_device_train_batch_size`` only warns (a batch of pairs,
    both columns' rows together, then fits in one mini-batch: caching is off for it), at the user's line.
    """

    #: the model kind (sentence-transformers' class name) whose trainer takes this arguments class; None: any
    #: (this base class, which no trainer takes)
    trains: ClassVar[str | None] = None

    loss: str = field(default="mnr", metadata={"help": _LOSS_HELP})
    scale: Optional[float] = loss_field(  # noqa: UP045
        "scale",
        None,
        text=_doc("scale")
        + " Give scale or temperature (1 / scale); both only if they agree. Default: the loss's "
        "own, as sentence-transformers' losses.",
    )
    temperature: Optional[float] = loss_field(  # noqa: UP045
        "temperature",
        None,
        text="The temperature of the loss's softmax: 1 / scale for the InfoNCE losses (e.g. 0.05); for the KL "
        "distillation losses the KL's, as sentence-transformers' DistillKLDivLoss (their InfoNCE term's is 1 / "
        "infonce_scale). Default: the loss's own.",
    )
    learnable_scale: bool = loss_field("learnable_scale")
    max_scale: float = loss_field("max_scale")
    learnable: bool = loss_field("learnable")
    siglip_bias: float = loss_field("bias")
    scale_learning_rate: Optional[float] = field(  # noqa: UP045
        default=DEFAULT_SCALE_LEARNING_RATE,
        metadata={
            "help": f"Learning rate of a learnable scale (default {DEFAULT_SCALE_LEARNING_RATE:g}), in an optimizer "
            "group of its own: at a fine-tuning learning_rate (1e-4) the scale barely moves (Adam changes "
            "log(scale) by about the learning rate per step). With learnable_scale (or 'siglip' with learnable) "
            "it is added to learning_rate_mapping as {'"
            + SCALE_PARAMETER_PATTERN
            + "': rate}, unless a pattern of the user's "
            "learning_rate_mapping already matches 'logit_scale' (the user's rate is kept); 'siglip''s learned "
            "bias (logit_bias) gets the same rate the same way. The learning rate "
            "schedule applies to it as to every group. 0 or None: the scale trains at learning_rate."
        },
    )
    similarity: Optional[str] = loss_field(  # noqa: UP045
        "similarity_fct",
        None,
        text="Similarity of embeddings, by name: 'cosine' or 'dot'; 'maxsim', 'meanmaxsim' or 'xtr' for the "
        "multi-vector losses. Default: the loss's own (cosine; the sparse losses' dot, the distillation losses' "
        "dot product, maxsim).",
    )
    mini_batch_size: Union[int, str] = loss_field("mini_batch_size", 32)  # noqa: UP007
    mini_batch_num_tokens: Optional[Union[int, str]] = loss_field("mini_batch_num_tokens")  # noqa: UP007, UP045
    tile_size: Optional[int] = loss_field("tile_size")  # noqa: UP045
    symmetric: Optional[bool] = loss_field("symmetric", None)  # noqa: UP045
    gather_across_devices: bool = loss_field("gather_across_devices")
    mask_duplicates: bool = loss_field("mask_duplicates")
    negative_bank_size: int = loss_field("negative_bank_size")
    negative_bank_max_age: Optional[int] = loss_field("negative_bank_max_age")  # noqa: UP045
    in_batch_negatives: bool = loss_field("in_batch_negatives")
    false_negative_filter: Optional[str] = loss_field("false_negative_filter")  # noqa: UP045
    false_negative_margin: Optional[float] = loss_field("false_negative_margin")  # noqa: UP045
    loss_show_progress_bar: bool = loss_field("show_progress_bar")
    path: str = loss_field("path")
    matmul_precision: Optional[str] = loss_field("matmul_precision")  # noqa: UP045
    memory_budget: Optional[str] = loss_field("memory_budget", None)  # noqa: UP045
    sort_by_length: bool = loss_field("sort_by_length")
    reuse_last_graph: bool = loss_field("reuse_last_graph")
    keep_params_unsharded: bool = loss_field("keep_params_unsharded")
    graph_memory_budget: Optional[str] = loss_field("graph_memory_budget")  # noqa: UP045
    mini_batch_memory_budget: Optional[str] = loss_field("mini_batch_memory_budget")  # noqa: UP045
    directions: Optional[str] = loss_field(  # noqa: UP045
        "directions",
        None,
        text=_doc("directions") + " Comma-separated. Default: the loss's own (query_to_doc; clip: "
        "query_to_doc,doc_to_query).",
    )
    partition_mode: Optional[str] = loss_field("partition_mode", None)  # noqa: UP045
    hardness_mode: Optional[str] = loss_field("hardness_mode")  # noqa: UP045
    hardness_strength: float = loss_field("hardness_strength")
    guide_model: Optional[str] = loss_field(  # noqa: UP045
        "guide",
        text="The guide SentenceTransformer, a local path (or a Hub name when online); loaded on the trained "
        "model's device, never trained. None (default): self-guided, the model's own embeddings of the step "
        "rate the pairs (no guide model, no extra forward).",
    )
    margin_strategy: str = loss_field("margin_strategy")
    margin: float = loss_field("margin")
    contrast_anchors: bool = loss_field("contrast_anchors")
    contrast_positives: bool = loss_field("contrast_positives")
    document_regularizer_weight: Optional[float] = loss_field("document_regularizer_weight", None)  # noqa: UP045
    query_regularizer_weight: Optional[float] = loss_field("query_regularizer_weight")  # noqa: UP045
    document_regularizer_threshold: Optional[int] = loss_field("document_regularizer_threshold")  # noqa: UP045
    query_regularizer_threshold: Optional[int] = loss_field("query_regularizer_threshold")  # noqa: UP045
    use_document_regularizer_only: bool = loss_field("use_document_regularizer_only")
    score_mini_batch_size: Optional[int] = loss_field("score_mini_batch_size")  # noqa: UP045
    num_negatives: Optional[Union[int, str]] = loss_field("num_negatives")  # noqa: UP007, UP045
    student_temperature: Optional[float] = loss_field("student_temperature")  # noqa: UP045
    teacher_temperature: Optional[float] = loss_field("teacher_temperature")  # noqa: UP045
    infonce_weight: float = loss_field("infonce_weight")
    infonce_scale: Optional[float] = loss_field("infonce_scale", None)  # noqa: UP045
    distance_metric: str = loss_field("distance_metric")
    projection_dim: Optional[int] = loss_field("projection_dim")  # noqa: UP045
    teacher_model: Optional[str] = loss_field(  # noqa: UP045
        "teacher",
        text=_doc("teacher")
        + " Here a local path (or a Hub name when online), loaded on the trained model's "
        "device, never trained.",
    )
    pointwise_weight: float = loss_field("pointwise_weight")
    listwise_weight: float = loss_field("listwise_weight")
    listwise_scale: float = loss_field("listwise_scale")
    listwise_teacher_scale: Optional[float] = loss_field("listwise_teacher_scale")  # noqa: UP045
    same_dataset_order: str = field(
        default="proportional",
        metadata={
            "help": f"With multi_dataset_batch_sampler='{SAME_DATASET}' (SameDatasetBatchSampler: every process "
            "trains on the same dataset in each step, so gathered negatives never mix tasks): how the datasets take "
            "turns. 'proportional': groups of batches in a random order, larger datasets more often, every row "
            "trained on; 'round_robin': one group per dataset in turn until the smallest is exhausted."
        },
    )
    same_dataset_per_optimizer_step: bool = field(
        default=False,
        metadata={
            "help": f"With multi_dataset_batch_sampler='{SAME_DATASET}': keep a whole optimizer step (all "
            "gradient_accumulation_steps micro-batches of every process) on one dataset, not only each micro-step."
        },
    )
    loss_options: Optional[Union[dict, str]] = field(  # noqa: UP007, UP045
        default=None,
        metadata={
            "help": "Settings of the chosen loss that have no field of their own (a loss of your own's), as a "
            "mapping (YAML / JSON; on the command line a JSON string), checked by the loss's settings."
        },
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # a misspelt keyword names the closest field (the dataclass's __init__ raises a TypeError naming none)
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise TypeError(
                f"{cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}."
                + closest_name_hint(unknown[0], known)
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # ours first: a wrong loss setting is reported before anything else is set up
        validate_loss_fields(self)  # below
        self._pick_same_dataset_sampler()  # before the parent reads "same_dataset" as its enum
        super().__post_init__()  # turns a learning_rate_mapping given as a JSON string into a dict
        self._map_scale_learning_rate()

    def _pick_same_dataset_sampler(self) -> None:
        """``multi_dataset_batch_sampler="same_dataset"``: the trainer gets
        `SameDatasetBatchSampler` with ``same_dataset_order`` and, with
        ``same_dataset_per_optimizer_step``, this run's ``gradient_accumulation_steps`` (a ``functools.partial``:
        the trainer calls it with the datasets' batch samplers, the generator and the seed)."""
        value = self.multi_dataset_batch_sampler
        if isinstance(value, str) and value.strip().lower() == SAME_DATASET:
            steps = self.gradient_accumulation_steps if self.same_dataset_per_optimizer_step else 1
            self.multi_dataset_batch_sampler = functools.partial(
                SameDatasetBatchSampler, order=self.same_dataset_order, gradient_accumulation_steps=steps
            )
            return
        ours = value is SameDatasetBatchSampler or getattr(value, "func", None) is SameDatasetBatchSampler
        for name in ("same_dataset_order", "same_dataset_per_optimizer_step"):
            if not ours and getattr(self, name) != LOSS_DEFAULTS[name]:
                raise ValueError(
                    f"{name} applies to multi_dataset_batch_sampler='{SAME_DATASET}' only (got "
                    f"{getattr(value, 'value', value)!r}); set multi_dataset_batch_sampler: {SAME_DATASET} or "
                    f"remove {name}."
                )

    # ------------------------------------------------------------------ the options' forms, the scale's rate

    @property
    def loss_directions(self) -> tuple[str, ...] | None:
        """``directions`` as a tuple (None: the loss's default); checked by ``__post_init__``."""
        if self.directions is None:
            return None
        return tuple(d.strip() for d in str(self.directions).split(",") if d.strip())

    @property
    def loss_partition_mode(self) -> str:
        """``partition_mode``, else the loss's own ('joint' where its default follows other arguments)."""
        if self.partition_mode is not None:
            return self.partition_mode
        return loss_default(str(self.loss), "partition_mode") or "joint"

    def _map_scale_learning_rate(self) -> None:
        """Give a learnable scale its own learning rate through sentence-transformers'
        ``learning_rate_mapping`` (read by the trainer when it builds the optimizer).

        The entry under [`SCALE_PARAMETER_PATTERN`][st_cached_losses.config.training_args.SCALE_PARAMETER_PATTERN] is this field's: it is set (or, when the scale is
        not learnable or the rate is off, removed, since the trainer rejects a pattern that matches no
        parameter), so that arguments saved and parsed again follow their ``scale_learning_rate``. A user's
        pattern matching the scale's name wins: nothing is added then. The entry comes first, and the
        trainer gives a parameter the rate of the last pattern matching it, so that any user's pattern
        (e.g. ``^name\\.logit_scale$`` for one loss of a dict) overrides it too.
        """
        given = self.learning_rate_mapping  # a dict by now (the parent parses a JSON string)
        users = {
            k: v
            for k, v in (given.items() if isinstance(given, Mapping) else ())
            if k not in (SCALE_PARAMETER_PATTERN, BIAS_PARAMETER_PATTERN)
        }
        for pattern in users:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(
                    f"learning_rate_mapping: {pattern!r} is not a regular expression of parameter names ({err})."
                ) from None
        rate = self.scale_learning_rate
        ours: dict[str, float] = {}
        learned = (
            (SCALE_PARAMETER_PATTERN, _SCALE_PARAMETER_NAMES, self.learns_scale),
            (BIAS_PARAMETER_PATTERN, _BIAS_PARAMETER_NAMES, self.learns_bias),
        )
        for pattern, names, learns in learned:
            if learns and rate and not any(re.search(p, name) for p in users for name in names):
                ours[pattern] = float(rate)
        self.learning_rate_mapping = {**ours, **users}  # a new dict: the user's is not changed

    @property
    def learns_scale(self) -> bool:
        """Whether the chosen loss learns its scale: ``learnable_scale``, or 'siglip''s ``learnable``."""
        taken = loss_parameters(str(self.loss))
        return bool(
            (self.learnable_scale and "learnable_scale" in taken) or (self.learnable and "learnable" in taken)
        )

    @property
    def learns_bias(self) -> bool:
        """Whether the chosen loss learns a bias ('siglip' with ``learnable``)."""
        taken = loss_parameters(str(self.loss))
        return bool(self.learnable and "learnable" in taken and "bias" in taken)

    # ------------------------------------------------------------------ derived settings

    @property
    def scale_setting(self) -> str | None:
        """Which of ``scale`` / ``temperature`` the chosen loss takes as its setting (the other field, where it
        is that setting's inverse, is converted: an InfoNCE loss's temperature is ``1 / scale``); None: neither
        (the margin losses)."""
        taken = loss_parameters(str(self.loss))
        if "scale" in taken:
            return "scale"
        return "temperature" if "temperature" in taken else None

    def _scale_inverse(self) -> bool:
        """Whether the chosen loss's ``scale`` and ``temperature`` are each other's inverse (its settings have
        one as a field and the other as a view, or a base loss's scale)."""
        setting = self.scale_setting
        if setting == "scale":
            return True
        if setting == "temperature":
            return "scale" in self.loss_class.settings_class.views()
        return False

    @property
    def loss_scale(self) -> float | None:
        """The scale the loss starts from: ``scale``, else ``1 / temperature``, else the loss's default (20;
        'gist' 100; 'sparse', 'multi_vector' 1, 'cross_encoder' 10, as sentence-transformers' own losses);
        None for a loss without an InfoNCE scale (the distillation losses: ``infonce_scale``)."""
        if not self._scale_inverse():
            return None
        if self.scale is not None:
            return float(self.scale)
        if self.temperature is not None:
            return 1.0 / self.temperature
        if self.scale_setting == "temperature":
            return 1.0 / float(loss_default(str(self.loss), "temperature"))
        return float(loss_default(str(self.loss), "scale"))

    @property
    def loss_class(self) -> type[CachedLoss]:
        """The loss class ``loss`` names."""
        return LOSSES[LOSS_ALIASES[str(self.loss).lower()]]

    @property
    def model_kind(self) -> str:
        """The sentence-transformers model class the chosen loss trains: ``"SentenceTransformer"``,
        ``"SparseEncoder"`` ('sparse'), ``"MultiVectorEncoder"`` ('multi_vector') or ``"CrossEncoder"``
        ('cross_encoder')."""
        return MODEL_KINDS[LOSS_ALIASES[str(self.loss).lower()]]

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the loss constructor (besides the model; for 'gist' / 'embed_distill', besides the
        guide / teacher too;
        for the sparse losses, besides the base loss, built from `base_loss_kwargs`): every setting the loss
        takes that a field sets, except where the field leaves the loss's own default, and ``loss_options``."""
        name = str(self.loss)
        kwargs = self._kwargs(own_parameters(name), skip={"guide", "teacher"})
        return {**kwargs, **self._options()}

    def base_loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the base loss (besides the model), from the fields: 'sparse'
        (``SparseMultipleNegativesRankingLoss``): ``scale``, ``similarity``, ``gather_across_devices``,
        ``directions``, ``partition_mode``, ``hardness_*``; 'sparse_distill_kl' (``SparseDistillKLDivLoss``):
        ``similarity``, ``temperature``, ``student_temperature``, ``teacher_temperature``;
        'sparse_margin_mse' (``SparseMarginMSELoss``): ``similarity``. Empty for a loss without a base loss."""
        return self._kwargs(base_parameters(str(self.loss)), skip=set())

    def _kwargs(self, params: Any, skip: set[str]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for name in params:
            if name in skip or name in NOT_FIELDS:
                continue
            value = self._loss_argument(name)
            if value is not _LOSS_DEFAULT:
                kwargs[name] = value
        return kwargs

    def _options(self) -> dict[str, Any]:
        """``loss_options`` as a mapping (a JSON string from the command line)."""
        options = self.loss_options
        if options is None:
            return {}
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"loss_options must be a mapping (a JSON object), got {options!r}: {err}."
                ) from None
        if not isinstance(options, Mapping):
            raise ValueError(f"loss_options must be a mapping of settings to values, got {options!r}.")
        return dict(options)

    def _loss_argument(self, name: str) -> Any:
        """The value of the loss's setting ``name`` these fields set, or ``_LOSS_DEFAULT`` (a field's None: the
        loss's own default)."""
        if name in ("scale", "temperature"):
            other = "temperature" if name == "scale" else "scale"
            own, given_other = getattr(self, name), getattr(self, other)
            if own is not None:
                return float(own)
            if given_other is not None and self._scale_inverse():
                return 1.0 / float(given_other)
            return _LOSS_DEFAULT
        if name == "partition_mode":
            given_terms = self.directions is not None or self.partition_mode is not None
            return self.loss_partition_mode if given_terms else _LOSS_DEFAULT
        if name == "num_negatives" and self.num_negatives in (None, "all"):
            return None  # every in-batch negative (the field's None, as the loss's)
        if name == "similarity_fct" and self.similarity is not None:
            kind = _similarity_kind(str(self.loss))
            return kind.argument(str(self.similarity)) if kind is not None else self.similarity
        value = (
            self.loss_directions if name == "directions" else getattr(self, FIELD_NAMES.get(name, name), None)
        )
        return _LOSS_DEFAULT if value is None else value

    def loss_settings(self) -> dict[str, Any]:
        """The fields that configure the chosen loss and their values (what the model card lists): the
        loss choice, its scale or temperature (those it takes), and the fields of the settings that loss takes."""
        taken = set(loss_parameters(str(self.loss)))
        names = ["loss"]
        if self._scale_inverse():
            names += ["scale", "temperature"]
        elif self.scale_setting == "temperature":
            names += ["temperature"]
        if self.learns_scale:
            names.append("scale_learning_rate")
        owners = {FIELD_NAMES.get(p, p): p for p in taken}
        names += [f for f in LOSS_FIELDS if f not in names and f in owners and f not in _DERIVED]
        if "directions" in taken:
            names += ["directions", "partition_mode"]
        if self.loss_options is not None:
            names.append("loss_options")
        return {name: getattr(self, name) for name in names}


@dataclass
class CachedLossTrainingArguments(CachedLossArguments, SentenceTransformerTrainingArguments):
    """``SentenceTransformerTrainingArguments`` plus the choice of cached loss and all its hyperparameters
    ([`CachedLossArguments`][st_cached_losses.training_args.CachedLossArguments]' fields: how they are read from the command line, JSON or YAML and checked
    is said there), for ``SentenceTransformerTrainer``: the losses 'mnr', 'clip', 'tiled' and 'gist'.
    'sparse', 'multi_vector' and 'cross_encoder' train other models with other trainers:
    [`CachedSparseEncoderTrainingArguments`][st_cached_losses.training_args.CachedSparseEncoderTrainingArguments], [`CachedMultiVectorEncoderTrainingArguments`][st_cached_losses.training_args.CachedMultiVectorEncoderTrainingArguments] and
    [`CachedCrossEncoderTrainingArguments`][st_cached_losses.training_args.CachedCrossEncoderTrainingArguments].
    """

    trains: ClassVar[str | None] = "SentenceTransformer"


@dataclass
class CachedSparseEncoderTrainingArguments(CachedLossArguments, SparseEncoderTrainingArguments):
    """``SparseEncoderTrainingArguments`` plus the cached loss's fields ([`CachedLossArguments`][st_cached_losses.training_args.CachedLossArguments]'), for
    ``SparseEncoderTrainer``: loss 'sparse' (the default), or the distillation losses 'sparse_distill_kl' and
    'sparse_margin_mse' (``CachedSparseLoss`` with ``SparseDistillKLDivLoss`` / ``SparseMarginMSELoss`` as its
    base loss); ``document_regularizer_weight`` is required for each.

    Example:

    ```python
    args = CachedSparseEncoderTrainingArguments(
        output_dir="out", document_regularizer_weight=3e-5, query_regularizer_weight=5e-5, mini_batch_size=32
    )
    trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=data, loss=build_loss(model, args))
    ```
    """

    trains: ClassVar[str | None] = "SparseEncoder"

    loss: str = field(default="sparse", metadata={"help": _LOSS_HELP})


@dataclass
class CachedMultiVectorEncoderTrainingArguments(CachedLossArguments, MultiVectorEncoderTrainingArguments):
    """``MultiVectorEncoderTrainingArguments`` plus the cached loss's fields ([`CachedLossArguments`][st_cached_losses.training_args.CachedLossArguments]'),
    for ``MultiVectorEncoderTrainer``, whose collator tokenizes the first column as queries (ColBERT's query
    expansion included) and the others as documents: loss 'multi_vector' (the default).

    Example:

    ```python
    args = CachedMultiVectorEncoderTrainingArguments(output_dir="out", similarity="maxsim", mini_batch_size=32)
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=data, loss=build_loss(model, args))
    ```
    """

    trains: ClassVar[str | None] = "MultiVectorEncoder"

    loss: str = field(default="multi_vector", metadata={"help": _LOSS_HELP})


@dataclass
class CachedCrossEncoderTrainingArguments(CachedLossArguments, CrossEncoderTrainingArguments):
    """``CrossEncoderTrainingArguments`` plus the cached loss's fields ([`CachedLossArguments`][st_cached_losses.training_args.CachedLossArguments]'), for
    ``CrossEncoderTrainer`` (which accepts only its own arguments class): loss 'cross_encoder' (the default).

    Example:

    ```python
    args = CachedCrossEncoderTrainingArguments(output_dir="out", per_device_train_batch_size=128,
                                               mini_batch_size=16, num_negatives=4)
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=train_dataset,
                                  loss=build_loss(model, args))
    ```
    """

    trains: ClassVar[str | None] = "CrossEncoder"

    loss: str = field(default="cross_encoder", metadata={"help": _LOSS_HELP})


#: the arguments class of each model kind (its trainer takes it)
ARGUMENTS_CLASSES: dict[str, type[CachedLossArguments]] = {
    cls.trains: cls  # type: ignore[misc]
    for cls in (
        CachedLossTrainingArguments,
        CachedSparseEncoderTrainingArguments,
        CachedMultiVectorEncoderTrainingArguments,
        CachedCrossEncoderTrainingArguments,
    )
}


#: what ``_loss_argument`` returns to leave the loss's own default
_LOSS_DEFAULT = object()
#: fields derived from others for the loss (listed by ``loss_settings`` on their own terms)
_DERIVED = {"scale", "temperature", "directions", "partition_mode"}


def _similarity_kind(name: str) -> SimilarityKind | None:
    """The kind of the similarity the chosen loss (or its base loss) takes (its names and what they give)."""
    settings = LOSSES[name].settings_class
    if "similarity_fct" in settings.__dataclass_fields__:
        return getattr(settings, "similarity_kind", None)
    return BASE_SIMILARITY.get(name)


_INHERITED = {f.name for f in dataclasses.fields(BaseTrainingArguments)}
#: the fields CachedLossArguments adds to sentence-transformers' training arguments, and their defaults (those
#: of CachedLossTrainingArguments: 'sparse' and 'multi_vector' are the other classes' default losses)
LOSS_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(CachedLossTrainingArguments) if f.name not in _INHERITED
}
LOSS_FIELDS = tuple(LOSS_DEFAULTS)


# Pickles (every checkpoint's ``training_args.bin``) name a class by its ``__module__``: the documented path
# ``st_cached_losses.training_args`` (a re-export of this module's names) is the one kept for good, so
# checkpoints written before the move into ``config/`` load, and those written after load with an older
# version too.
for _cls in (CachedLossArguments, *ARGUMENTS_CLASSES.values()):
    _cls.__module__ = "st_cached_losses.training_args"


# ---------------------------------------------------------------------- the loss fields


def validate_loss_fields(args: CachedLossArguments) -> None:
    """Check the loss fields of ``args`` and put them in canonical form (``args.loss``, ``args.similarity``,
    ``"auto"``, ``directions`` given as a list): each field by its setting's own check, only for a loss that
    takes it, then the chosen loss's settings built from the fields, checked as a whole (as the loss checks
    them).

    Raises:
        ValueError: naming the field of an invalid value or combination.
    """
    key = str(args.loss).lower()
    canonical = canonical_loss(key, type(args).trains)
    if canonical is None:
        names = ", ".join(repr(name) for name in LOSSES)
        # each class once (CachedSparseLoss is the class of three names)
        classes = ", ".join(dict.fromkeys(cls.__name__ for cls in LOSSES.values()))
        spellings = {**LOSS_ALIASES, **{name: name for name in ST_LOSS_NAMES}}
        close = difflib.get_close_matches(key, list(spellings), n=1, cutoff=0.6)
        hint = f" Did you mean loss={canonical_loss(close[0], type(args).trains)!r}?" if close else ""
        raise ValueError(
            f"loss={args.loss!r} is not a cached loss; choose one of {names} (or a class name, ours: {classes}; "
            f"or sentence-transformers' loss it replaces, e.g. MultipleNegativesRankingLoss).{hint}"
        )
    args.loss = canonical
    _check_model_kind(args)
    for name in ("mini_batch_size", "mini_batch_num_tokens"):
        value = getattr(args, name)
        if isinstance(value, str) and value.strip().lower() == "auto":
            setattr(args, name, "auto")  # sized from mini_batch_memory_budget at the first step
    # the one rule of the budget (a loss applies it too), with this run's CUDA
    check_auto_budget(
        args.mini_batch_size,
        args.mini_batch_num_tokens,
        args.mini_batch_memory_budget,
        cuda=_cuda_available() and not getattr(args, "use_cpu", False),
    )
    if args.loss == "cross_encoder" and args.num_negatives is None:
        args.num_negatives = "all"  # None means every in-batch negative, as for the loss: the card says so
    if isinstance(args.directions, (list, tuple)):  # given as a list in Python or YAML
        args.directions = ",".join(args.directions)
    _validate_fields(args)
    if (
        args.scale is not None
        and args.temperature is not None
        and not math.isclose(args.scale * args.temperature, 1.0, rel_tol=1e-6)
    ):
        raise ValueError(
            f"scale={args.scale} and temperature={args.temperature} disagree (scale = 1 / temperature = "
            f"{1 / args.temperature:g}); set only one of scale and temperature."
        )
    if args.loss in BASE_LOSSES and args.document_regularizer_weight is None:
        raise ValueError(
            f"loss={args.loss!r} needs document_regularizer_weight: the weight of the documents' FLOPS regulariser "
            "(lambda_d, e.g. 3e-5; SPLADE's CachedSpladeLoss has no default either)."
        )
    if args.directions is not None or args.partition_mode is not None:
        directions = args.loss_directions or loss_default(args.loss, "directions") or ("query_to_doc",)
        check_directions(directions, args.loss_partition_mode, "directions")
        if args.symmetric is not None:
            raise ValueError("give either symmetric or directions / partition_mode, not both.")
    check_hardness(args.hardness_mode, args.hardness_strength, "hardness_mode")
    _validate_similarity(args)
    settings = _validate_settings(args)
    batch = args.per_device_train_batch_size
    rows = args.mini_batch_size
    # both sizes at their defaults (transformers' batch 8, mini-batch 32): nothing chosen yet, nothing to warn
    # about here (a bare CachedLossTrainingArguments() warned at once); a loss that trains such a batch says so
    # at its first step
    defaults = type(args).__dataclass_fields__
    chosen = (batch, rows) != (
        defaults["per_device_train_batch_size"].default,
        defaults["mini_batch_size"].default,
    )
    # caching is off when the whole batch, every column's rows together, fits in one mini-batch; the columns
    # are not known here, but there are at least two: a batch of pairs is the one this can tell about (a
    # reranker's mini-batches hold pairs, B x (1 + k) of them: a batch of B fits in one more rarely). Said
    # only where a non-cached loss of sentence-transformers gives the same result (not with a bank, whose
    # point is small batches, a learnable scale, the sigmoid loss...)
    non_cached = None if settings is None else args.loss_class.non_cached_equivalent(settings)
    if (
        chosen
        and non_cached is not None
        and args.mini_batch_num_tokens is None
        and isinstance(rows, int)
        and rows_fit_in_one([batch, batch], rows)
        and args.loss != "cross_encoder"
    ):
        warn_caching_off(
            f"mini_batch_size={rows} >= 2 x per_device_train_batch_size={batch}: a batch of pairs ({2 * batch} "
            "rows, both columns together)",
            f"mini_batch_size={rows}",
            non_cached,
            " (A batch with more columns is cached while its rows together exceed mini_batch_size.)",
        )


#: what each model kind's data collator does that another kind's would not (the wrong-class message)
_COLLATES = {
    "SentenceTransformer": "tokenizes each column for its task, the first as queries",
    "SparseEncoder": "tokenizes each column for its task, the first as queries",
    "MultiVectorEncoder": "tokenizes the first column as queries, with ColBERT's query expansion",
    "CrossEncoder": "keeps the texts for the loss, which pairs each query with its documents and tokenizes the pairs",
}


def _cuda_available() -> bool:
    """Whether the run may have a CUDA device (a function of its own: the tests stand in for a CUDA machine)."""
    return torch.cuda.is_available()


def _check_model_kind(args: CachedLossArguments) -> None:
    """The loss trains the model kind of the arguments class: the kind's trainer takes only its own class,
    and its data collator is the one that tokenizes each column for its task (a 'sparse' or 'multi_vector' run
    through ``SentenceTransformerTrainer`` would tokenize the queries as documents)."""
    trains = type(args).trains
    needed = MODEL_KINDS[args.loss]
    if trains is None or trains == needed:
        return
    cls = ARGUMENTS_CLASSES[needed].__name__
    raise ValueError(
        f"loss={args.loss!r} trains a {needed} with {needed}Trainer, which takes {cls} only (its data collator "
        f"{_COLLATES[needed]}); {type(args).__name__} is for {trains}Trainer. Build {cls}(...) with the "
        f"same fields (from a file or the command line: CachedLossArgumentParser({cls})), or choose a loss for a "
        f"{trains}: " + ", ".join(repr(name) for name, kind in MODEL_KINDS.items() if kind == trains) + "."
    )


#: fields checked on their own terms (a path, a comma-separated list, a name whose meaning the loss decides)
_OWN_CHECKS = {
    "guide_model",
    "teacher_model",
    "similarity",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
}


def _check_order(name: str, value: Any) -> str:
    if value not in DATASET_ORDERS:
        raise ValueError(
            f"{name} must be 'proportional' or 'round_robin' (how the datasets take turns), got {value!r}."
        )
    return str(value)


#: the checks of the fields that set no loss setting
_ARGUMENT_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "scale_learning_rate": functools.partial(check_nonnegative, example=f"{DEFAULT_SCALE_LEARNING_RATE:g}"),
    "same_dataset_order": _check_order,
    "same_dataset_per_optimizer_step": check_bool,
}


def _validate_fields(args: CachedLossArguments) -> None:
    """Each field by its setting's check (the losses' own, naming the field), and only for a loss that takes
    it: a field away from its default that the chosen loss would ignore is an error (not silence) naming the
    losses that take it; ``scale`` / ``temperature`` where the loss takes either as its own setting or as its
    inverse."""
    taken = loss_parameters(args.loss)
    loss = str(args.loss)
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in _ARGUMENT_CHECKS and value is not None:
            _ARGUMENT_CHECKS[f.name](f.name, value)
            continue
        setting = FIELD_SETTINGS.get(f.name)
        if setting is None or value is None:
            continue
        found = declaration(setting)
        check = found.metadata.get("check") if found is not None else None
        if check is not None and f.name not in _OWN_CHECKS and not isinstance(check, SimilarityKind):
            check(f.name, value)
        if value == f.default or accepts(loss, setting):
            continue
        losses = field_takers(setting)
        takers_text = (
            f"loss={losses[0]!r} only"
            if len(losses) == 1
            else f"{', '.join(f'loss={n!r}' for n in losses[:-1])} or loss={losses[-1]!r}"
        )
        base = BASE_LOSSES.get(args.loss)
        with_base = f" with {base.__name__} as its base loss" if base is not None else ""
        # a learned scale under another name (SigLIP's learnable, its scale and bias)
        instead = (
            " (it learns its scale with learnable)"
            if setting == "learnable_scale" and "learnable" in taken
            else ""
        )
        raise ValueError(
            f"{f.name} does not apply to loss={args.loss!r} ({args.loss_class.__name__}{with_base} does not take "
            f"{setting}): {f.name} applies to {takers_text}. Remove {f.name}{instead}."
        )
    unknown = [k for k in args._options() if k not in taken]
    named = [k for k in args._options() if FIELD_NAMES.get(k, k) in FIELD_SETTINGS]
    if unknown or named:
        name = (unknown or named)[0]
        reason = (
            f"{args.loss_class.__name__} has no setting {name!r}.{closest_name_hint(name, list(taken))}"
            if unknown
            else f"{name!r} has a field of its own: set {FIELD_NAMES.get(name, name)} instead."
        )
        raise ValueError(f"loss_options: {reason}")


def _validate_settings(args: CachedLossArguments) -> Settings | None:
    """The chosen loss's settings built from the fields and checked as a whole, as the loss checks them (the
    settings that go together: a learnable scale's clamp, the negative bank, in-batch negatives...), and
    returned. A loss whose settings need an object no field gives (the sparse losses' base loss) is checked
    field by field (None returned)."""
    cls = args.loss_class
    kwargs = {k: v for k, v in args.loss_kwargs().items() if k in cls.settings_class.__dataclass_fields__}
    if kwargs.get("mini_batch_memory_budget") is None and is_auto(
        kwargs.get("mini_batch_size", 32), kwargs.get("mini_batch_num_tokens")
    ):
        kwargs["mini_batch_memory_budget"] = 1  # the budget's rule is this run's (checked above)
    views = {k: v for k, v in args.loss_kwargs().items() if k in cls.settings_class.view_arguments}
    required = [
        f.name
        for f in dataclasses.fields(cls.settings_class)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if required:
        return None
    settings = cls.settings_class(**kwargs)
    return settings.replace(**views) if views else settings


def _validate_similarity(args: CachedLossArguments) -> None:
    """``similarity`` in canonical form for the chosen loss (None: the loss's own default)."""
    if args.similarity is None:
        return
    kind = _similarity_kind(args.loss)
    if kind is None:
        raise ValueError(
            f"loss={args.loss!r} ({args.loss_class.__name__}) takes no similarity; remove similarity."
            + (
                " (It scores (query, document) pairs with the model itself.)"
                if args.loss == "cross_encoder"
                else ""
            )
        )
    name = kind.argument_name(str(args.similarity))
    if name is None:
        names = list(kind.arguments)
        if "cosine" in names:
            raise ValueError(
                f"similarity must be 'cosine' or 'dot', got {args.similarity!r}: the arguments (and the command "
                "line) name only these two ('maxsim', 'meanmaxsim', 'xtr': the multi-vector losses, "
                "loss='multi_vector'). The loss itself "
                "scores any similarity exactly (slower, one tile at a time through autograd): build it in Python "
                "with similarity_fct=sentence_transformers.util.euclidean_sim (or manhattan_sim, or your own function)."
            )
        raise ValueError(
            f"similarity for loss={args.loss!r} must be {', '.join(map(repr, names[:-1]))} or {names[-1]!r} (the "
            "multi-vector scores), "
            f"got {args.similarity!r}.{closest_name_hint(str(args.similarity).lower(), names)}"
        )
    args.similarity = name
