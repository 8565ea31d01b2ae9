"""Shared machinery of the cached InfoNCE losses: construction, the forward (evaluation without a graph,
or the GradCache engine) and the loss stage (one process, gathered across processes, or by ring
exchange, through ``st_cached_losses.functional.parallel``). The hyperparameters' properties live in
``hyperparameters.py``, their checks in ``options.py``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.engine.features import batch_size_of
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.functional import (
    DEFAULT_MEMORY_BUDGET,
    LossPath,
    infonce,
    scale_value,
)
from st_cached_losses.functional.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional.keys import input_hashes
from st_cached_losses.functional.parallel import (
    agree_on_sizes,
    gathered_infonce,
    loss_and_grad,
    mean_scale_grad,
)
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses.callbacks import warn_if_scale_unsaved
from st_cached_losses.losses.hyperparameters import CachedLossHyperparameters
from st_cached_losses.losses.options import (
    ONE_DIRECTION,
    check_columns,
    check_directions,
    check_hardness,
    check_splittable_model,
    resolve_similarity,
)
from st_cached_losses.losses.settings import SPECS


@dataclass
class StepData:
    """What one call of a loss hands its loss stage besides the embeddings, built by ``forward`` from the
    features (never kept on the loss): :meth:`CachedInfoNCEBase.calculate_loss` reads it from its ``step``
    argument, so that a wrapper decorating ``calculate_loss`` (MatryoshkaLoss) passes it through."""

    #: per column, the inputs' hashes (``mask_duplicates``)
    keys: list[Tensor] | None = None
    #: per column, the guide's embeddings of the same rows (CachedGISTLoss)
    guide: list[Tensor] | None = None
    #: in GradCache's stage 2, a leaf standing for the learnable scale (its gradient is read off it)
    scale_leaf: Tensor | None = None


class CachedInfoNCEBase(CachedLossHyperparameters):
    """Base of :class:`CachedMNRLoss`, :class:`CachedCLIPLoss` and :class:`CachedTiledLoss`.

    The constructor takes sentence-transformers' ``CachedMultipleNegativesRankingLoss`` arguments in its
    positional order (subclasses change only defaults), then our extras, keyword-only. Every hyperparameter
    is a property, validated when constructed and again whenever it is set.
    """

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
        path: LossPath = "auto",
        tile_size: int | None = None,
        memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
        mask_duplicates: bool = False,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
        keep_params_unsharded: bool = False,
        graph_memory_budget: int | str | None = None,
        mini_batch_memory_budget: int | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_splittable_model(model, owner)
        self.model = model
        self._similarity_fct = similarity_fct
        self._similarity = resolve_similarity(similarity_fct)
        scale = scale_value(scale)
        # checked against the scale by learnable_scale's setter, below
        max_scale = SPECS["max_scale"].check("max_scale", max_scale)
        self._directions = check_directions(directions, partition_mode, owner)
        self._partition_mode = partition_mode
        check_hardness(hardness_mode, hardness_strength, owner)
        self._hardness_mode = hardness_mode
        self._hardness_strength = hardness_strength
        self.cache = GradCache(mini_batch_size=mini_batch_size, mini_batch_num_tokens=mini_batch_num_tokens)
        self._init_settings(
            mini_batch_memory_budget=mini_batch_memory_budget,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
            mask_duplicates=mask_duplicates,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            keep_params_unsharded=keep_params_unsharded,
            graph_memory_budget=graph_memory_budget,
            path=path,
            tile_size=tile_size,
            memory_budget=memory_budget,
        )
        self._max_scale = max_scale
        self._scale = scale
        self._warned_caching_off = False
        self._tagged = False
        self._learnable_scale = False
        self.learnable_scale = learnable_scale

    # ------------------------------------------------------------------ forward

    def _core_kwargs(self, step: StepData, n_rows: int, n_columns: int) -> dict[str, Any]:
        """The core's options; ``n_columns``: candidate columns (positives and hard negatives) of this step."""
        return {
            "similarity": self.similarity,
            "path": self.path,
            "tile_size": self.tile_size,
            "memory_budget": self.memory_budget,
            **self._loss_terms(step, n_rows, n_columns),
        }

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        """What this call's loss stage needs from the features (a subclass adds its own)."""
        # false negatives are recognised by their token ids (embeddings differ under dropout)
        return StepData(keys=[input_hashes(f) for f in features] if self._mask_duplicates else None)

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> dict[str, Any]:
        """Which loss the core computes: the terms of sentence-transformers' options (what a subclass with
        other terms overrides), and the duplicate keys that mask them (those of these rows: a wrapper may
        call the loss stage on other rows, and masks nothing then)."""
        kwargs: dict[str, Any] = {}
        keys = step.keys if step.keys is not None and len(step.keys[0]) == n_rows else None
        if keys is not None:
            kwargs.update(anchor_keys=keys[0], candidate_keys=keys[1:])
        kwargs["terms"] = mnrl_terms(
            self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength, n_columns
        )
        return kwargs

    #: The sentence-transformers loss this one equals (the same loss and gradients for the same options),
    #: named in the model card's tags next to ``loss:<our class>``.
    equivalent_st_loss = "CachedMultipleNegativesRankingLoss"

    def _tag_model_card(self) -> None:
        """Once per loss: tag the model's card with this library and the loss this one equals."""
        card = getattr(self.model, "model_card_data", None)
        if self._tagged or card is None or not hasattr(card, "add_tags"):
            return
        card.add_tags(["st_cached_losses", f"equivalent-loss:{self.equivalent_st_loss}"])
        self._tagged = True

    #: Tells sentence-transformers' MatryoshkaLoss (and AdaptiveLayerLoss) that this loss back-propagates
    #: by replaying the encoder: Matryoshka then decorates :meth:`calculate_loss` instead of the model.
    uses_gradient_cache = True

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
            step: what the call of the loss on these rows' features prepared (:class:`StepData`); None,
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
        """GradCache's stage 2 through :meth:`calculate_loss`, so that a wrapper that decorates it works."""
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
        if self.learnable_scale and torch.is_grad_enabled():
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
