"""The multiple-negatives ranking loss with GradCache: sentence-transformers' ``MultipleNegativesRankingLoss``
options (the similarity, the directions and their partition, hardness weighting, duplicate masking) and ours
(a learnable scale, a negative bank, each row's own candidates only), its settings a
[`RankingSettings`][st_cached_losses.losses.ranking.RankingSettings] and its stage the package's InfoNCE.
[`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss] and
[`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss] are this loss with other defaults."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.engine.features import batch_size_of
from st_cached_losses.engine.lists import ListColumns, check_list_columns
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.functional.softmax.terms import mnrl_terms
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.learnable_scale import LearnableScale
from st_cached_losses.losses.negative_bank import NegativeBank
from st_cached_losses.losses.ranking import ONE_DIRECTION, RankingSettings
from st_cached_losses.losses.stages.infonce import FalseNegativeCount, InfoNCE

__all__ = ["CachedMNRLoss", "ranking_stage"]

#: why an option cannot take several positives per row, and what to do instead
_POSITIVES_REFUSALS = {
    "directions": "query_to_query is not defined for them. Drop 'query_to_query', or give one positive per row.",
    "partition_mode": (
        "in one joint softmax a positive's row would hold its anchor's candidates and the anchors at once, with no "
        "single target. Use partition_mode='per_direction', or give one positive per row."
    ),
    "negative_bank_size": (
        "the bank is not kept for them yet. Set negative_bank_size=0, or give one positive per row."
    ),
    "mask_duplicates": (
        "duplicates are masked in the anchor -> candidates direction only for them. Drop 'doc_to_query' or "
        "mask_duplicates, or give one positive per row."
    ),
}

#: why an option cannot take lists of hard negatives (each row its own number, every row's a candidate of every
#: anchor, none in a row's own slot of a column), and what to do instead
_LIST_REFUSALS = {
    "hardness_mode": (
        "it weighs a row's own hard negatives apart from the others', and a list's entries hold no row's slot. "
        "Use hardness_mode='all_negatives' (every negative alike) or None, or hard-negative columns of one text "
        "per row."
    ),
    "directions": (
        "doc_to_doc removes every document of a row's own query, and a list's entries hold no row's slot. Drop "
        "'doc_to_doc', or give hard-negative columns of one text per row."
    ),
    "in_batch_negatives": (
        "each row would be scored against its own entries only, and a list's entries hold no row's slot. Set "
        "in_batch_negatives=True, or give hard-negative columns of one text per row."
    ),
}


def list_refusal(settings: RankingSettings, owner: str, several: bool, across: bool) -> str | None:
    """The message refusing a batch with lists (``several``: several positives per row) under ``settings``
    (``across``: gathered across processes), None where they are taken. Nothing is refused for being across
    processes: lists, several positives and their duplicate keys are gathered, or passed around the ring
    (``path="tiled"``), at their own lengths; ``across`` is the stage's signature (other losses read it)."""
    s = settings
    refusals = {
        "hardness_mode": s.hardness_mode in ("hard_negatives", "in_batch_negatives"),
        "directions": "doc_to_doc" in s.directions,
        "in_batch_negatives": not s.in_batch_negatives,
    }
    for name, refused in refusals.items():
        if refused:
            return (
                f"{owner}: {name}={getattr(s, name)!r} cannot take lists of hard negatives (a column of lists, or "
                f"None values): {_LIST_REFUSALS[name]}"
            )
    if not several:
        return None
    refused_several = {
        "directions": "query_to_query" in s.directions,
        "partition_mode": s.partition_mode == "joint" and "doc_to_query" in s.directions,
        "negative_bank_size": bool(s.negative_bank_size),
        "mask_duplicates": s.mask_duplicates and "doc_to_query" in s.directions,
    }
    for name, refused in refused_several.items():
        if refused:
            return (
                f"{owner}: {name}={getattr(s, name)!r} cannot take several positives per row (a positive column "
                f"of lists): {_POSITIVES_REFUSALS[name]}"
            )
    return None


def ranking_stage(
    owner: str,
    settings: RankingSettings,
    bank: NegativeBank | None = None,
    false_negative_count: FalseNegativeCount | None = None,
) -> InfoNCE:
    """The InfoNCE stage of sentence-transformers' ranking options (and ours) in ``settings``; ``bank``: the
    loss's negative bank, used while ``negative_bank_size`` is set; ``false_negative_count``: where the
    false-negative filter's training calls count what it removed."""
    s = settings

    terms = functools.partial(
        mnrl_terms,
        s.directions,
        s.partition_mode,
        s.hardness_mode,
        s.hardness_strength,
        in_batch_negatives=s.in_batch_negatives,
    )
    return InfoNCE(
        owner=owner,
        terms=terms,
        similarity=s.similarity,
        scale=s.scale,
        plan=s.plan(),
        gather=s.gather_across_devices,
        in_batch=s.in_batch_negatives,
        mask_duplicates=s.mask_duplicates,
        bank=bank if s.negative_bank_size else None,
        # past anchors are negatives only of the terms that score against the anchors
        bank_anchors=bool({"query_to_query", "doc_to_query"} & set(s.directions)),
        refuse_lists=functools.partial(list_refusal, s, owner),
        false_negatives=s.false_negatives(),
        false_negative_count=false_negative_count,
    )


class CachedMNRLoss(LearnableScale):
    name = "mnr"
    st_names = ("CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss")
    settings_class = RankingSettings
    citations = (GRADCACHE_CITATION, MNRL_CITATION)

    #: this process's negative bank (``negative_bank_size``): its entries, their ages, its state
    negative_bank: NegativeBank

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
        false_negative_filter: str | None = None,
        false_negative_margin: float | None = None,
        in_batch_negatives: bool = True,
        **engine: Any,
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
        ``tile_size``, ``memory_budget``), keyword-only, each declared once with its meaning on
        [`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result.
        Its settings are one frozen [`RankingSettings`][st_cached_losses.losses.ranking.RankingSettings]
        (``loss.settings``); each is an attribute too, and assigning one replaces them, checked as a whole.

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
            false_negative_filter: remove from a row's negatives every candidate that the model itself rates
                too close to the row's positive (its own similarity, the mask decided without gradient), on
                every candidate source (in-batch, hard-negative columns, lists, other processes, the tiled path
                and the ring, the negative bank): ``"relative"`` (NV-Retriever's TopK-PercPos) above
                ``false_negative_margin`` times the positive's similarity, ``"absolute"`` (Qwen3-Embedding) above
                the positive's similarity plus ``false_negative_margin``. The positive itself always stays, so a
                row whose every negative is removed has a loss of 0. Several positives per row: each positive's
                softmax against that positive. Inside ``MatryoshkaLoss``, each truncation's own similarities
                judge. A candidate whose text equals the row's positive is ``mask_duplicates``'s. The fraction
                removed by the last training step is ``loss.false_negative_fraction`` (logged by
                [`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback]). None (default): no
                filter, the loss as without it, bit for bit.
            false_negative_margin: the filter's margin: ``"relative"`` in ``(0, 1]`` (None: 0.95), ``"absolute"``
                ``>= 0`` (None: 0.1); a candidate rated above the positive is always removed (GIST's rule,
                [`CachedGISTLoss`][st_cached_losses.losses.cached_gist.CachedGISTLoss], with the model as its own
                guide: its ``margin`` is ``1 - margin`` relative, ``-margin`` absolute).
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
            3. For list-valued columns (or None values), the trainer's
               ``data_collator=ListDataCollator(preprocess_fn=model.preprocess)``
               ([`ListDataCollator`][st_cached_losses.config.collator.ListDataCollator]).

        Inputs:
            | Texts | Labels |
            |---|---|
            | (anchor, positive) pairs | none |
            | (anchor, positive, negative) triplets | none |
            | (anchor, positive, negative_1, ..., negative_n) | none |
            | (anchor, positive, negative), a list of negatives per row (or None in negative_k) | none |
            | (anchor, positive[, negative]), a list of one or more positives per row | none |

        Lists: every row's negatives are candidates of every anchor, as a hard-negative column's are; a missing
        one is not a candidate and costs no forward. Each positive of a row is scored against itself and every
        candidate that is not a positive of its row, averaged over the row's positives, then the mean over the
        anchors (the symmetric direction: each positive against the anchors, its row's the target). Options
        that read a row's own hard negatives (``hardness_mode`` ``"hard_negatives"`` / ``"in_batch_negatives"``,
        ``doc_to_doc``, ``in_batch_negatives=False``) are refused with lists. Across processes
        (``gather_across_devices``) every process's lists, positives and duplicate keys are gathered, or passed
        around the ring (``path="tiled"``), at their own lengths.

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
            self.settings_class(
                scale=scale,
                similarity_fct=similarity_fct,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                gather_across_devices=gather_across_devices,
                directions=directions,  # type: ignore[arg-type]  # the check keeps a tuple, refuses a string
                partition_mode=partition_mode,
                show_progress_bar=show_progress_bar,
                hardness_mode=hardness_mode,
                hardness_strength=hardness_strength,
                learnable_scale=learnable_scale,
                max_scale=max_scale,
                mask_duplicates=mask_duplicates,
                negative_bank_size=negative_bank_size,
                negative_bank_max_age=negative_bank_max_age,
                false_negative_filter=false_negative_filter,
                false_negative_margin=false_negative_margin,
                in_batch_negatives=in_batch_negatives,
                **engine,
            ),
        )

    @property
    def false_negative_fraction(self) -> float | None:
        """The fraction of this process's negative candidates that the false-negative filter
        (``false_negative_filter``) removed in the latest training step (every call of it: a MatryoshkaLoss's
        truncations summed): removed / all negative candidates, the positives not counted. None without a
        filter, before the first training step, or where a step had no negative."""
        if self.settings.false_negative_filter is None:
            return None
        return self.__dict__["_false_negative_count"].fraction

    def _settings_changed(self, old: Any, new: Any) -> None:
        if "_false_negative_count" not in self.__dict__:
            self.__dict__["_false_negative_count"] = FalseNegativeCount()
        if "negative_bank" not in self._modules:
            self.negative_bank = NegativeBank()
        self.negative_bank.resize(new.negative_bank_size, new.negative_bank_max_age)
        super()._settings_changed(old, new)

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Lists: the anchors one text per row, the positives one or more per row, each other column its texts
        of every row (each row's count of them), and no option that reads a row's own hard negatives."""
        s, owner = self.settings, type(self).__name__
        check_list_columns([batch_size_of(f) for f in features], lists, owner)
        positives = lists.counts[1]
        across = s.gather_across_devices and is_distributed()
        # across processes the settings are checked once every process knows whether any has lists (the stage)
        message = None if across else list_refusal(s, owner, positives is not None, False)
        if message:
            raise ValueError(message)

    def build_stage(self) -> InfoNCE:
        return ranking_stage(
            type(self).__name__, self.settings, self.negative_bank, self.__dict__["_false_negative_count"]
        )
