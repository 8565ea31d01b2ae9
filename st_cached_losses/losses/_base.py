"""The core every cached embedding loss is built on: the model, the GradCache engine and its settings, the
scale, the forward (evaluation without a graph, or the engine's three stages) and the loss stage (one
process, gathered across processes, or by ring exchange, through ``st_cached_losses.functional.parallel``).

What only some losses have is theirs: the learnable scale is the [`LearnableScale`][st_cached_losses.losses._base.LearnableScale] mixin (MNR, CLIP,
tiled, GIST), the terms of sentence-transformers' ranking options live on [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss], the
regularisers on [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss]. A setting is one constructor parameter and one spec
(``settings.py``), checked on every assignment.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from st_cached_losses.engine.checks import check_mini_batch_num_tokens, check_mini_batch_size
from st_cached_losses.engine.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.functional import LossPath, infonce, scale_value
from st_cached_losses.functional.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional.parallel import (
    agree_on_sizes,
    gathered_infonce,
    loss_and_grad,
    mean_scale_grad,
)
from st_cached_losses.losses.callbacks import warn_if_scale_unsaved
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.guards import check_model_kind, foreign_setting_owners
from st_cached_losses.losses.settings import SPECS, Setting, check_bool, check_max_scale

__all__ = [
    "CachedInfoNCEBase",
    "EngineSettings",
    "LearnableScale",
    "StepData",
    "check_columns",
    "check_splittable_model",
]


@dataclass
class StepData:
    """What one call of a loss hands its loss stage besides the embeddings, built by ``forward`` from the
    features (never kept on the loss): [`CachedInfoNCEBase.calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss] reads it from its ``step``
    argument, so that a wrapper decorating ``calculate_loss`` (MatryoshkaLoss) passes it through."""

    #: per column, the inputs' hashes (``mask_duplicates``)
    keys: list[Tensor] | None = None
    #: per column, the guide's embeddings of the same rows (CachedGISTLoss)
    guide: list[Tensor] | None = None
    #: in GradCache's stage 2, a leaf standing for the learnable scale (its gradient is read off it)
    scale_leaf: Tensor | None = None


class EngineSettings:
    """The settings a loss keeps on its GradCache engine (``loss.cache``): the encoder mini-batches (rows, a
    token budget, or ``"auto"`` sized to a memory budget) and how they are run. None changes the result.
    Shared by every cached loss, the reranker loss included; a change of the mini-batch sizes forgets what
    ``"auto"`` chose, so the next step sizes them again."""

    cache: GradCache
    #: the sentence-transformers model class (by name) the loss trains; another kind is refused at construction
    model_kind: ClassVar[str]

    show_progress_bar = Setting[bool](on_engine=True)
    sort_by_length = Setting[bool](on_engine=True)
    reuse_last_graph = Setting[bool](on_engine=True)
    keep_params_unsharded = Setting[bool](on_engine=True)
    graph_memory_budget = Setting[int | None](on_engine=True)

    def __setattr__(self, name: str, value: Any) -> None:
        # a setting that only another cached loss has would be kept as a plain attribute and ignored: refuse it
        if owners := foreign_setting_owners(self, name, EngineSettings):
            raise ValueError(
                f"{type(self).__name__} has no setting {name!r}: it is a setting of {', '.join(owners)}; build "
                "that loss to use it."
            )
        super().__setattr__(name, value)

    def _init_engine(
        self,
        cache: GradCache,
        *,
        mini_batch_memory_budget: int | str | None,
        show_progress_bar: bool,
        sort_by_length: bool,
        reuse_last_graph: bool,
        keep_params_unsharded: bool,
        graph_memory_budget: int | str | None,
    ) -> None:
        """Keep ``cache`` as the loss's engine and set its settings, each checked by its spec."""
        self.cache = cache
        self.mini_batch_memory_budget = mini_batch_memory_budget
        self.show_progress_bar = show_progress_bar
        self.sort_by_length = sort_by_length
        self.reuse_last_graph = reuse_last_graph
        self.keep_params_unsharded = keep_params_unsharded
        self.graph_memory_budget = graph_memory_budget

    @property
    def mini_batch_size(self) -> int | str:
        """Rows per encoder mini-batch, or ``"auto"``: the largest that fits ``mini_batch_memory_budget``,
        sized at the first step and again for longer rows (what it chose: ``loss.cache.auto_size``)."""
        return self.cache.mini_batch_size

    @mini_batch_size.setter
    def mini_batch_size(self, value: int | str) -> None:
        check_mini_batch_size(value)
        if value != self.cache.mini_batch_size:
            self.cache.auto_size = None  # sized again at the next step if "auto"
        self.cache.mini_batch_size = value

    @property
    def mini_batch_num_tokens(self) -> int | str | None:
        """The budget of real tokens per mini-batch, or None (``mini_batch_size`` rows per mini-batch)."""
        return self.cache.mini_batch_num_tokens

    @mini_batch_num_tokens.setter
    def mini_batch_num_tokens(self, value: int | str | None) -> None:
        check_mini_batch_num_tokens(value)
        if value != self.cache.mini_batch_num_tokens:
            self.cache.auto_size = None
        self.cache.mini_batch_num_tokens = value

    @property
    def mini_batch_memory_budget(self) -> int | None:
        """Bytes of activations one encoder mini-batch may take, for ``mini_batch_size="auto"`` (or
        ``mini_batch_num_tokens="auto"``); set in bytes or as a size such as ``"2GB"``."""
        return self.cache.mini_batch_memory_budget

    @mini_batch_memory_budget.setter
    def mini_batch_memory_budget(self, value: int | str | None) -> None:
        parsed = SPECS["mini_batch_memory_budget"].check("mini_batch_memory_budget", value)
        if parsed != self.cache.mini_batch_memory_budget:
            self.cache.auto_size = None
        self.cache.mini_batch_memory_budget = parsed


class CachedInfoNCEBase(EngineSettings, nn.Module):
    """The core of the cached embedding losses ([`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss], [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss],
    [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss], [`CachedGISTLoss`][st_cached_losses.losses.cached_gist.CachedGISTLoss], [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss],
    [`CachedMultiVectorLoss`][st_cached_losses.losses.cached_multi_vector.CachedMultiVectorLoss]): the engine, a fixed scale, the forward and the loss stage. A loss
    supplies its terms (`_loss_terms`), its config (``get_config_dict``), its citations, and sets
    ``gather_across_devices`` (the sparse loss keeps it on its base loss).
    """

    #: BibTeX entries of the model card's citation
    _citations: tuple[str, ...] = (GRADCACHE_CITATION,)
    #: The sentence-transformers loss this one equals (the same loss and gradients for the same options),
    #: named in the model card's tags next to ``loss:<our class>``.
    equivalent_st_loss = "CachedMultipleNegativesRankingLoss"
    #: Tells sentence-transformers' MatryoshkaLoss (and AdaptiveLayerLoss) that this loss back-propagates
    #: by replaying the encoder: Matryoshka then decorates [`calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss] instead of the model.
    uses_gradient_cache = True
    model_kind: ClassVar[str] = "SentenceTransformer"

    gather_across_devices = Setting[bool]()
    path = Setting[LossPath]()
    tile_size = Setting[int | None]()
    memory_budget = Setting[int]()

    def __setattr__(self, name: str, value: Any) -> None:
        # a setting (a property or Setting of the class) receives every value assigned to it: nn.Module would
        # file a module value (a similarity module, a guide) under _modules before the setter could check it
        if isinstance(getattr(type(self), name, None), (property, Setting)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        model: nn.Module,
        *,
        scale: float,
        mini_batch_size: int | str,
        mini_batch_num_tokens: int | str | None,
        mini_batch_memory_budget: int | str | None,
        show_progress_bar: bool,
        sort_by_length: bool,
        reuse_last_graph: bool,
        keep_params_unsharded: bool,
        graph_memory_budget: int | str | None,
        path: LossPath,
        tile_size: int | None,
        memory_budget: int | str,
    ) -> None:
        super().__init__()
        check_model_kind(model, type(self), EngineSettings)
        check_splittable_model(model, type(self).__name__)
        self.model = model
        self._init_engine(
            GradCache(mini_batch_size=mini_batch_size, mini_batch_num_tokens=mini_batch_num_tokens),
            mini_batch_memory_budget=mini_batch_memory_budget,
            show_progress_bar=show_progress_bar,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            keep_params_unsharded=keep_params_unsharded,
            graph_memory_budget=graph_memory_budget,
        )
        self.path = path
        self.tile_size = tile_size
        self.memory_budget = memory_budget
        self._scale = scale_value(scale)
        self._warned_caching_off = False
        self._tagged = False

    # ------------------------------------------------------------------ the scale

    @property
    def scale(self) -> float:
        """The scale (1 / temperature) the similarities are multiplied by."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = scale_value(value)

    @property
    def temperature(self) -> float:
        """``1 / scale``."""
        return 1.0 / self.scale

    @temperature.setter
    def temperature(self, value: float) -> None:
        temperature = scale_value(value, name="temperature")
        if temperature != self.temperature:  # else unchanged: 1 / (1 / s) may round
            self.scale = 1.0 / temperature

    def scale_tensor(self) -> Tensor | float:
        """The scale the loss stage multiplies by: a float, or ([`LearnableScale`][st_cached_losses.losses._base.LearnableScale]) a tensor with its graph."""
        return self.scale

    # ------------------------------------------------------------------ model card

    def _citation_parts(self) -> tuple[str, ...]:
        return self._citations

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        return "".join(self._citation_parts())

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card: its sentence-transformers counterpart's keys, then our
        extras in use (each loss writes its own)."""
        raise NotImplementedError

    def _changed_settings(self) -> dict[str, Any]:
        """The extras of the config: a learnable scale and its clamp, and each ``"changed"`` setting of this
        loss that differs from its default. A setting assigned after construction to a loss whose constructor
        lacks it is listed too: the config says how the model was
        trained, even where ``type(loss)(model, **config)`` cannot rebuild that loss."""
        extras: dict[str, Any] = {}
        if getattr(self, "learnable_scale", False):
            extras.update(learnable_scale=True, max_scale=self.max_scale)
        for name, spec in SPECS.items():
            if spec.config == "changed" and isinstance(getattr(type(self), name, None), Setting):
                value = getattr(self, name)
                if value != spec.default:
                    extras[name] = value
        return extras

    def _tag_model_card(self) -> None:
        """Once per loss: tag the model's card with this library and the loss this one equals."""
        card = getattr(self.model, "model_card_data", None)
        if self._tagged or card is None or not hasattr(card, "add_tags"):
            return
        card.add_tags(["st_cached_losses", f"equivalent-loss:{self.equivalent_st_loss}"])
        self._tagged = True

    # ------------------------------------------------------------------ the loss stage

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> dict[str, Any]:
        """The core's options that say which loss it computes (``terms``, ``similarity``, a guide, duplicate
        keys): the loss's own; ``n_columns``: candidate columns (positives and hard negatives) of this step."""
        raise NotImplementedError

    def _core_kwargs(self, step: StepData, n_rows: int, n_columns: int) -> dict[str, Any]:
        """The core's options: the loss stage's plan and the loss's terms."""
        return {
            "path": self.path,
            "tile_size": self.tile_size,
            "memory_budget": self.memory_budget,
            **self._loss_terms(step, n_rows, n_columns),
        }

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        """What this call's loss stage needs from the features besides the embeddings (a loss adds its own)."""
        return StepData()

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: StepData | None = None,
    ) -> Tensor:
        """The loss of already computed embeddings (sentence-transformers' cached-loss interface).

        Args:
            reps: per column (anchors, positives, hard negatives...), a list of ``(m_j, d)`` pieces that
                concatenate to the column's ``(B, d)`` embeddings in row order.
            labels: unused (the positive of row ``i`` is row ``i`` of the second column).
            with_backward: also put the gradient of the loss in each piece's ``.grad`` (the pieces must
                be leaves that require grad) and return the loss without a graph to the embeddings. (With
                a learnable scale, the returned loss keeps a graph to the scale that carries exactly the
                scale's gradient: to ``step.scale_leaf`` inside GradCache's stage 2, to ``logit_scale``
                when called directly; a wrapper that weighs and sums several calls, like MatryoshkaLoss,
                thus weighs the scale's gradient too.) Without it the loss is returned with autograd (or
                without a graph under ``torch.no_grad``).
            step: what the call of the loss on these rows' features prepared ([`StepData`][st_cached_losses.losses._base.StepData]); None,
                called directly: no duplicate masks (they need the inputs).

        With ``gather_across_devices``, each process returns its share of the global loss (see
        ``st_cached_losses.functional.parallel``): DDP's gradient average is the full batch's gradient.
        """
        embeddings = [torch.cat(r) if len(r) > 1 else r[0] for r in reps]
        step = step if step is not None else StepData()
        if self.gather_across_devices and not is_distributed():
            warn_no_process_group_once(type(self).__name__)
        # also the finiteness check, agreed on by every process
        sizes = agree_on_sizes(embeddings, self.gather_across_devices)
        scale = self.scale_tensor()
        kwargs = self._core_kwargs(step, len(embeddings[0]), len(embeddings) - 1)
        if not with_backward and torch.is_grad_enabled():  # a caller asking for autograd, not the cache
            if sizes is None:
                if isinstance(scale, Tensor) and scale.requires_grad and is_distributed():
                    # each process's own rows: average the scale's gradient as DDP averages the model's
                    scale.register_hook(mean_scale_grad)
                return infonce(embeddings[0], embeddings[1:], scale=scale, check_finite=False, **kwargs)
            embeddings = self._gatherable(embeddings)  # (loss_and_grad pads packed rows itself)
            return gathered_infonce(embeddings[0], embeddings[1:], sizes, scale=scale, **kwargs)
        # the scale whose gradient the core computes: stage 2's leaf, or the scale itself called directly
        if isinstance(scale, Tensor):
            scale = step.scale_leaf if step.scale_leaf is not None else scale
        ring = self.path == "tiled"
        out = loss_and_grad(
            embeddings[0], embeddings[1:], sizes, ring=ring, with_grad=with_backward, scale=scale, **kwargs
        )
        if not with_backward:
            return out.loss
        assert out.grad_anchors is not None  # asked for
        grads = [out.grad_anchors, *out.grad_candidates]
        for pieces, grad in zip(reps, grads):
            for piece, g in zip(pieces, grad.split([p.shape[0] for p in pieces])):
                if g.dim() == 3:  # token rows: the column's width, a mini-batch's own may be narrower
                    g = g[:, : piece.shape[1]]
                g = g.to(piece.dtype)
                piece.grad = g if piece.grad is None else piece.grad + g
        loss = out.loss.detach()
        if out.grad_scale is not None:
            grad_scale: Tensor | None = out.grad_scale
            if sizes is None:
                # each process scored only its own rows, and the scale belongs to the loss, outside any
                # wrapper: average its gradient as DDP / FSDP / DeepSpeed average the model's, or every
                # process would step to another scale (the gathered and ring paths average it themselves)
                grad_scale = mean_scale_grad(grad_scale)
            # the value of the loss, with d/d(leaf) = the scale's gradient: a caller's weights reach it
            assert grad_scale is not None and isinstance(scale, Tensor)  # averaged, not dropped
            loss = loss + (scale - scale.detach()) * grad_scale.detach().to(scale.dtype)
        return loss

    def _gatherable(self, embeddings: list[Tensor]) -> list[Tensor]:
        """The embeddings as every process gathers them with autograd (the multi-vector loss pads token
        rows; the cached path's ``loss_and_grad`` pads packed rows itself)."""
        return embeddings

    def _stage2(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData | None = None
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """GradCache's stage 2 through [`calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss], so that a wrapper that decorates it works."""
        reps = [[e.detach().requires_grad_()] for e in embeddings]
        scale = self.scale_tensor()
        step = step if step is not None else StepData()
        step.scale_leaf = scale.detach().requires_grad_() if isinstance(scale, Tensor) else None
        loss = self.calculate_loss(reps, labels, with_backward=True, step=step)
        scale_grad = None
        if step.scale_leaf is not None and loss.requires_grad:
            # through whatever a wrapper did with the returned losses (e.g. Matryoshka's weights)
            (scale_grad,) = torch.autograd.grad(loss, step.scale_leaf)
        grads = [r[0].grad if r[0].grad is not None else torch.zeros_like(r[0]) for r in reps]
        return loss.detach(), grads, [scale_grad]

    def _warn_if_caching_off(self, features: list[dict[str, Any]]) -> None:
        """Once per loss: a batch that fits in one mini-batch saves no memory (configured without
        CachedLossTrainingArguments, which warns at construction, nothing else would say so)."""
        if self._warned_caching_off or not self.cache.fits_in_one(features):
            return
        self._warned_caching_off = True
        warnings.warn(
            f"{type(self).__name__}: every column of this batch ({batch_size_of(features[0])} rows) fits in one "
            f"encoder mini-batch (mini_batch_size={self.mini_batch_size}), so caching saves no memory: the same "
            "result and memory as the non-cached loss. Use a mini_batch_size smaller than the batch.",
            stacklevel=5,  # past this method, forward and nn.Module's call machinery: the caller's line
        )

    def forward(self, sentence_features: Iterable[dict[str, Any]], labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        self._tag_model_card()
        try:
            check_columns(features, type(self).__name__)
        except ValueError as exc:  # the other processes are about to wait for this one: tell them
            self.cache.raise_on_every_process(self.model, exc)
        if getattr(self, "learnable_scale", False) and torch.is_grad_enabled():
            # the stock trainer saves only the model: say so once if no LossStateCallback saves the scale
            warn_if_scale_unsaved(self)
        step = self._step_data(features)
        if not torch.is_grad_enabled():
            # evaluation: the same loss, mini-batched, no caching and no graph
            embeddings = self.cache.embed(self.model, features)
            return self.calculate_loss([[e] for e in embeddings], labels, step=step)
        self._warn_if_caching_off(features)
        scale = self.scale_tensor()
        extra = [scale] if isinstance(scale, Tensor) else []
        return self.cache.step(self.model, features, lambda e: self._stage2(e, labels, step), extra=extra)


def check_splittable_model(model: nn.Module, owner: str) -> None:
    """Refuse a StaticEmbedding model: its inputs (flat token ids with offsets) have no batch dimension
    to cut into mini-batches."""
    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:  # pragma: no cover - layout of other versions
        return
    if any(isinstance(m, StaticEmbedding) for m in unwrap_model(model).modules()):
        raise ValueError(
            f"{owner} is not compatible with a SentenceTransformer model based on a StaticEmbedding: its inputs "
            "(flat token ids with offsets, no batch dimension) cannot be split into mini-batches. Use "
            "sentence-transformers' MultipleNegativesRankingLoss, which is cheap for such models."
        )


def check_columns(sentence_features: Sequence[dict[str, Any]], owner: str) -> None:
    """At least (anchor, positive), every column splittable, and the same number of rows in each."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{owner} needs at least two text columns, (anchor, positive[, negatives...]); got "
            f"{len(sentence_features)}. Check the dataset's columns (a 'label'/'score' column is not a text column)."
        )
    sizes = []
    for features in sentence_features:
        check_splittable(features)
        sizes.append(batch_size_of(features))
    if len(set(sizes)) > 1:
        raise ValueError(
            f"all columns must have the same number of rows, got {sizes}: every anchor needs one positive (and "
            "one row in each hard-negative column)."
        )
    if sizes[0] == 0:
        raise ValueError(
            f"{owner} got an empty batch: column 0 (the anchors) of this batch has 0 rows (rows per column: "
            f"{sizes}). Every step needs at least one (anchor, positive) pair on every process; check the "
            "sampler or the dataset split that produced this batch (e.g. drop_last, or fewer rows than processes)."
        )


class LearnableScale(CachedInfoNCEBase):
    """The scale learned as CLIP's ``logit_scale = log(scale)`` parameter, clamped at ``max_scale``, for the
    losses that offer it (``learnable_scale`` in their constructor): MNR, CLIP, tiled and GIST."""

    logit_scale: nn.Parameter
    _learnable_scale: bool = False
    _max_scale: float = 100.0

    def _init_learnable_scale(self, learnable_scale: bool, max_scale: float) -> None:
        self.max_scale = max_scale
        self.learnable_scale = learnable_scale

    @property
    def scale(self) -> float:
        """The current scale (1 / temperature), as a float; the learned value when learnable."""
        if self.learnable_scale:
            return float(self.logit_scale.detach().exp().clamp(max=self.max_scale))
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = scale_value(value)
        if value == self.scale:
            return  # a learnable scale is not rewritten through log(exp(x)), which may round
        if self.learnable_scale:
            if value > self.max_scale:
                raise ValueError(
                    f"scale must be <= max_scale={self.max_scale!r} with learnable_scale, got {value!r}."
                )
            with torch.no_grad():
                self.logit_scale.fill_(math.log(value))
        self._scale = value

    @property
    def learnable_scale(self) -> bool:
        """Whether the scale is learned, as CLIP's ``logit_scale = log(scale)`` parameter, clamped at
        ``max_scale``. Turning it on after the optimizer was built leaves the new parameter out of it."""
        return self._learnable_scale

    @learnable_scale.setter
    def learnable_scale(self, value: bool) -> None:
        if check_bool("learnable_scale", value) == self._learnable_scale:
            return
        if value:
            check_max_scale(self.max_scale, self._scale)
            # CLIP's parametrisation: the log of the scale is learned, the scale is clamped at max_scale
            self.logit_scale = nn.Parameter(torch.tensor(math.log(self._scale), dtype=torch.float32))
        else:
            self._scale = self.scale
            del self.logit_scale
        self._learnable_scale = value

    @property
    def max_scale(self) -> float:
        return self._max_scale

    @max_scale.setter
    def max_scale(self, value: float) -> None:
        value = SPECS["max_scale"].check("max_scale", value)
        if self.learnable_scale:
            check_max_scale(value, self.scale)
        self._max_scale = value

    def scale_tensor(self) -> Tensor | float:
        """The scale with its graph to ``logit_scale`` when learnable, else the float.

        A learnable scale is kept at most ``max_scale`` by clamping the parameter itself (as CLIP does
        after each optimizer step), not its image: a clamp inside the graph would have no gradient above
        the limit, so a scale that one step carried past it could never come back.
        """
        if self.learnable_scale:
            with torch.no_grad():
                self.logit_scale.clamp_(max=math.log(self.max_scale))
            return self.logit_scale.float().exp()
        return self._scale
