"""GISTEmbed's guided in-batch negatives with GradCache: the InfoNCE stage with GIST's guided terms, the guide a
frozen model or (self-guided) the step's own embeddings."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from torch import nn

from st_cached_losses.engine.features import batch_size_of, unwrap_model
from st_cached_losses.engine.lists import ListColumns, check_list_columns
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.functional.softmax.terms import gist_terms
from st_cached_losses.losses.citations import GIST_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.learnable_scale import LearnableScale
from st_cached_losses.losses.ranking import RankingSettings
from st_cached_losses.losses.settings import (
    LearnableScaleSettings,
    LossStageSettings,
    SharedSettings,
    check_bool,
    check_finite,
    check_max_scale,
    check_scale,
    redefault,
    setting,
    view,
)
from st_cached_losses.losses.stages.infonce import SELF_GUIDED, GuideModel, InfoNCE

__all__ = ["CachedGISTLoss", "GISTSettings", "gist_list_refusal"]

_NO_TOKENIZER = "Both the training model and the guiding model must have a tokenizer attribute."


def _guide(name: str, value: Any) -> Any:
    if value is not None and not hasattr(value, "tokenizer"):
        raise ValueError(_NO_TOKENIZER)
    return value


def _margin_strategy(name: str, value: Any) -> str:
    if value not in ("absolute", "relative"):
        raise ValueError(f"{name} must be 'absolute' or 'relative', got {value!r}.")
    return str(value)


#: why GIST takes one positive per row (a positive column of lists is refused with it)
ONE_POSITIVE = (
    "GIST's guide rates each row's negatives against the row's one positive (the row's threshold), and its "
    "anchor-anchor and positive-positive blocks hold one positive per row. Give one positive per row (one row per "
    "(anchor, positive) pair; the guide then removes a row's other positives only where it rates them above the "
    "pair's positive), or use CachedMNRLoss / CachedCLIPLoss with false_negative_filter (GIST's rule with the "
    "model as its own guide), which take several positives per row."
)


def gist_list_refusal(settings: GISTSettings, owner: str, several: bool, across: bool) -> str | None:
    """The message refusing a batch with lists (``several``: several positives per row) under GIST's
    ``settings`` (``across``: gathered across processes), None where they are taken: lists of hard negatives,
    every row's entries candidates of every anchor, rated by the guide as a hard-negative column's are."""
    lists = "cannot take lists of hard negatives (a column of lists, or None values)"
    if not settings.in_batch_negatives:
        return (
            f"{owner}: in_batch_negatives=False {lists}: each row would be scored against its own entries only, "
            "and a list's entries hold no row's slot. Set in_batch_negatives=True, or give hard-negative columns "
            "of one text per row."
        )
    if across and settings.path == "tiled":
        return (
            f"{owner}: path='tiled' {lists} across processes: the tiled path passes candidate blocks around a "
            "ring, and lists are gathered, not passed around yet. Use path='auto' or 'chunked', or give "
            "hard-negative columns of one text per row."
        )
    if several:
        return f"{owner} takes one positive per row: the positive column holds lists. {ONE_POSITIVE}"
    return None


@dataclass(frozen=True, kw_only=True)
class GISTSettings(LossStageSettings):
    """[`CachedGISTLoss`][st_cached_losses.losses.cached_gist.CachedGISTLoss]'s settings: sentence-transformers'
    ``CachedGISTEmbedLoss`` arguments (its ``temperature``: ``scale`` is a view of it) and ours."""

    owner: ClassVar[str] = "CachedGISTLoss"
    #: sentence-transformers' ``CachedGISTEmbedLoss`` keys, in their order (the current, learned temperature)
    config_keys: ClassVar[tuple[str, ...]] = (
        "guide",
        "temperature",
        "mini_batch_size",
        "mini_batch_num_tokens",
        "margin_strategy",
        "margin",
        "contrast_anchors",
        "contrast_positives",
        "gather_across_devices",
    )

    guide: nn.Module | None = setting(
        None,
        doc="The guide SentenceTransformer rating the pairs (frozen, never trained), or None: self-guided, the "
        "model's own embeddings of the step rate the pairs (no guide model, no extra forward).",
        check=_guide,
        config="always",
        module=True,
    )
    temperature: float = setting(
        0.01,
        doc="The temperature of the InfoNCE softmax: 1 / scale (GISTEmbedLoss's 0.01).",
        check=check_scale,
        config="always",
    )
    margin_strategy: str = setting(
        "absolute",
        doc="'absolute' or 'relative' margin for removing negatives the guide rates high.",
        check=_margin_strategy,
        config="always",
    )
    margin: float = setting(
        0.0,
        doc="The margin of margin_strategy (0: remove only negatives rated above the positive; -0.1 absolute is "
        "Qwen3-Embedding's rule).",
        check=check_finite,
        config="always",
    )
    contrast_anchors: bool = setting(
        True, doc="Contrast each anchor with the other anchors.", check=check_bool, config="always"
    )
    contrast_positives: bool = setting(
        True, doc="Contrast each positive with the other positives.", check=check_bool, config="always"
    )
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False)
    learnable_scale: bool = redefault(LearnableScaleSettings, "learnable_scale", False)
    max_scale: float = redefault(LearnableScaleSettings, "max_scale", 100.0)
    in_batch_negatives: bool = redefault(RankingSettings, "in_batch_negatives", True)

    @view
    def scale(self) -> float:
        """The scale of the InfoNCE softmax, ``1 / temperature``; setting it sets the temperature."""
        return 1.0 / self.temperature

    @scale.changes
    def _(self, value: Any) -> dict[str, Any]:
        if value == self.scale:
            return {}  # unchanged: 1 / (1 / t) may round
        return {"temperature": 1.0 / check_scale("scale", value)}

    def validate(self) -> None:
        super().validate()
        if self.learnable_scale:
            check_max_scale(self.max_scale, self.scale)
        guide = self.guide
        if guide is not None and self.gather_across_devices:
            size = getattr(guide, "get_embedding_dimension", None) or getattr(
                guide, "get_sentence_embedding_dimension", None
            )
            dim = size() if size is not None else None
            if not isinstance(dim, int):
                raise ValueError(
                    "guide: with gather_across_devices=True every process's guide embeddings are gathered into one "
                    "matrix, so the guide must declare its embedding size (get_embedding_dimension() returned "
                    f"{dim!r}); end the guide with a Pooling (or Dense) module, or set gather_across_devices=False."
                )

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """Self-guidance (their GIST losses need a guide model), a learned temperature, each row's own
        candidates only: none is an option of sentence-transformers' ``GISTEmbedLoss``."""
        ours = (
            ("guide", self.guide is None),
            ("learnable_scale", self.learnable_scale),
            ("in_batch_negatives", not self.in_batch_negatives),
        )
        return (*super().beyond_sentence_transformers(), *(name for name, used in ours if used))

    #: a learnable scale's entries, as the ranking losses write them
    learned_config = LearnableScaleSettings.learned_config


class CachedGISTLoss(LearnableScale):
    name = "gist"
    st_names = ("CachedGISTEmbedLoss", "GISTEmbedLoss")
    settings_class = GISTSettings
    citations = (GRADCACHE_CITATION, GIST_CITATION)
    equivalent_st_loss = "CachedGISTEmbedLoss"

    #: whether the guide reads the texts re-tokenised (another vocabulary, or it reads fewer tokens), decided
    #: whenever the guide is set
    must_retokenize: bool

    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module | None = None,
        temperature: float = 0.01,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        show_progress_bar: bool = False,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        in_batch_negatives: bool = True,
        **engine: Any,
    ) -> None:
        """
        GISTEmbed's guided in-batch negatives with GradCache: a frozen guide model removes the in-batch
        negatives it rates above the positive (likely false negatives), exactly as sentence-transformers'
        ``GISTEmbedLoss``, for batches of thousands in the memory of one encoder mini-batch. Without a guide
        (``guide=None``) the model guides itself with its own embeddings of the step, at no extra cost.

        The guide embeds each column once per step, mini-batch by mini-batch and without a graph (re-tokenising
        the texts when its tokenizer differs from the model's: then a column with images, videos or audio is
        refused, the decoded text having none of them); it is never replayed nor trained. Its mask is
        computed tile by tile next to the logits, never as a ``B x C`` matrix; across processes the guide's
        embeddings of the candidates are gathered (or travel around the ring) with the model's.

        The constructor takes sentence-transformers' ``CachedGISTEmbedLoss`` arguments in its positional order,
        then our extras, keyword-only. Every argument is also a property, read and assigned between steps
        (``guide`` too: a new guide is checked as at construction and ``must_retokenize`` is decided again);
        ``scale`` (``1 / temperature``) and ``learnable_scale`` / ``max_scale`` (CLIP's learned, clamped
        ``log(scale)``, as on ``CachedMNRLoss``) as well. It has only the settings GIST uses: not
        ``directions``, ``partition_mode``, ``symmetric``, ``similarity_fct``, ``hardness_mode``,
        ``hardness_strength`` nor ``mask_duplicates`` (the guide, not these, decides which negatives count).

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan (``path``,
        ``tile_size``, ``memory_budget``), keyword-only, each declared once on
        [`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result. Its
        settings are a [`GISTSettings`][st_cached_losses.losses.cached_gist.GISTSettings].

        Args:
            model: the SentenceTransformer to train.
            guide: a SentenceTransformer rating the pairs (any embedding size; cosine similarity), or None
                (default): self-guided, the model rates the pairs with its own embeddings of this step (the
                engine's first pass, detached: no guide model, no extra forward), so the mask follows the
                model as it trains; the same loss as ``GISTEmbedLoss`` with a frozen copy of the model, taken
                at this step, as the guide (on a model without dropout; with dropout, the mask is that of the
                step's own forward); inside ``MatryoshkaLoss`` every width is guided by the full-width
                embeddings, as that frozen copy guides it. The model itself is accepted too (as in sentence-transformers): then it
                embeds the batch once more without a graph, in the mode the model is in (as theirs: no
                ``eval()``).
            temperature: divides the cosine similarities (``scale = 1 / temperature``).
            mini_batch_size: rows per encoder forward (the model's and the guide's), or ``"auto"``.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per mini-batch instead of
                ``mini_batch_size``, as sentence-transformers.
            show_progress_bar: tqdm bars over the mini-batches.
            margin_strategy: ``"absolute"``: remove a negative whose guide similarity exceeds the positive's
                minus ``margin``; ``"relative"``: exceeds the positive's minus ``|positive's| * margin``.
            margin: the margin of that rule (0: remove only negatives rated above the positive). Negative
                margins keep negatives rated a little above the positive: ``margin=-0.1`` (absolute) is
                Qwen3-Embedding's rule, a negative is masked when it scores more than 0.1 above the positive.
            contrast_anchors: also contrast each anchor with this process's other anchors.
            contrast_positives: also contrast each positive with every other positive.
            gather_across_devices: score each process's anchors against every process's positives and
                negatives (the guide's embeddings of them are gathered too).
            learnable_scale: learn the scale as CLIP's ``logit_scale = log(scale)``, clamped at ``max_scale``
                (sentence-transformers' GIST losses have a fixed temperature); give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it.
            max_scale: the clamp of a learned scale.
            in_batch_negatives: contrast with the other rows' candidates (default); False: each anchor against
                its own positive and its own hard negatives only, those the guide rates above the positive
                removed (GIST's filter of mined hard negatives), across processes too (nothing is gathered).
                ``contrast_anchors`` / ``contrast_positives`` contrast other rows, so they do not apply then.
                Needs hard-negative columns.

        References:
            - Solatorio, GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding
              Fine-tuning, 2024: https://huggingface.co/papers/2402.16829
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Relations:
            - Equals ``sentence_transformers.sentence_transformer.losses.GISTEmbedLoss`` (and ``CachedGISTEmbedLoss``) with the same
              arguments, on one process and with ``gather_across_devices``.

        Inputs:
            (anchor, positive) pairs or (anchor, positive, negative, ...) columns; no labels. A ``negative``
            column of lists (or ``negative_k`` columns with None), with the trainer's
            ``data_collator=ListDataCollator(preprocess_fn=model.preprocess)``: every row's negatives are
            candidates of every anchor, the guide embeds the same texts and rates them against each row's
            positive; one positive per row (a positive column of lists is refused).
        """
        if not hasattr(model, "tokenizer"):
            raise ValueError(_NO_TOKENIZER)
        # kept from construction (before the settings, which decide must_retokenize with it): the trainer later
        # puts a DDP / FSDP wrapper, without a tokenizer, in .model
        self._model_tokenizer = cast(Any, model).tokenizer
        super().__init__(
            model,
            GISTSettings(
                guide=guide,
                temperature=temperature,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                show_progress_bar=show_progress_bar,
                margin_strategy=margin_strategy,
                margin=margin,
                contrast_anchors=contrast_anchors,
                contrast_positives=contrast_positives,
                gather_across_devices=gather_across_devices,
                learnable_scale=learnable_scale,
                max_scale=max_scale,
                in_batch_negatives=in_batch_negatives,
                **engine,
            ),
        )

    @property
    def self_guided(self) -> bool:
        """Whether the model guides itself (``guide=None``): the mask is computed from the embeddings of the
        engine's first pass, the very ones the loss is computed from (detached), with no guide model and no
        extra forward."""
        return self.settings.guide is None

    def _settings_changed(self, old: Any, new: Any) -> None:
        self.must_retokenize = new.guide is not None and self._must_retokenize(new.guide)
        super()._settings_changed(old, new)

    def _must_retokenize(self, guide: nn.Module) -> bool:
        """sentence-transformers' rule: another vocabulary, or a guide that reads fewer tokens than the model."""
        # the trainer may have wrapped the model by now
        return GuideModel.must_retokenize(guide, unwrap_model(self.model), self._model_tokenizer)

    def build_stage(self) -> InfoNCE:
        s = self.settings

        terms = functools.partial(
            gist_terms,
            s.contrast_anchors,
            s.contrast_positives,
            margin_strategy=s.margin_strategy,
            margin=s.margin,
            in_batch_negatives=s.in_batch_negatives,
        )
        guide = (
            SELF_GUIDED
            if s.guide is None
            else GuideModel(s.guide, self.must_retokenize, self._model_tokenizer)
        )
        return InfoNCE(
            owner=type(self).__name__,
            terms=terms,
            similarity="cosine",
            scale=s.scale,
            plan=s.plan(),
            gather=s.gather_across_devices,
            in_batch=s.in_batch_negatives,
            guide=guide,
            refuse_lists=functools.partial(gist_list_refusal, s, type(self).__name__),
        )

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Lists of hard negatives (the guide embeds the same existing texts, its thresholds from each row's
        one positive); one positive per row; the guide's media check as for fixed columns."""
        owner = type(self).__name__
        across = self.settings.gather_across_devices and is_distributed()
        # across processes the settings (and several positives) are refused once every process knows whether
        # any has lists (the stage), so that every process raises
        one_positive = None if across else ONE_POSITIVE
        check_list_columns([batch_size_of(f) for f in features], lists, owner, one_positive=one_positive)
        message = None if across else gist_list_refusal(self.settings, owner, False, False)
        if message:
            raise ValueError(message)
        guide = getattr(self.stage, "guide", None)
        if isinstance(guide, GuideModel):
            guide.check(features, owner)
