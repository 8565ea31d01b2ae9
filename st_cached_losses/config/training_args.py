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
import inspect
import math
import re
import warnings
from collections.abc import Mapping
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
    DEFAULT_GIST_TEMPERATURE,
    DEFAULT_SCALE,
    DEFAULT_SCALE_LEARNING_RATE,
    DISTILLATION_LOSSES,
    FIELD_NAMES,
    LOSS_ALIASES,
    LOSS_DEFAULT_SCALES,
    LOSSES,
    MODEL_KINDS,
    NOT_FIELDS,
    SPARSE_DISTILLATION_LOSSES,
    ST_LOSS_NAMES,
    UNUSED_PARAMETERS,
    canonical_loss,
    closest_name_hint,
    loss_parameters,
)
from st_cached_losses.config.sampling import DATASET_ORDERS, SameDatasetBatchSampler
from st_cached_losses.engine.caller import user_stacklevel  # the warnings point at the user's line
from st_cached_losses.engine.checks import is_auto
from st_cached_losses.engine.gradcache import auto_needs_budget
from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET
from st_cached_losses.losses import CachedCrossEncoderLoss, CachedInfoNCEBase
from st_cached_losses.losses.settings import (
    ONE_DIRECTION,
    SPECS,
    Spec,
    check_bool,
    check_directions,
    check_hardness,
    check_max_scale,
    check_negative_bank,
    check_nonnegative,
    resolve_similarity,
)

__all__ = [
    "ARGUMENTS_CLASSES",
    "LOSS_DEFAULTS",
    "LOSS_FIELDS",
    "SAME_DATASET",
    "SCALE_PARAMETER_PATTERN",
    "CachedCrossEncoderTrainingArguments",
    "CachedLossArguments",
    "CachedLossTrainingArguments",
    "CachedMultiVectorEncoderTrainingArguments",
    "CachedSparseEncoderTrainingArguments",
    "user_stacklevel",
    "validate_loss_fields",
]

#: the ``learning_rate_mapping`` pattern of a loss's learnable scale, as the trainer names it among the loss's
#: parameters: ``logit_scale`` (one loss), ``<name>.logit_scale`` (a dict of losses), ``loss.logit_scale``
#: (inside MatryoshkaLoss); never a parameter of the model the loss holds (``model.0...logit_scale``, as in a
#: CLIP encoder)
SCALE_PARAMETER_PATTERN = r"^(?!(?:.*\.)?model\.)(?:.*\.)?logit_scale$"
#: what the loss's scale is called among the trainer's parameter names (a user pattern matching one of these
#: already sets the scale's learning rate)
_SCALE_PARAMETER_NAMES = ("logit_scale", "loss.logit_scale")

#: the value of sentence-transformers' ``multi_dataset_batch_sampler`` that picks
#: `SameDatasetBatchSampler`
SAME_DATASET = "same_dataset"


def _check_order(name: str, value: Any) -> str:
    if value not in DATASET_ORDERS:
        raise ValueError(
            f"{name} must be 'proportional' or 'round_robin' (how the datasets take turns), got {value!r}."
        )
    return str(value)


#: the fields that set no loss argument, in the same form as the loss settings' specs (default and check; the
#: help is on the field's line, as every field's)
_ARGUMENT_SPECS = {
    "scale_learning_rate": Spec(
        DEFAULT_SCALE_LEARNING_RATE,
        functools.partial(check_nonnegative, example=f"{DEFAULT_SCALE_LEARNING_RATE:g}"),
    ),
    "same_dataset_order": Spec("proportional", _check_order),
    "same_dataset_per_optimizer_step": Spec(False, check_bool),
}
#: the fields that take a count or "auto" (sized from mini_batch_memory_budget), read so by the command line
COUNT_OR_AUTO_FIELDS = frozenset({"mini_batch_size", "mini_batch_num_tokens"})
#: the fields that take a count or "all" (every one there is), read so by the command line
COUNT_OR_ALL_FIELDS = frozenset({"num_negatives"})
#: field name -> (the loss argument it sets, None for none; its spec)
FIELD_SPECS: dict[str, tuple[str | None, Spec]] = {
    **{FIELD_NAMES.get(name, name): (name, spec) for name, spec in SPECS.items()},
    **{name: (None, spec) for name, spec in _ARGUMENT_SPECS.items()},
}


#: the help of the ``loss`` field (its default differs by arguments class)
_LOSS_HELP = (
    "Which cached loss: 'mnr' (CachedMNRLoss, InfoNCE anchor -> candidates), 'clip' "
    "(CachedCLIPLoss, symmetric InfoNCE), 'tiled' (CachedTiledLoss, Inf-CL-style tiles, ring across "
    "processes) or 'gist' (CachedGISTLoss, GISTEmbed's guided negatives; self-guided without guide_model), all for a "
    "SentenceTransformer; 'sparse' (CachedSparseLoss, SPLADE: SparseMultipleNegativesRankingLoss plus "
    "FLOPS regularisers; needs document_regularizer_weight) for a SparseEncoder; 'multi_vector' "
    "(CachedMultiVectorLoss, late interaction: MaxSim / MeanMaxSim / XTR) for a MultiVectorEncoder; "
    "'cross_encoder' (CachedCrossEncoderLoss, a reranker's in-batch negatives ranking loss) for a CrossEncoder; "
    "distillation from teacher scores in the label column: 'distill_kl' (CachedDistillKLDivLoss) and "
    "'margin_mse' (CachedMarginMSELoss) for a SentenceTransformer, 'multi_vector_distill_kl' and "
    "'multi_vector_margin_mse' for a MultiVectorEncoder (optionally plus an in-batch InfoNCE term: "
    "infonce_weight), 'sparse_distill_kl' and 'sparse_margin_mse' for a SparseEncoder (CachedSparseLoss with "
    "SparseDistillKLDivLoss / SparseMarginMSELoss as its base loss, plus the FLOPS regularisers; needs "
    "document_regularizer_weight; no InfoNCE term). "
    "Our class names are accepted too, and sentence-transformers' cached loss class names for the loss that "
    "replaces each (CachedMultipleNegativesRankingLoss: 'mnr', or 'cross_encoder' with the CrossEncoder's "
    "arguments; CachedMultipleNegativesSymmetricRankingLoss: 'clip'; CachedGISTEmbedLoss: 'gist'; "
    "CachedSpladeLoss: 'sparse'; CachedMultiVectorMultipleNegativesRankingLoss: 'multi_vector'; their "
    "non-cached DistillKLDivLoss, MarginMSELoss, MultiVectorDistillKLDivLoss, MultiVectorMarginMSELoss, "
    "SparseDistillKLDivLoss, SparseMarginMSELoss: the distillation loss of the same name)."
)


def _spec_field(name: str, text: str, default: Any = dataclasses.MISSING) -> Any:
    """The field of the setting ``name`` (a loss argument's, or one of `_ARGUMENT_SPECS`): its spec's default
    (or ``default``) and its help ``text`` (the field's and ``--help``'s; the losses layer carries no help)."""
    spec = SPECS[name] if name in SPECS else _ARGUMENT_SPECS[name]
    return field(
        default=spec.default if default is dataclasses.MISSING else default,
        metadata={"help": text},
    )


@dataclass
class CachedLossArguments(BaseTrainingArguments):
    """The choice of cached loss and all its hyperparameters, on top of sentence-transformers' training
    arguments: the one set of fields (one spec per setting) of the three arguments classes, one per model kind,
    each accepted by that kind's trainer (whose data collator stamps each column's task, e.g. ``"query"`` for
    the first): [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] (``SentenceTransformerTrainer``),
    [`CachedSparseEncoderTrainingArguments`][st_cached_losses.training_args.CachedSparseEncoderTrainingArguments] (``SparseEncoderTrainer``) and
    [`CachedMultiVectorEncoderTrainingArguments`][st_cached_losses.training_args.CachedMultiVectorEncoderTrainingArguments] (``MultiVectorEncoderTrainer``). Build one of those.

    Every field can come from the command line (``--loss clip --temperature 0.05``), a JSON or a YAML
    file through [`CachedLossArgumentParser`][st_cached_losses.config.cli.CachedLossArgumentParser] (or ``HfArgumentParser``).
    Invalid combinations raise a ``ValueError`` naming the field when the arguments are built, and so does a
    loss for another model kind than the class trains (naming the class to use); a ``mini_batch_size`` of at
    least twice ``per_device_train_batch_size`` only warns (a batch of pairs, both columns' rows together,
    then fits in one mini-batch: caching is off for it), at the user's line.
    """

    #: the model kind (sentence-transformers' class name) whose trainer takes this arguments class; None: any
    #: (this base class, which no trainer takes)
    trains: ClassVar[str | None] = None

    loss: str = field(default="mnr", metadata={"help": _LOSS_HELP})
    scale: Optional[float] = _spec_field(  # noqa: UP045
        "scale",
        "Similarity scale = 1 / temperature; the initial value when learnable. Give scale or temperature; both "
        "only if they agree."
        f" Default: the loss's own, as sentence-transformers' losses: {DEFAULT_SCALE:g}; 'gist' "
        f"{1 / DEFAULT_GIST_TEMPERATURE:g}, 'sparse' {LOSS_DEFAULT_SCALES['sparse']:g} and 'multi_vector' "
        f"{LOSS_DEFAULT_SCALES['multi_vector']:g}, 'cross_encoder' {LOSS_DEFAULT_SCALES['cross_encoder']:g}.",
    )
    temperature: Optional[float] = _spec_field(  # noqa: UP045
        "temperature",
        "Softmax temperature = 1 / scale, e.g. 0.05. Give scale or temperature. The KL distillation losses' "
        "temperature of both softmaxes (default theirs: "
        f"{1 / LOSS_DEFAULT_SCALES['distill_kl']:g}; 'sparse_distill_kl' "
        f"{1 / LOSS_DEFAULT_SCALES['sparse_distill_kl']:g}, as SparseDistillKLDivLoss).",
    )
    learnable_scale: bool = _spec_field(
        "learnable_scale",
        "Learn the scale as CLIP's logit_scale = log(scale), clamped at max_scale ('mnr', 'clip', 'tiled' and "
        "'gist').",
    )
    max_scale: float = _spec_field(
        "max_scale",
        "Upper clamp of a learnable scale (CLIP uses 100).",
    )
    scale_learning_rate: Optional[float] = _spec_field(  # noqa: UP045
        "scale_learning_rate",
        f"Learning rate of a learnable scale (default {DEFAULT_SCALE_LEARNING_RATE:g}), in an optimizer group of its "
        "own: at a fine-tuning learning_rate (1e-4) the scale barely moves (Adam changes log(scale) by about the "
        "learning rate per step). With learnable_scale it is added to learning_rate_mapping as {'"
        + SCALE_PARAMETER_PATTERN
        + "': rate}, unless a pattern of the user's learning_rate_mapping already matches 'logit_scale' (the "
        "user's rate is kept). The learning rate schedule applies to it as to every group. 0 or None: the scale "
        "trains at learning_rate.",
    )
    similarity: Optional[str] = _spec_field(  # noqa: UP045
        "similarity_fct",
        "Similarity of embeddings: 'cosine' or 'dot' (dot product); default the loss's own: cosine, 'sparse', "
        "'sparse_distill_kl' and 'sparse_margin_mse' dot (as their base losses). 'multi_vector': 'maxsim' (default, colbert_scores), "
        "'meanmaxsim' (mean_colbert_scores) or 'xtr' (xtr_scores, top_k 256).",
    )
    mini_batch_size: Union[int, str] = _spec_field(  # noqa: UP007
        "mini_batch_size",
        "Rows per encoder forward (GradCache's chunk): sets the memory, never the result. Smaller than "
        "per_device_train_batch_size to save memory; caching is off only when the whole batch, all its "
        "columns' rows together, fits in one mini-batch. 'auto': the largest that fits "
        "mini_batch_memory_budget, measured at the first step and logged.",
    )
    mini_batch_num_tokens: Optional[Union[int, str]] = _spec_field(  # noqa: UP007, UP045
        "mini_batch_num_tokens",
        "Optional budget of real (non-padding) tokens per encoder mini-batch instead of a fixed row count, as "
        "in sentence-transformers: rows are packed while their token count stays within it (a longer row "
        "alone), longest first, so long texts get smaller mini-batches (for data of very uneven length); "
        "mini_batch_size is then not used. 'auto': the largest budget that fits mini_batch_memory_budget.",
    )
    tile_size: Optional[int] = _spec_field(  # noqa: UP045
        "tile_size",
        "Side of a logit tile / rows of a chunk of the loss stage (default: from memory_budget, at most 2048).",
    )
    symmetric: Optional[bool] = _spec_field(  # noqa: UP045
        "symmetric",
        "'tiled' only: also the positive -> anchors direction, averaged (the CLIP loss); default false. ('mnr' "
        "is one-directional, 'clip' always symmetric.)",
    )
    gather_across_devices: bool = _spec_field(
        "gather_across_devices",
        "Score each process's rows against every process's candidates (multi-GPU / multi-node, exact "
        "global-batch gradients); 'tiled' passes them around a ring instead of gathering.",
    )
    mask_duplicates: bool = _spec_field(
        "mask_duplicates",
        "Mask false negatives found by equal inputs (token ids, and pixels with images), on this process and "
        "across processes (which the NO_DUPLICATES sampler cannot see beyond one process's batch): rows sharing "
        "their anchor or their positive are duplicates; a row's negatives lose the positives of its duplicates, "
        "and any candidate (hard negatives included) equal to its own positive.",
    )
    negative_bank_size: int = _spec_field(
        "negative_bank_size",
        "'mnr', 'clip' and 'tiled': keep the embeddings of this many past candidates (and, where the loss "
        "scores positives against anchors, past anchors) per process, without gradient, and score them as "
        "extra negatives of the next steps (ContAccum-style; for small batches under gradient accumulation). "
        "0: no bank, the loss as without it.",
    )
    negative_bank_max_age: Optional[int] = _spec_field(  # noqa: UP045
        "negative_bank_max_age",
        "With negative_bank_size: drop bank entries added more than this many steps (training calls of the "
        "loss; micro-batches under gradient accumulation) ago, embedded by a model that has changed since. "
        "Default none: the size alone decides.",
    )
    in_batch_negatives: bool = _spec_field(
        "in_batch_negatives",
        "'mnr', 'tiled' and 'gist': score each anchor against every row's candidates (default true); false: "
        "against its own positive and its own hard negatives only (FlagEmbedding's no_in_batch_neg_flag), across "
        "processes too (nothing is gathered). Needs hard-negative columns; 'mnr' / 'tiled': one direction "
        "(query_to_doc), hardness_mode not in_batch_negatives; 'gist': contrast_anchors / contrast_positives "
        "(other rows) do not apply. Per dataset: a dict of losses (build_loss per dataset, then set the loss's "
        "in_batch_negatives).",
    )
    loss_show_progress_bar: bool = _spec_field(
        "show_progress_bar",
        "Show tqdm bars over the loss's encoder mini-batches (both passes).",
    )
    path: str = _spec_field(
        "path",
        "The loss stage's algorithm: 'auto' (from the batch and memory_budget), 'chunked' (row chunks against "
        "every column) or 'tiled' (Inf-CL-style tiles); never changes the result."
        " Not 'tiled' (always tiled).",
    )
    matmul_precision: Optional[str] = _spec_field(  # noqa: UP045
        "matmul_precision",
        "The loss stage's similarity products: 'highest' (fp32), 'high' (TF32 on CUDA), 'medium' (bf16 "
        "operands, fp32 sums); default: torch.get_float32_matmul_precision() at the step.",
    )
    memory_budget: Optional[str] = _spec_field(  # noqa: UP045
        "memory_budget",
        f"Bytes of logit blocks the loss stage may hold at once, or a size such as '64MiB' (default "
        f"{DEFAULT_MEMORY_BUDGET // 2**20} MiB)."
        " None: that default.",
        default=None,
    )
    sort_by_length: bool = _spec_field(
        "sort_by_length",
        "Embed each column's rows longest first (less padding in a mini-batch); never changes the result.",
    )
    reuse_last_graph: bool = _spec_field(
        "reuse_last_graph",
        "Keep the last encoder mini-batch's graph from the first pass instead of replaying it; never changes the "
        "result.",
    )
    keep_params_unsharded: bool = _spec_field(
        "keep_params_unsharded",
        "Under FSDP2: gather every parameter group once per step and keep it until the last replay (one "
        "all-gather and one reduce-scatter per group per step), for the memory of the full parameters.",
    )
    graph_memory_budget: Optional[str] = _spec_field(  # noqa: UP045
        "graph_memory_budget",
        "Bytes (or a size such as '6GB') of first-pass encoder graphs to keep instead of replaying their "
        "mini-batches, the longest first; the same gradients, fewer forwards. 'auto': on CUDA what the device has "
        "free after the step's own needs ('auto:20GB': at most 20 GB), elsewhere none. Default: replay all but the "
        "last.",
    )
    mini_batch_memory_budget: Optional[str] = _spec_field(  # noqa: UP045
        "mini_batch_memory_budget",
        "With mini_batch_size='auto': the activation memory one encoder mini-batch may take (bytes or a size "
        "such as '2GB'; on CUDA by default half the free memory).",
    )
    directions: Optional[str] = _spec_field(  # noqa: UP045
        "directions",
        "'mnr' / 'clip' / 'tiled': the similarity terms, comma-separated, as sentence-transformers' "
        "MultipleNegativesRankingLoss: query_to_doc (required), query_to_query, doc_to_query, doc_to_doc. "
        "Default: the loss's own (query_to_doc; clip: query_to_doc,doc_to_query).",
    )
    partition_mode: Optional[str] = _spec_field(  # noqa: UP045
        "partition_mode",
        "'joint' (one softmax over every term; GTE with all four directions) or 'per_direction' (one per "
        "direction, averaged). Default: the loss's own ('joint'; clip: 'per_direction').",
    )
    hardness_mode: Optional[str] = _spec_field(  # noqa: UP045
        "hardness_mode",
        "Hardness weighting of negatives (default none): in_batch_negatives (Lan et al. 2025), hard_negatives "
        "(EmbeddingGemma) or all_negatives: adds hardness_strength * stop_grad(similarity) (not scaled) to those "
        "negatives' logits, as sentence-transformers does.",
    )
    hardness_strength: float = _spec_field(
        "hardness_strength",
        "The hardness penalty's alpha, non-negative (e.g. 9 in_batch_negatives, 5 hard_negatives); unused while "
        "hardness_mode is none.",
    )
    guide_model: Optional[str] = _spec_field(  # noqa: UP045
        "guide",
        "'gist' only: the guide SentenceTransformer, a local path (or a Hub name when online); loaded on the "
        "trained model's device, never trained. None (default): self-guided, the model's own embeddings of the "
        "step rate the pairs (no guide model, no extra forward).",
    )
    margin_strategy: str = _spec_field(
        "margin_strategy",
        "'gist' only: 'absolute' or 'relative' margin for removing negatives the guide rates high.",
    )
    margin: float = _spec_field(
        "margin",
        "'gist' only: the margin of margin_strategy.",
    )
    contrast_anchors: bool = _spec_field(
        "contrast_anchors",
        "'gist' only: contrast each anchor with the other anchors.",
    )
    contrast_positives: bool = _spec_field(
        "contrast_positives",
        "'gist' only: contrast each positive with the other positives.",
    )
    document_regularizer_weight: Optional[float] = _spec_field(  # noqa: UP045
        "document_regularizer_weight",
        "The sparse losses only (required there): weight of the documents' FLOPS regulariser (lambda_d), on every column "
        "but the first (on every column with use_document_regularizer_only), e.g. 3e-5.",
    )
    query_regularizer_weight: Optional[float] = _spec_field(  # noqa: UP045
        "query_regularizer_weight",
        "The sparse losses only: weight of the queries' FLOPS regulariser (lambda_q), on the first column, e.g. 5e-5; "
        "none: no query regulariser (inference-free models).",
    )
    document_regularizer_threshold: Optional[int] = _spec_field(  # noqa: UP045
        "document_regularizer_threshold",
        "The sparse losses only: the documents' FLOPS counts only rows with more than this many non-zero entries (FLOPS "
        "with l0 masking); none: every row.",
    )
    query_regularizer_threshold: Optional[int] = _spec_field(  # noqa: UP045
        "query_regularizer_threshold",
        "The sparse losses only: as document_regularizer_threshold, for the queries' FLOPS.",
    )
    use_document_regularizer_only: bool = _spec_field(
        "use_document_regularizer_only",
        "The sparse losses only: every column is a document (symmetric data): one regulariser over all of them, "
        "weighted by document_regularizer_weight.",
    )
    score_mini_batch_size: Optional[int] = _spec_field(  # noqa: UP045
        "score_mini_batch_size",
        "'multi_vector' only: sentence-transformers' scoring chunk, kept for their config (default "
        "mini_batch_size); the scoring tiles are sized from memory_budget and never change the result.",
    )
    num_negatives: Optional[Union[int, str]] = _spec_field(  # noqa: UP007, UP045
        "num_negatives",
        "'cross_encoder' only: documents of other rows scored against each query, drawn at random as "
        "sentence-transformers' reranker loss draws them (default 4); 'all' (or None): every other row's documents.",
    )
    student_temperature: Optional[float] = _spec_field(  # noqa: UP045
        "student_temperature",
        "'distill_kl' / 'multi_vector_distill_kl' / 'sparse_distill_kl' only: the student's softmax temperature (default: temperature, "
        "which sets both softmaxes; the loss is multiplied by student_temperature ** 2).",
    )
    teacher_temperature: Optional[float] = _spec_field(  # noqa: UP045
        "teacher_temperature",
        "'distill_kl' / 'multi_vector_distill_kl' / 'sparse_distill_kl' only: the teacher's softmax temperature "
        "(default: temperature).",
    )
    infonce_weight: float = _spec_field(
        "infonce_weight",
        "Dense and multi-vector distillation losses only (not the sparse ones): the weight of an in-batch "
        "InfoNCE term added to the teacher's loss (each query "
        "against every row's candidates, the first candidate column the positive; across processes with "
        "gather_across_devices); 0: the distillation loss alone.",
    )
    infonce_scale: Optional[float] = _spec_field(  # noqa: UP045
        "infonce_scale",
        "Dense and multi-vector distillation losses only: the InfoNCE term's scale (1 / its temperature); default the loss's own: 20 "
        "(dense), 1 (multi-vector, MaxSim sums over query tokens).",
    )
    same_dataset_order: str = _spec_field(
        "same_dataset_order",
        f"With multi_dataset_batch_sampler='{SAME_DATASET}' (SameDatasetBatchSampler: every process trains on the "
        "same dataset in each step, so gathered negatives never mix tasks): how the datasets take turns. "
        "'proportional': groups of batches in a random order, larger datasets more often, every row trained on; "
        "'round_robin': one group per dataset in turn until the smallest is exhausted.",
    )
    same_dataset_per_optimizer_step: bool = _spec_field(
        "same_dataset_per_optimizer_step",
        f"With multi_dataset_batch_sampler='{SAME_DATASET}': keep a whole optimizer step (all "
        "gradient_accumulation_steps micro-batches of every process) on one dataset, not only each micro-step.",
    )

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
            if not ours and getattr(self, name) != _ARGUMENT_SPECS[name].default:
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
        return self._own_default("partition_mode", "joint")

    def _own_default(self, param: str, otherwise: Any) -> Any:
        """The chosen loss's default of its argument ``param``, or ``otherwise`` where it has none (or None)."""
        default = getattr(loss_parameters(self.loss).get(param), "default", None)
        return otherwise if default is None or default is inspect.Parameter.empty else default

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
            if k != SCALE_PARAMETER_PATTERN
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
        if (
            self.learnable_scale
            and "learnable_scale" in loss_parameters(self.loss)
            and rate
            and not any(re.search(p, name) for p in users for name in _SCALE_PARAMETER_NAMES)
        ):
            ours[SCALE_PARAMETER_PATTERN] = float(rate)
        self.learning_rate_mapping = {**ours, **users}  # a new dict: the user's is not changed

    # ------------------------------------------------------------------ derived settings

    @property
    def loss_scale(self) -> float:
        """The scale the loss starts from: ``scale``, else ``1 / temperature``, else the loss's default (20;
        'gist' 100; 'sparse' and 'multi_vector' 1, as sentence-transformers' own losses)."""
        if self.scale is not None:
            return float(self.scale)
        if self.temperature is not None:
            return 1.0 / self.temperature
        if self.loss == "gist":
            return 1.0 / DEFAULT_GIST_TEMPERATURE
        return LOSS_DEFAULT_SCALES.get(str(self.loss), DEFAULT_SCALE)

    @property
    def loss_class(self) -> type[CachedInfoNCEBase] | type[CachedCrossEncoderLoss]:
        """The loss class ``loss`` names."""
        return LOSSES[LOSS_ALIASES[str(self.loss).lower()]]

    @property
    def model_kind(self) -> str:
        """The sentence-transformers model class the chosen loss trains: ``"SentenceTransformer"``,
        ``"SparseEncoder"`` ('sparse'), ``"MultiVectorEncoder"`` ('multi_vector') or ``"CrossEncoder"``
        ('cross_encoder')."""
        return MODEL_KINDS[LOSS_ALIASES[str(self.loss).lower()]]

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the loss constructor (besides the model; for 'gist', besides the guide too;
        for the sparse losses, besides the base loss, built from `base_loss_kwargs`): every argument the loss
        takes that a field sets (``losses/settings.py``'s names), except where the field leaves the loss's
        own default."""
        return self._kwargs_of(
            self.loss_class, skip=("self", "guide", *UNUSED_PARAMETERS.get(str(self.loss), ()))
        )

    def base_loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the base loss (besides the model), from the fields: 'sparse'
        (``SparseMultipleNegativesRankingLoss``): ``scale``, ``similarity``, ``gather_across_devices``,
        ``directions``, ``partition_mode``, ``hardness_*``; 'sparse_distill_kl' (``SparseDistillKLDivLoss``):
        ``similarity``, ``temperature`` (or ``scale``), ``student_temperature``, ``teacher_temperature``;
        'sparse_margin_mse' (``SparseMarginMSELoss``): ``similarity``. Empty for a loss without a base loss."""
        base = BASE_LOSSES.get(str(self.loss))
        return self._kwargs_of(base, skip=("self",)) if base is not None else {}

    def _kwargs_of(self, cls: type[Any], skip: tuple[str, ...]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for name in inspect.signature(cls.__init__).parameters:
            if name in skip or name in NOT_FIELDS:
                continue
            value = self._loss_argument(name)
            if value is not _LOSS_DEFAULT:
                kwargs[name] = value
        return kwargs

    def _loss_argument(self, name: str) -> Any:
        """The value of the loss's argument ``name`` these fields set, or ``_LOSS_DEFAULT`` (a field's None:
        the loss's own default)."""
        if name == "scale":
            return self.loss_scale
        if name == "temperature":
            return 1.0 / self.loss_scale
        if name == "partition_mode":
            given_terms = self.directions is not None or self.partition_mode is not None
            return self.loss_partition_mode if given_terms else _LOSS_DEFAULT
        if name == "num_negatives" and self.num_negatives in (None, "all"):
            return None  # every in-batch negative (the field's None, as the loss's)
        if (
            name == "similarity_fct"
            and self.similarity is not None
            and (functions := _similarity_functions(self.loss))
        ):
            return functions[self.similarity]  # the callables their loss takes
        value = self.loss_directions if name == "directions" else getattr(self, FIELD_NAMES.get(name, name))
        return _LOSS_DEFAULT if value is None else value

    def loss_settings(self) -> dict[str, Any]:
        """The fields that configure the chosen loss and their values (what the model card lists): the
        loss choice, the scale, and the fields of the arguments that loss takes."""
        taken = set(loss_parameters(self.loss))
        names = ["loss", "scale", "temperature"]
        if self.learnable_scale:
            names.append("scale_learning_rate")
        owners = {FIELD_NAMES.get(p, p): p for p in taken}
        names += [f for f in LOSS_FIELDS if f not in names and f in owners and f not in _DERIVED]
        if "directions" in taken:
            names += ["directions", "partition_mode"]
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


def _similarity_functions(loss: str) -> dict[str, Any]:
    """The similarity callables a loss takes ('sparse': sentence-transformers' ``cos_sim`` / ``dot_score``;
    'multi_vector': the multi-vector scores; the distillation losses, sparse ones included: their pairwise
    scores), by the ``similarity`` field's names; empty for the others."""
    from sentence_transformers.multi_vector_encoder import scoring
    from sentence_transformers.util import cos_sim, dot_score, pairwise_cos_sim, pairwise_dot_score

    pairwise = {"cosine": pairwise_cos_sim, "dot": pairwise_dot_score}
    functions: dict[str, dict[str, Any]] = {
        "sparse": {"cosine": cos_sim, "dot": dot_score},
        "distill_kl": pairwise,
        "margin_mse": pairwise,
        **{name: pairwise for name in SPARSE_DISTILLATION_LOSSES},
        "multi_vector_distill_kl": {
            "maxsim": scoring.colbert_kd_scores,
            "meanmaxsim": scoring.mean_colbert_kd_scores,
            "xtr": scoring.xtr_kd_scores,
        },
        "multi_vector_margin_mse": {
            "maxsim": scoring.colbert_scores_pairwise,
            "meanmaxsim": scoring.mean_colbert_scores_pairwise,
            "xtr": scoring.xtr_scores_pairwise,
        },
        "multi_vector": {
            "maxsim": scoring.colbert_scores,
            "meanmaxsim": scoring.mean_colbert_scores,
            "xtr": scoring.xtr_scores,
        },
    }
    return functions.get(loss, {})


#: fields derived from others for the loss (listed by ``loss_settings`` on their own terms)
_DERIVED = {"scale", "temperature", "directions", "partition_mode"}


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
    ``"auto"``, ``directions`` given as a list).

    Raises:
        ValueError: naming the field of an invalid value or combination.
    """
    key = str(args.loss).lower()
    canonical = canonical_loss(key, type(args).trains)
    if canonical is None:
        names = ", ".join(repr(name) for name in LOSSES)
        classes = ", ".join(cls.__name__ for cls in LOSSES.values())
        spellings = {**LOSS_ALIASES, **{name: name for name in ST_LOSS_NAMES}}
        close = difflib.get_close_matches(key, list(spellings), n=1, cutoff=0.6)
        hint = f" Did you mean loss={canonical_loss(close[0], type(args).trains)!r}?" if close else ""
        raise ValueError(
            f"loss={args.loss!r} is not a cached loss; choose one of {names} (or a class name, ours: {classes}; "
            f"or sentence-transformers' cached loss it replaces, e.g. CachedMultipleNegativesRankingLoss).{hint}"
        )
    args.loss = canonical
    _check_model_kind(args)
    for name in ("mini_batch_size", "mini_batch_num_tokens"):
        value = getattr(args, name)
        if isinstance(value, str) and value.strip().lower() == "auto":
            setattr(args, name, "auto")  # sized from mini_batch_memory_budget at the first step
    _check_auto_budget(args)
    if args.loss == "cross_encoder" and args.num_negatives is None:
        args.num_negatives = "all"  # None means every in-batch negative, as for the loss: the card says so
    if isinstance(args.directions, (list, tuple)):  # given as a list in Python or YAML
        args.directions = ",".join(args.directions)
    _refuse_sparse_infonce(args)
    _validate_spec_fields(args)
    if (
        args.scale is not None
        and args.temperature is not None
        and not math.isclose(args.scale * args.temperature, 1.0, rel_tol=1e-6)
    ):
        raise ValueError(
            f"scale={args.scale} and temperature={args.temperature} disagree (scale = 1 / temperature = "
            f"{1 / args.temperature:g}); set only one of scale and temperature."
        )
    if args.learnable_scale:
        check_max_scale(args.max_scale, args.loss_scale)
    if args.loss in BASE_LOSSES and args.document_regularizer_weight is None:
        raise ValueError(
            f"loss={args.loss!r} needs document_regularizer_weight: the weight of the documents' FLOPS regulariser "
            "(lambda_d, e.g. 3e-5; SPLADE's CachedSpladeLoss has no default either)."
        )
    if args.directions is not None or args.partition_mode is not None:
        directions = args.loss_directions or args._own_default("directions", ONE_DIRECTION)
        check_directions(directions, args.loss_partition_mode, "directions")
        if args.symmetric is not None:
            raise ValueError("give either symmetric or directions / partition_mode, not both.")
    check_hardness(args.hardness_mode, args.hardness_strength, "hardness_mode")
    check_negative_bank(args.negative_bank_size, args.mask_duplicates, args.in_batch_negatives)
    _validate_similarity(args)
    batch = args.per_device_train_batch_size
    rows = args.mini_batch_size
    # caching is off when the whole batch, every column's rows together, fits in one mini-batch; the columns
    # are not known here, but there are at least two: a batch of pairs is the one this can tell about (a
    # reranker's mini-batches hold pairs, B x (1 + k) of them: a batch of B fits in one more rarely)
    if (
        args.mini_batch_num_tokens is None
        and isinstance(rows, int)
        and rows >= 2 * batch
        and args.loss != "cross_encoder"
    ):
        warnings.warn(
            f"mini_batch_size={args.mini_batch_size} >= 2 x per_device_train_batch_size={batch}: a batch of pairs "
            f"({2 * batch} rows, both columns together) fits in one encoder mini-batch, so caching is off for it "
            "(same result and memory as the non-cached loss; a batch with more columns is cached while its rows "
            "together exceed mini_batch_size). Use a mini_batch_size smaller than the batch to save memory.",
            UserWarning,
            stacklevel=user_stacklevel(),
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


def _check_auto_budget(args: CachedLossArguments) -> None:
    """``mini_batch_memory_budget`` goes with ``"auto"`` mini-batches: without ``"auto"`` it would be unused (an
    error naming both fixes); ``"auto"`` without it has a default on CUDA only (an error where the run has no
    CUDA device: no CUDA here, or ``use_cpu``), refused now rather than at the first step."""
    auto = is_auto(args.mini_batch_size, args.mini_batch_num_tokens)
    budget = args.mini_batch_memory_budget
    if budget is not None and not auto:
        raise ValueError(
            f"mini_batch_memory_budget={budget!r} sizes 'auto' mini-batches only, and mini_batch_size="
            f"{args.mini_batch_size!r} is fixed: it would be unused. Set mini_batch_size='auto' (or "
            "mini_batch_num_tokens='auto') to size the mini-batches to it, or remove mini_batch_memory_budget."
        )
    if auto and budget is None and (getattr(args, "use_cpu", False) or not _cuda_available()):
        raise auto_needs_budget("cpu")


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


#: loss arguments every loss takes in some form: the scale (or temperature, its inverse), and the
#: similarity (a name whose meaning depends on the loss, see ``_validate_similarity``)
_ANY_LOSS = {"scale", "temperature", "similarity_fct"}


def _refuse_sparse_infonce(args: CachedLossArguments) -> None:
    """The in-batch InfoNCE term (``infonce_weight``, ``infonce_scale``) is the dense and multi-vector
    distillation losses' (``CachedDistill*``); the sparse distillation losses (``CachedSparseLoss`` with a
    distillation base loss) have none: refused, saying where it is."""
    if args.loss not in SPARSE_DISTILLATION_LOSSES:
        return
    for name in ("infonce_weight", "infonce_scale"):
        if getattr(args, name) not in (None, LOSS_DEFAULTS[name]):
            others = ", ".join(repr(n) for n in DISTILLATION_LOSSES if n not in SPARSE_DISTILLATION_LOSSES)
            raise ValueError(
                f"{name} is on the dense and multi-vector distillation losses only ({others}): the in-batch "
                f"InfoNCE term; loss={args.loss!r} (CachedSparseLoss with {BASE_LOSSES[args.loss].__name__} as its "
                f"base loss) has none. Remove {name} (for a sparse model's in-batch negatives, loss='sparse')."
            )


def _validate_spec_fields(args: CachedLossArguments) -> None:
    """Each field by its spec's check (the losses' own, naming the field), and only for a loss that takes
    it: a field away from its default that the chosen loss would ignore is an error (not silence) naming
    the losses that take it (which loss takes a field is its signature's answer alone)."""
    taken = loss_parameters(args.loss)
    for f in dataclasses.fields(args):
        param, spec = FIELD_SPECS.get(f.name, (None, None))
        value = getattr(args, f.name)
        if spec is None or value is None:
            continue
        spec.check(f.name, value)
        if param is None or param in _ANY_LOSS or param in taken or value == f.default:
            continue
        takers = [f"loss={name!r}" for name in LOSSES if param in loss_parameters(name)]
        takers_text = f"{takers[0]} only" if len(takers) == 1 else f"{', '.join(takers[:-1])} or {takers[-1]}"
        base = BASE_LOSSES.get(args.loss)
        with_base = f" with {base.__name__} as its base loss" if base is not None else ""
        raise ValueError(
            f"{f.name} does not apply to loss={args.loss!r} ({args.loss_class.__name__}{with_base} does not take "
            f"{param}): {f.name} applies to {takers_text}. Remove {f.name}."
        )


def _validate_similarity(args: CachedLossArguments) -> None:
    """``similarity`` in canonical form for the chosen loss (None: the loss's own default)."""
    if args.similarity is None:
        return
    if args.loss == "cross_encoder":
        raise ValueError(
            "loss='cross_encoder' scores (query, document) pairs with the model itself; remove similarity."
        )
    if args.loss == "gist":
        if args.similarity != "cosine":
            raise ValueError("loss='gist' compares cosine similarities; remove similarity (or set 'cosine').")
        return
    if str(args.loss).startswith("multi_vector"):
        name = str(args.similarity).lower()
        if name not in (scores := _similarity_functions(args.loss)):
            raise ValueError(
                f"similarity for loss={args.loss!r} must be 'maxsim', 'meanmaxsim' or 'xtr' (the multi-vector "
                f"scores), got {args.similarity!r}.{closest_name_hint(name, list(scores))}"
            )
        args.similarity = name
        return
    try:  # the names the losses themselves accept
        args.similarity = str(resolve_similarity(str(args.similarity)))  # a name: always "cosine" or "dot"
    except ValueError:
        raise ValueError(
            f"similarity must be 'cosine' or 'dot', got {args.similarity!r}: the arguments (and the command line) "
            "name only these two ('maxsim', 'meanmaxsim', 'xtr': loss='multi_vector'). The loss itself scores "
            "any similarity exactly (slower, one tile at a time through autograd): build it in Python with "
            "similarity_fct=sentence_transformers.util.euclidean_sim (or manhattan_sim, or your own function)."
        ) from None
