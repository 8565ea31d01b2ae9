"""The multiple-negatives ranking loss with GradCache, and the options of sentence-transformers'
``MultipleNegativesRankingLoss`` it shares with [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss] and [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss] (which
are this loss with other defaults): the similarity, the directions and their partition, hardness weighting
and the masking of duplicates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.engine.multimodal import input_keys
from st_cached_losses.functional import Similarity
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses._base import LearnableScale, LossStageOptions, LossTerms, StageOutput, StepData
from st_cached_losses.losses.citations import (
    CONTACCUM_CITATION,
    GRADCACHE_CITATION,
    GTE_CITATION,
    HARDNESS_CITATION,
    MNRL_CITATION,
)
from st_cached_losses.losses.negative_bank import NegativeBank
from st_cached_losses.losses.settings import (
    ONE_DIRECTION,
    TWO_DIRECTIONS,
    VALID_DIRECTIONS,
    ConfigTuple,
    Setting,
    check_directions,
    check_hardness,
    check_in_batch_negatives,
    check_negative_bank,
    check_own_candidates,
    is_symmetric,
    resolve_similarity,
    similarity_name,
)

__all__ = ["CachedMNRLoss", "ranking_citations", "ranking_terms"]


def ranking_terms(
    step: StepData,
    n_rows: int,
    n_columns: int,
    directions: Sequence[str],
    partition_mode: str,
    hardness_mode: str | None,
    hardness_strength: float,
    similarity: Similarity = "cosine",
    in_batch_negatives: bool = True,
) -> LossTerms:
    """The core's ``terms`` for sentence-transformers' ranking options, and the duplicate keys that mask
    them (those of these rows: a wrapper may call the loss stage on other rows, and masks nothing then)."""
    keys = step.keys if step.keys is not None and len(step.keys[0]) == n_rows else None
    terms = mnrl_terms(
        directions, partition_mode, hardness_mode, hardness_strength, n_columns, in_batch_negatives
    )
    return LossTerms(terms, similarity, keys=keys)


def ranking_citations(
    directions: Sequence[str], partition_mode: str, hardness_mode: str | None, hardness_strength: float
) -> tuple[str, ...]:
    """The papers of the ranking options in use: GTE's four directions in one softmax, hardness weighting."""
    extra: tuple[str, ...] = ()
    if set(directions) == set(VALID_DIRECTIONS) and partition_mode == "joint":
        extra += (GTE_CITATION,)
    if hardness_mode is not None and hardness_strength > 0:
        extra += (HARDNESS_CITATION,)
    return extra


class CachedMNRLoss(LearnableScale):
    _citations = (GRADCACHE_CITATION, MNRL_CITATION)

    #: this process's negative bank (``negative_bank_size``): its entries, their ages, its state
    negative_bank: NegativeBank

    def _check_no_bank(self, value: bool) -> bool:
        check_negative_bank(self.negative_bank_size, value, self._in_batch_or_default())
        return value

    mask_duplicates = Setting[bool](validate=_check_no_bank)

    def _check_in_batch_negatives(self, value: bool) -> bool:
        check_negative_bank(self.negative_bank_size, False, value)
        check_in_batch_negatives(
            value, self.directions or ONE_DIRECTION, self.hardness_mode, type(self).__name__
        )
        return value

    #: False: each anchor against its own positive and hard negatives only (no in-batch negatives)
    in_batch_negatives = Setting[bool](validate=_check_in_batch_negatives)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] = ONE_DIRECTION,
        partition_mode: str = "joint",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        mask_duplicates: bool = False,
        negative_bank_size: int = 0,
        negative_bank_max_age: int | None = None,
        in_batch_negatives: bool = True,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        Multiple-negatives ranking loss (InfoNCE with in-batch negatives) with GradCache: the gradients of a
        batch of thousands with the memory of one encoder mini-batch, exactly.

        Each anchor is scored against its positive, every hard negative, and every other row's positive and
        negatives; the loss is the cross-entropy of picking the positive. The batch is embedded in mini-batches
        without a graph, the loss and its gradient wrt every embedding are computed in chunks sized from a
        memory budget (normalised once, one pass, no ``B x C`` matrix), and the encoder is replayed mini-batch
        by mini-batch in backward with the cached gradients. Rows are embedded longest first so mini-batches
        carry little padding, the last mini-batch's graph is kept instead of re-run, and a batch that fits in
        one mini-batch, all its columns' rows together, is not cached at all.

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan (``path``,
        ``tile_size``, ``memory_budget``), keyword-only, each documented once on
        [`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]; none changes the result.

        Args:
            model: the SentenceTransformer to train.
            scale: multiplies the similarities (``1 / temperature``); 20 suits cosine similarity. The initial
                value when learnable.
            similarity_fct: ``sentence_transformers.util.cos_sim`` / ``"cosine"`` (default) or ``dot_score`` /
                ``"dot"`` (GEMM tiles); any other function ``f(a, b) -> (len(a), len(b))`` (e.g.
                ``euclidean_sim``) is scored exactly tile by tile through autograd (slower). The full matrix is
                never built.
            mini_batch_size: rows per encoder forward (GradCache's chunk): sets the memory, never the result.
                Smaller than the batch to save memory; caching is off only when the whole batch, all its
                columns' rows together, fits in one mini-batch. ``"auto"``: the largest that fits
                ``mini_batch_memory_budget``, measured at the first step (and again for longer rows) and logged.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per encoder mini-batch instead of
                ``mini_batch_size`` rows, as in sentence-transformers: rows are packed longest first while their
                token count stays within it (a longer row alone); ``"auto"``: the largest budget that fits
                ``mini_batch_memory_budget``.
            gather_across_devices: score each process's anchors against the candidates of every process
                (exact global-batch gradients across processes).
            directions: the similarity terms of each row, as sentence-transformers'
                ``MultipleNegativesRankingLoss``: ``"query_to_doc"`` (required: every candidate column),
                ``"query_to_query"`` (the other anchors), ``"doc_to_query"`` (the positive against every
                anchor), ``"doc_to_doc"`` (the positive against every other row's documents).
            partition_mode: ``"joint"`` (one softmax over every selected term; GTE with all four directions) or
                ``"per_direction"`` (one per direction, averaged; not with ``query_to_query`` / ``doc_to_doc``).
            show_progress_bar: tqdm bars over the loss's encoder mini-batches (both passes).
            hardness_mode: hardness weighting of negatives (default none): ``"in_batch_negatives"``,
                ``"hard_negatives"`` or ``"all_negatives"`` add ``hardness_strength * stop_grad(similarity)``
                (not scaled) to those negatives' logits, as sentence-transformers does.
            hardness_strength: the hardness penalty's alpha, non-negative; unused while ``hardness_mode`` is None.
            learnable_scale: learn the scale as CLIP's ``logit_scale = log(scale)``, clamped at ``max_scale``;
                give the trainer ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it.
            max_scale: the clamp of a learned scale (CLIP: 100).
            mask_duplicates: mask false negatives found by equal inputs (token ids, and with images or videos
                their pixels too: the same text with other images is no duplicate), on this process and across
                processes: rows sharing their anchor or their positive are duplicates; a row's negatives lose
                the positives of its duplicates, and any candidate equal to its own positive. With the
                positive -> anchors direction, a positive's negatives lose the anchors of its row's duplicates.
            negative_bank_size: keep the embeddings of this many past candidates per process (and, with the
                ``query_to_query`` or ``doc_to_query`` direction, as many past anchors), without gradient,
                and score them as extra negatives of the next steps (ContAccum-style: the negatives of a
                larger batch for small batches under gradient accumulation); 0 (default): no bank, the loss
                as without it, bit for bit. A step never sees its own rows in the bank; evaluation ignores
                it. The rules: [`negative_bank`][st_cached_losses.losses.negative_bank]; give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it. Not with
                ``mask_duplicates`` (the bank keeps no inputs to compare).
            negative_bank_max_age: drop bank entries added more than this many steps (training calls of the
                loss: micro-batches under gradient accumulation) ago; None (default): the size alone decides.
            in_batch_negatives: score each anchor against every row's candidates (default); False: against
                its own positive and its own hard negatives only (FlagEmbedding's ``no_in_batch_neg_flag``),
                across processes too (nothing is gathered then), e.g. for one dataset of a multi-dataset run
                through a dict of losses. The loss stage is then ``B x K`` logits, no ``B x B`` block. Needs
                hard-negative columns, ``directions=('query_to_doc',)`` and a ``hardness_mode`` other than
                ``"in_batch_negatives"``.

        References:
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983
            - Henderson et al., Efficient Natural Language Response Suggestion for Smart Reply, 2017:
              https://huggingface.co/papers/1705.00652
            - Kim et al., A Gradient Accumulation Method for Dense Retriever under Memory Constraint
              (ContAccum), NeurIPS 2024: https://huggingface.co/papers/2406.12356 (the negative bank)

        Requirements:
            1. (anchor, positive) pairs, optionally with hard-negative columns (anchor, positive, negative_1,
               ..., negative_n).
            2. A model whose inputs have a batch dimension (not StaticEmbedding).

        Inputs:
            | Texts | Labels |
            |---|---|
            | (anchor, positive) pairs | none |
            | (anchor, positive, negative) triplets | none |
            | (anchor, positive, negative_1, ..., negative_n) | none |

        Recommendations:
            - ``batch_sampler=BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.

        Relations:
            - Same loss and gradients as ``sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss``; same role
              as its ``CachedMultipleNegativesRankingLoss``, with a loss stage that is several times faster.
            - [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss] adds the positive -> anchor direction; [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss] never holds
              more than one logit tile.

        Example:
            ```python
            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedMNRLoss

            model = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            loss = CachedMNRLoss(model, mini_batch_size=32)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            scale=scale,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.gather_across_devices = gather_across_devices
        self.similarity_fct = similarity_fct
        # each checked with the other: directions first, then the pair (as sentence-transformers checks them)
        self.directions = directions
        self.partition_mode = partition_mode
        self.hardness_strength = hardness_strength
        self.hardness_mode = hardness_mode
        self.negative_bank = NegativeBank()
        self.mask_duplicates = mask_duplicates
        self.negative_bank_max_age = negative_bank_max_age
        self.negative_bank_size = negative_bank_size
        self.in_batch_negatives = in_batch_negatives
        self._init_learnable_scale(learnable_scale, max_scale)

    def _resolve_similarity(self, old: object, new: Callable[..., Tensor] | str) -> None:
        self._similarity = resolve_similarity(new)

    def _check_directions(self, value: Sequence[str]) -> tuple[str, ...]:
        # at construction, before partition_mode is set: checked as a pair when it is
        directions = check_directions(value, self.partition_mode or "joint", type(self).__name__)
        check_in_batch_negatives(self.in_batch_negatives, directions, self.hardness_mode, type(self).__name__)
        return directions

    def _check_partition_mode(self, value: str) -> str:
        check_directions(self.directions, value, type(self).__name__)
        return value

    def _check_hardness_mode(self, value: str | None) -> str | None:
        check_hardness(value, self.hardness_strength, type(self).__name__)
        check_in_batch_negatives(self.in_batch_negatives, self.directions, value, type(self).__name__)
        return value

    def _check_hardness_strength(self, value: float) -> float:
        check_hardness(self.hardness_mode, value, type(self).__name__)
        return value

    def _check_bank(self, value: int) -> int:
        check_negative_bank(value, self.mask_duplicates, self._in_batch_or_default())
        return value

    def _in_batch_or_default(self) -> bool:
        # read before in_batch_negatives is first set at construction: its default
        return self.__dict__.get("_in_batch_negatives", True)

    def _bank_changed(self, old: object, new: object) -> None:
        self.negative_bank.resize(self.negative_bank_size, self.negative_bank_max_age)

    #: Entries of past steps kept per process and scored as extra negatives; 0: no bank.
    negative_bank_size = Setting[int](validate=_check_bank, after=_bank_changed)
    #: Steps a bank entry may age before it is dropped; None: no limit.
    negative_bank_max_age = Setting[int | None](after=_bank_changed)

    #: What was given: ``cos_sim`` / ``dot_score`` (or ``"cosine"`` / ``"dot"``).
    similarity_fct = Setting[Any](after=_resolve_similarity)
    directions = Setting[tuple[str, ...]](validate=_check_directions)
    partition_mode = Setting[str](validate=_check_partition_mode)
    hardness_mode = Setting[str | None](validate=_check_hardness_mode)
    hardness_strength = Setting[float](validate=_check_hardness_strength)

    @property
    def similarity(self) -> Similarity:
        """The core's similarity: ``"cosine"``, ``"dot"`` (GEMM tiles) or the function itself."""
        return self._similarity

    def _set_symmetric(self, old: bool, new: bool) -> None:
        if new == old:
            return  # e.g. False for four directions: stays four directions
        if new:
            self.directions, self.partition_mode = TWO_DIRECTIONS, "per_direction"
        else:
            self.directions = ONE_DIRECTION

    #: Whether the loss has the positive -> anchors direction too (``directions=('query_to_doc',
    #: 'doc_to_query')``, ``partition_mode='per_direction'``); setting it sets those two settings. A view
    #: of those two, not a setting of its own.
    symmetric = Setting[bool](view=is_symmetric, after=_set_symmetric)

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        extra = ranking_citations(
            self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength
        )
        bank = (CONTACCUM_CITATION,) if self.negative_bank_size else ()
        return "".join(self._citation_parts() + extra + bank)

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' nine keys (same values for the same settings; ``scale`` is the current,
        learned value), then the extras sentence-transformers does not have, where they differ from their
        defaults (a learnable scale with its clamp, and the specs' ``"changed"`` settings).

        A drop-in for theirs: with no extra in use it equals their loss's config for the same settings (their
        tests compare it with ``==``), and every key is an argument of this loss's constructor, so
        ``type(loss)(model, **loss.get_config_dict())`` rebuilds it. (The symmetric loss is said by its
        ``directions`` and ``partition_mode``, as in theirs; no ``symmetric`` key.)"""
        config: dict[str, Any] = {
            "scale": self.scale,
            "similarity_fct": similarity_name(self.similarity),
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "gather_across_devices": self.gather_across_devices,
            "directions": ConfigTuple(self.directions),
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }
        return {**config, **self._changed_settings()}

    # ------------------------------------------------------------------ the loss stage

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        if self.negative_bank_size and torch.is_grad_enabled():  # a training step begins: the bank ages
            self.negative_bank.begin_step()
        # false negatives are recognised by their token ids (embeddings differ under dropout)
        return StepData(keys=[input_keys(f) for f in features] if self.mask_duplicates else None)

    def _loss_stage(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData, with_grad: bool
    ) -> StageOutput:
        """The core's loss stage; with a negative bank, in a training step (``with_grad``), this process's
        bank entries are scored as extra negatives, and then this step's rows join the bank."""
        if not (with_grad and self.negative_bank_size):
            return super()._loss_stage(embeddings, labels, step, with_grad)
        # past anchors are negatives only of the terms that score against the anchors
        with_anchors = bool({"query_to_query", "doc_to_query"} & set(self.directions))
        step.bank = self.negative_bank.view(embeddings[0], with_anchors)
        try:
            out = super()._loss_stage(embeddings, labels, step, with_grad)
        finally:
            step.bank = None
        self.negative_bank.push(embeddings[0], embeddings[1:], with_anchors)
        return out

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        return ranking_terms(
            step,
            n_rows,
            n_columns,
            self.directions,
            self.partition_mode,
            self.hardness_mode,
            self.hardness_strength,
            self.similarity,
            self.in_batch_negatives,
        )

    def _check_columns(self, features: list[dict[str, Any]]) -> None:
        super()._check_columns(features)
        if not self.in_batch_negatives:
            check_own_candidates(len(features), type(self).__name__)
