"""SPLADE with GradCache: sentence-transformers' ``CachedSpladeLoss``, its stage
[`Splade`][st_cached_losses.losses.stages.sparse.Splade] (the base loss on the package's InfoNCE core where it
is a multiple-negatives ranking loss, else through autograd; the FLOPS regularisers from column sums), the
embeddings cached compact where that is exact and saves memory
([`sparse_cache`][st_cached_losses.losses.sparse_cache]).

The base loss's settings (``scale``, ``similarity_fct``, ``directions``, ``partition_mode``, ``hardness_*``,
``gather_across_devices``) stay on the base loss, as in sentence-transformers: they are attributes of this loss
that read and set the base loss's, and are checked again at every step, however they were set."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseDistillKLDivLoss,
    SparseMarginMSELoss,
    SparseMultipleNegativesRankingLoss,
)
from torch import nn

from st_cached_losses.engine.features import batch_size_of
from st_cached_losses.engine.lists import ListColumns, check_list_columns
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.losses.base import CachedLoss
from st_cached_losses.losses.cached_mnr import list_refusal, ranking_stage
from st_cached_losses.losses.citations import FLOPS_CITATION, GRADCACHE_CITATION, SPLADE_CITATION
from st_cached_losses.losses.ranking import RankingSettings, ranking_citations
from st_cached_losses.losses.registry import Variant
from st_cached_losses.losses.settings import (
    LossStageSettings,
    check_bool,
    check_nonnegative,
    redefault,
    setting,
)
from st_cached_losses.losses.similarity import EMBEDDING, PAIRWISE
from st_cached_losses.losses.sparse_cache import CompactSparseRows, zero_gradient_at_zero
from st_cached_losses.losses.stages.infonce import InfoNCE
from st_cached_losses.losses.stages.sparse import Regularizer, Splade, is_flops

logger = logging.getLogger(__name__)

__all__ = [
    "BaseLossSetting",
    "CachedSparseLoss",
    "SparseBaseSettings",
    "SparseSettings",
    "on_core",
]


def on_core(loss: nn.Module) -> bool:
    """Whether the base loss is sentence-transformers' multiple-negatives ranking loss (their
    ``SparseMultipleNegativesRankingLoss`` is one), whose loss and gradient the core computes."""
    return (
        isinstance(loss, MultipleNegativesRankingLoss)
        and type(loss).compute_loss_from_embeddings
        is MultipleNegativesRankingLoss.compute_loss_from_embeddings
    )


def _base_loss(name: str, value: Any) -> Any:
    if not hasattr(value, "compute_loss_from_embeddings"):
        raise ValueError(
            f"CachedSparseLoss: the base loss {type(value).__name__} has no compute_loss_from_embeddings"
            "(embeddings, labels) method; pass a sparse-encoder loss such as SparseMultipleNegativesRankingLoss."
        )
    return value


def _required_weight(name: str, value: Any) -> float:
    weight = check_nonnegative(name, value, optional=False)
    assert weight is not None  # not optional
    return weight


def _threshold(name: str, value: Any) -> float | None:
    return check_nonnegative(name, value, example="100 (non-zero entries)")


#: the base loss's settings read through this loss, checked again at every step when one changed
BASE_OPTIONS = (
    "scale",
    "similarity_fct",
    "gather_across_devices",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
)


@dataclass(frozen=True, kw_only=True)
class SparseBaseSettings(RankingSettings):
    """The base loss's options as the core computes them (its scale, similarity, directions...), read from the
    base loss and checked as the ranking losses' are, with this loss's duplicate masking and loss stage plan."""

    owner: ClassVar[str] = "CachedSparseLoss"


@dataclass(frozen=True, kw_only=True)
class SparseSettings(LossStageSettings):
    """[`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss]'s own settings:
    sentence-transformers' ``CachedSpladeLoss`` arguments and ours (the base loss's options stay on it)."""

    owner: ClassVar[str] = "CachedSparseLoss"

    loss: nn.Module = setting(
        doc="The base loss, with compute_loss_from_embeddings(embeddings, labels); usually "
        "SparseMultipleNegativesRankingLoss(model).",
        check=_base_loss,
        config="always",
        module=True,
    )
    document_regularizer_weight: float = setting(
        doc="Weight of the documents' FLOPS regulariser (lambda_d), on every column but the first (on every column "
        "with use_document_regularizer_only), e.g. 3e-5; required.",
        check=_required_weight,
        config="always",
    )
    query_regularizer_weight: float | None = setting(
        None,
        doc="Weight of the queries' FLOPS regulariser (lambda_q), on the first column, e.g. 5e-5; None: no query "
        "regulariser (inference-free models).",
        check=check_nonnegative,
        config="never",
    )
    document_regularizer: nn.Module | None = setting(
        None, doc="A regulariser of the documents instead of the default FlopsLoss.", config="never"
    )
    query_regularizer: nn.Module | None = setting(
        None, doc="A regulariser of the queries instead of the default FlopsLoss.", config="never"
    )
    document_regularizer_threshold: float | None = setting(
        None,
        doc="The documents' FLOPS counts only rows with more than this many non-zero entries (FLOPS with l0 "
        "masking); None: every row.",
        check=_threshold,
        config="never",
    )
    query_regularizer_threshold: float | None = setting(
        None,
        doc="As document_regularizer_threshold, for the queries' FLOPS.",
        check=_threshold,
        config="never",
    )
    use_document_regularizer_only: bool = setting(
        False,
        doc="Every column is a document (symmetric data): one regulariser over all of them, weighted by "
        "document_regularizer_weight.",
        check=check_bool,
        config="never",
    )
    mask_duplicates: bool = redefault(RankingSettings, "mask_duplicates", False)

    def validate(self) -> None:
        super().validate()
        if self.query_regularizer_weight is not None and self.use_document_regularizer_only:
            raise ValueError(
                "query_regularizer_weight needs a query regulariser: with use_document_regularizer_only=True every "
                "column is a document. Set use_document_regularizer_only=False, or query_regularizer_weight=None."
            )
        for kind in ("document", "query"):
            name = f"{kind}_regularizer_threshold"
            if getattr(self, name) is None:
                continue
            given = getattr(self, f"{kind}_regularizer")
            if kind == "query" and self.use_document_regularizer_only and given is None:
                raise ValueError(
                    f"{name} needs a query regulariser: with use_document_regularizer_only=True every column is a "
                    "document. Set use_document_regularizer_only=False first."
                )
            if given is not None and not hasattr(given, "threshold"):
                raise ValueError(
                    f"{name}: the {kind} regulariser is a {type(given).__name__}, which has no threshold; set its "
                    f"own attributes ({kind}_regularizer), or use the default FlopsLoss."
                )
        if self.mask_duplicates and not on_core(self.loss):
            raise ValueError(
                "CachedSparseLoss: mask_duplicates masks the negatives of SparseMultipleNegativesRankingLoss; the base "
                f"loss is a {type(self.loss).__name__}. Set mask_duplicates=False."
            )

    def keys_config(self) -> dict[str, Any]:
        """``SpladeLoss``'s keys, those of its optional arguments in use as it writes them (the base loss as a
        module, rendered with its own config by the model card), and ``CachedSpladeLoss``'s
        ``mini_batch_size`` / ``mini_batch_num_tokens``."""
        config: dict[str, Any] = {
            "loss": self.loss,
            "document_regularizer_weight": self.document_regularizer_weight,
        }
        if self.query_regularizer_weight is not None:
            config["query_regularizer_weight"] = self.query_regularizer_weight
        for kind in ("document", "query"):
            given = getattr(self, f"{kind}_regularizer")
            if given is not None and not isinstance(given, FlopsLoss):
                config[f"{kind}_regularizer"] = type(given).__name__
            threshold = getattr(self, f"{kind}_regularizer_threshold")
            if threshold is not None:
                config[f"{kind}_regularizer_threshold"] = threshold
        if self.use_document_regularizer_only:
            config["use_document_regularizer_only"] = True
        config["mini_batch_size"] = self.mini_batch_size
        config["mini_batch_num_tokens"] = self.mini_batch_num_tokens
        return config

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """Duplicate masks (not an option of sentence-transformers' ``SpladeLoss`` or its base losses)."""
        return (
            *super().beyond_sentence_transformers(),
            *(("mask_duplicates",) if self.mask_duplicates else ()),
        )

    def citations(self) -> tuple[str, ...]:
        """The base loss's options' papers, where the core computes it."""
        base: Any = self.loss
        if not on_core(base):
            return ()
        return ranking_citations(
            base.directions, base.partition_mode, base.hardness_mode, base.hardness_strength
        )


class BaseLossSetting:
    """A setting of the base loss as an attribute of this loss: read from the base loss, assigned to it after
    the check of its options as a whole (and checked again at every step, whoever set them)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = f"The base loss's ``{name}`` (read and set on ``loss.loss``)."

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.base_settings(), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        checked = obj.base_settings().replace(**{self.name: value})
        base = obj.settings.loss
        for name in BASE_OPTIONS:
            if getattr(base, name) != getattr(checked, name):
                setattr(base, name, getattr(checked, name))


class CachedSparseLoss(CachedLoss):
    name = "sparse"
    st_names = ("CachedSpladeLoss", "SpladeLoss")
    settings_class = SparseSettings
    citations = (GRADCACHE_CITATION, SPLADE_CITATION, FLOPS_CITATION)
    equivalent_st_loss = "CachedSpladeLoss"
    model_kind = "SparseEncoder"
    #: the base loss the arguments build for 'sparse' (from the fields its constructor takes)
    default_base_loss = SparseMultipleNegativesRankingLoss
    default_base_similarity = EMBEDDING
    #: 'sparse_distill_kl' / 'sparse_margin_mse': this loss with sentence-transformers' distillation base
    #: losses, which leave the ranking core's settings unused
    variants = tuple(
        Variant(
            name,
            base_loss=base,
            aliases=(name.replace("_", "-"),),
            st_names=(base.__name__,),
            unused=frozenset({"mask_duplicates", "path", "tile_size", "memory_budget", "matmul_precision"}),
            distillation=True,
            base_similarity=PAIRWISE,
        )
        for name, base in (
            ("sparse_distill_kl", SparseDistillKLDivLoss),
            ("sparse_margin_mse", SparseMarginMSELoss),
        )
    )

    scale = BaseLossSetting("scale")
    similarity_fct = BaseLossSetting("similarity_fct")
    gather_across_devices = BaseLossSetting("gather_across_devices")
    directions = BaseLossSetting("directions")
    partition_mode = BaseLossSetting("partition_mode")
    hardness_mode = BaseLossSetting("hardness_mode")
    hardness_strength = BaseLossSetting("hardness_strength")
    symmetric = BaseLossSetting("symmetric")

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        document_regularizer_weight: float,
        query_regularizer_weight: float | None = None,
        document_regularizer: nn.Module | None = None,
        query_regularizer: nn.Module | None = None,
        document_regularizer_threshold: float | None = None,
        query_regularizer_threshold: float | None = None,
        use_document_regularizer_only: bool = False,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        show_progress_bar: bool = False,
        *,
        mask_duplicates: bool = False,
        **engine: Any,
    ) -> None:
        """
        SPLADE's loss (a ranking loss plus FLOPS regularisers on the documents and the queries) with
        GradCache: the gradients of a batch of thousands with the memory of one encoder mini-batch, exactly
        those of sentence-transformers' ``SpladeLoss`` / ``CachedSpladeLoss``.

        With ``SparseMultipleNegativesRankingLoss`` as the base loss (the usual choice), the ranking loss and
        its gradient wrt every embedding are computed by the core in chunks sized from ``memory_budget`` (dot
        products of the vocabulary-sized rows, no ``B x C`` score matrix), gathered or by ring exchange across
        processes; the FLOPS regularisers come from the column sums of the cached embeddings, with their
        gradient in closed form. Any other base loss (or regulariser) with ``compute_loss_from_embeddings``
        runs on the whole batch through autograd, as in sentence-transformers.

        The constructor takes ``CachedSpladeLoss``'s arguments in its positional order, then our extras,
        keyword-only. The base loss's settings (``scale``, ``similarity_fct``, ``directions``,
        ``partition_mode``, ``hardness_mode``, ``hardness_strength``, ``gather_across_devices``) stay on the
        base loss, read and checked at every step, and are also attributes of this loss (reading or setting
        one reads or sets the base loss's, checked); the loss's own settings are a
        [`SparseSettings`][st_cached_losses.losses.cached_sparse.SparseSettings].

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan (``path``,
        ``tile_size``, ``memory_budget``), keyword-only, each declared once on
        [`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result.

        Args:
            model: the SparseEncoder to train (e.g. ``MLMTransformer`` + ``SpladePooling``).
            loss: the base loss, with ``compute_loss_from_embeddings(embeddings, labels)``; usually
                ``SparseMultipleNegativesRankingLoss(model)``.
            document_regularizer_weight: weight of the documents' regulariser ("lambda_d"): on the positives
                and negatives (every column but the first), or on every column with
                ``use_document_regularizer_only``.
            query_regularizer_weight: weight of the queries' regulariser ("lambda_q"), on the first column;
                None: no query regulariser (inference-free models).
            document_regularizer: the documents' regulariser instead of the default ``FlopsLoss``.
            query_regularizer: the queries' regulariser instead of the default ``FlopsLoss``.
            document_regularizer_threshold: the default FLOPS of the documents counts only rows with more than
                this many non-zero entries (FLOPS with l0 masking).
            query_regularizer_threshold: the same for the queries' FLOPS.
            use_document_regularizer_only: every column is a document (symmetric data): one regulariser
                over all of them, weighted by ``document_regularizer_weight``.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per encoder mini-batch instead.
            show_progress_bar: tqdm bars over the mini-batches.
            mask_duplicates: mask false negatives found by equal inputs (see ``CachedMNRLoss``); with the
                core's base loss only.

        References:
            - Formal et al., From Distillation to Hard Negative Sampling: Making Sparse Neural IR Models More
              Effective, 2022: https://huggingface.co/papers/2205.04733
            - Paria et al., Minimizing FLOPs to Learn Efficient Sparse Representations, 2020:
              https://huggingface.co/papers/2004.05665
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. A SparseEncoder whose inputs have a batch dimension.
            2. The inputs of the base loss: (anchor, positive[, negatives...]) for
               ``SparseMultipleNegativesRankingLoss``.

        Inputs:
            | Texts | Labels |
            |---|---|
            | (anchor, positive) pairs | none |
            | (anchor, positive, negative_1, ..., negative_n) | none |
            | (anchor, positive[, negative]), lists of negatives / of positives per row (or None in negative_k) | none |
            | what another base loss takes | its |

        Lists (with ``SparseMultipleNegativesRankingLoss``, and the trainer's
        ``data_collator=ListDataCollator(preprocess_fn=model.preprocess)``): as ``CachedMNRLoss`` takes them, the
        documents' regulariser over the documents that exist (every positive and list entry); another base loss
        refuses them.

        Returns (forward):
            a dict of the loss's components, as sentence-transformers' ``SpladeLoss``: ``base_loss`` (or
            the base loss's own keys), ``document_regularizer_loss`` and, with a query weight,
            ``query_regularizer_loss``, the regularisers weighted. The trainer sums and logs them.

        Relations:
            - The same loss and gradients as ``SpladeLoss(model, loss, ...)`` and ``CachedSpladeLoss`` with the
              same arguments; on one process, and across processes with ``gather_across_devices`` on the
              base loss (then the regularisers are those of every process's rows together: the
              single-process loss of the whole batch).

        Example:
            ```python
            from datasets import Dataset
            from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainer, losses
            from st_cached_losses import CachedSparseLoss

            model = SparseEncoder("naver/splade-cocondenser-ensembledistil")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            loss = CachedSparseLoss(
                model,
                loss=losses.SparseMultipleNegativesRankingLoss(model),
                document_regularizer_weight=3e-5,
                query_regularizer_weight=5e-5,
                mini_batch_size=32,
            )
            trainer = SparseEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        if use_document_regularizer_only and query_regularizer_weight is not None:
            logger.warning(
                "CachedSparseLoss: use_document_regularizer_only=True regularises every column as a document with "
                "document_regularizer_weight; query_regularizer_weight=%r is ignored (set to None).",
                query_regularizer_weight,
            )
            query_regularizer_weight = None
        elif query_regularizer_weight is None and not use_document_regularizer_only:
            logger.warning(
                "CachedSparseLoss: query_regularizer_weight is None, so the queries are not regularised: right for "
                "an inference-free model (queries not encoded by the model); otherwise set it, e.g. 5e-5."
            )
        self._checked: tuple[Any, SparseBaseSettings] | None = None
        super().__init__(
            model,
            SparseSettings(
                loss=loss,
                document_regularizer_weight=document_regularizer_weight,
                query_regularizer_weight=query_regularizer_weight,
                document_regularizer=document_regularizer,
                query_regularizer=query_regularizer,
                document_regularizer_threshold=document_regularizer_threshold,
                query_regularizer_threshold=query_regularizer_threshold,
                use_document_regularizer_only=use_document_regularizer_only,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                show_progress_bar=show_progress_bar,
                mask_duplicates=mask_duplicates,
                **engine,
            ),
        )

    # ------------------------------------------------------------------ the base loss's settings

    def base_settings(self) -> SparseBaseSettings:
        """The base loss's options, checked (again whenever one changed, however it was set), with this loss's
        duplicate masking and plan; reading them for another base loss is an error."""
        s = self.settings
        base: Any = s.loss
        if not on_core(base):
            raise AttributeError(
                f"CachedSparseLoss: the base loss is a {type(base).__name__}, not SparseMultipleNegativesRankingLoss: "
                "read its own attributes (loss.loss)."
            )
        key = (*(getattr(base, name) for name in BASE_OPTIONS), s)
        if self._checked is None or self._checked[0] != key:
            checked = SparseBaseSettings(
                **{name: getattr(base, name) for name in BASE_OPTIONS},
                mask_duplicates=s.mask_duplicates,
                **s.plan().options(),
            )
            self._checked = (key, checked)
        return self._checked[1]

    @property
    def similarity(self) -> Any:
        """The core's score of the base loss."""
        return self.base_settings().similarity

    # ------------------------------------------------------------------ regularisers

    @property
    def document_regularizer(self) -> nn.Module:
        """The documents' regulariser (the given one, or the default ``FlopsLoss``)."""
        return self._modules["document_regularizer"]  # type: ignore[return-value]

    @document_regularizer.setter
    def document_regularizer(self, value: nn.Module | None) -> None:
        self.update_settings(document_regularizer=value)

    @property
    def query_regularizer(self) -> nn.Module | None:
        """The queries' regulariser (the given one, the default ``FlopsLoss``, or None with
        ``use_document_regularizer_only``)."""
        return self._modules["query_regularizer"]

    @query_regularizer.setter
    def query_regularizer(self, value: nn.Module | None) -> None:
        self.update_settings(query_regularizer=value)

    def _settings_changed(self, old: Any, new: Any) -> None:
        # the regularisers in use: the given ones, else sentence-transformers' default FlopsLoss (kept while
        # it stays the default), the thresholds set on them
        model = cast(Any, self.model)
        for kind in ("document", "query"):
            given = getattr(new, f"{kind}_regularizer")
            current = self._modules.get(f"{kind}_regularizer")
            if given is not None:
                module: nn.Module | None = given
            elif kind == "query" and new.use_document_regularizer_only:
                module = None
            elif current is not None and old is not None and getattr(old, f"{kind}_regularizer") is None:
                module = current
            else:
                module = FlopsLoss(model, threshold=None)
            threshold = getattr(new, f"{kind}_regularizer_threshold")
            if (
                module is not None
                and hasattr(module, "threshold")
                and (given is None or threshold is not None)
            ):
                module.threshold = threshold
            self._modules[f"{kind}_regularizer"] = module
        super()._settings_changed(old, new)
        if on_core(new.loss):
            self.base_settings()  # the base loss's options, checked now too

    def _compact_allowed(self) -> bool:
        """Whether this step's embeddings may be kept packed ([`sparse_cache`][st_cached_losses.losses.sparse_cache]):
        the core computes the base loss with dot products, the regularisers are FLOPS, and the model is a
        SPLADE encoder whose exactly-zero entries have no gradient. Across processes (gathered or ring) too:
        the processes agree on the form (``_compact_across``)."""
        s = self.settings
        if not on_core(s.loss) or self.base_settings().similarity != "dot":
            return False
        regularisers = [self.document_regularizer]
        if s.query_regularizer_weight is not None and self.query_regularizer is not None:
            regularisers.append(self.query_regularizer)
        return all(is_flops(r) for r in regularisers) and zero_gradient_at_zero(self.model)

    def _compact_across(self) -> bool:
        """Whether the loss stage reads every process's rows together (gathered or by ring): every process
        must then keep the same form, agreed on in one all-reduce."""
        return (
            on_core(self.settings.loss)
            and bool(self.base_settings().gather_across_devices)
            and is_distributed()
        )

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Lists with the core's base loss (``SparseMultipleNegativesRankingLoss``) only: its options checked as
        ``CachedMNRLoss``'s (lists of hard negatives, several positives per row); the documents'
        regulariser then reads the documents that exist (every list entry, none for a missing one)."""
        owner, base = type(self).__name__, self.settings.loss
        if not on_core(base):
            raise ValueError(
                f"{owner}: the base loss {type(base).__name__} reads columns of one text per row (its "
                f"compute_loss_from_embeddings knows no lists): column(s) {lists.kept} (or a column left out) hold "
                "lists of texts or None values. Lists of hard negatives and several positives per row are taken "
                "with SparseMultipleNegativesRankingLoss as the base loss; otherwise give one text per row in "
                "every column."
            )
        check_list_columns([batch_size_of(f) for f in features], lists, owner)
        settings = self.base_settings()
        across = settings.gather_across_devices and is_distributed()
        # across processes the options are checked once every process knows whether any has lists (the stage)
        message = None if across else list_refusal(settings, owner, lists.counts[1] is not None, False)
        if message:
            raise ValueError(message)

    def _ranking(self) -> InfoNCE:
        stage = ranking_stage(type(self).__name__, self.base_settings())
        stage.refuse_lists = functools.partial(self._list_refusal, stage.refuse_lists)
        return stage

    def _list_refusal(self, ranking: Any, several: bool, across: bool) -> str | None:
        """The ranking options' refusal of lists (``ranking(several, across)``), and several positives per row
        across processes where this step's embeddings are kept compact (packed rows are exchanged as such by
        the gathered and ring paths of one positive per row only); the processes agree on the form, so every
        process refuses alike."""
        message = ranking(several, across) if ranking is not None else None
        if message or not (several and across and getattr(self.cache.form, "compact", False)):
            return message
        return (
            f"{type(self).__name__}: gather_across_devices=True (the base loss's) cannot take several positives "
            "per row (a positive column of lists) with this step's embeddings kept compact (a SPLADE model's "
            "packed rows: only the dense form is gathered pair by pair). Give one positive per row, or set "
            "gather_across_devices=False on the base loss."
        )

    def build_stage(self) -> Splade:
        s = self.settings
        first = 0 if s.use_document_regularizer_only else 1
        regularizers = [
            Regularizer(
                "document_regularizer_loss",
                self.document_regularizer,
                s.document_regularizer_weight,
                slice(first, None),
            )
        ]
        if s.query_regularizer_weight is not None and self.query_regularizer is not None:
            regularizers.append(
                Regularizer(
                    "query_regularizer_loss", self.query_regularizer, s.query_regularizer_weight, slice(0, 1)
                )
            )
        return Splade(
            owner=type(self).__name__,
            base_loss=s.loss,
            ranking=self._ranking if on_core(s.loss) else None,
            regularizers=regularizers,
            form=CompactSparseRows(self._compact_allowed, across=self._compact_across),
        )
