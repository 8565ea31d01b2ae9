"""Shared machinery of the cached InfoNCE losses: argument checks, the scale, the forward (evaluation
without a graph, or the GradCache engine), and the loss stage on one process, gathered across
processes, or by ring exchange."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.callbacks import attach_to_calling_trainer
from st_cached_losses.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional import (
    DEFAULT_MEMORY_BUDGET,
    LossPath,
    infonce,
    scale_value,
)
from st_cached_losses.functional.keys import input_hashes
from st_cached_losses.functional.parallel import agree_on_sizes, gathered_infonce, loss_and_grad
from st_cached_losses.gradcache import GradCache
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.options import check_columns, check_splittable_model, resolve_similarity


class CachedInfoNCEBase(nn.Module):
    """Base of :class:`CachedMNRLoss`, :class:`CachedCLIPLoss` and :class:`CachedTiledLoss`.

    Subclasses set ``symmetric``, ``path`` and the docs; the forward logic is shared.
    """

    citation: str = GRADCACHE_CITATION

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = "cosine",
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        *,
        symmetric: bool = False,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        path: LossPath = "auto",
        tile_size: int | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        gather_across_devices: bool = False,
        mask_duplicates: bool = False,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
        show_progress_bar: bool = False,
    ) -> None:
        super().__init__()
        check_splittable_model(model, type(self).__name__)
        self.similarity = resolve_similarity(similarity_fct)
        scale = scale_value(scale)
        if learnable_scale and (not math.isfinite(max_scale) or max_scale < scale):
            raise ValueError(f"max_scale must be >= scale, got max_scale={max_scale!r} and scale={scale!r}.")
        self.model = model
        self.cache = GradCache(
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            show_progress_bar=show_progress_bar,
        )
        self.symmetric = symmetric
        self.learnable_scale = learnable_scale
        self.max_scale = float(max_scale)
        self.path: LossPath = path
        self.tile_size = tile_size
        self.memory_budget = memory_budget
        self.gather_across_devices = gather_across_devices
        self.mask_duplicates = mask_duplicates
        self._keys: list[Tensor] | None = None
        self._scale = float(scale)
        # the scale as a leaf during GradCache's stage 2 (see _stage2)
        self._scale_leaf: Tensor | None = None
        self._attached = False
        if learnable_scale:
            # CLIP's parametrisation: the log of the scale is learned, the scale is clamped at max_scale
            self.logit_scale = nn.Parameter(torch.tensor(math.log(scale), dtype=torch.float32))

    # ------------------------------------------------------------------ configuration

    @property
    def mini_batch_size(self) -> int:
        return self.cache.mini_batch_size

    @property
    def show_progress_bar(self) -> bool:
        return self.cache.show_progress_bar

    @show_progress_bar.setter
    def show_progress_bar(self, value: bool) -> None:
        self.cache.show_progress_bar = value

    @property
    def scale(self) -> float:
        """The current scale (1 / temperature), as a float."""
        if self.learnable_scale:
            return float(self.logit_scale.detach().exp().clamp(max=self.max_scale))
        return self._scale

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

    def get_config_dict(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "scale": self._scale,
            "similarity_fct": {"cosine": "cos_sim", "dot": "dot_score"}[self.similarity],
            "mini_batch_size": self.cache.mini_batch_size,
        }
        if self.cache.mini_batch_num_tokens is not None:
            config["mini_batch_num_tokens"] = self.cache.mini_batch_num_tokens
        if self.learnable_scale:
            config.update(learnable_scale=True, max_scale=self.max_scale)
        if self.gather_across_devices:
            config["gather_across_devices"] = True
        if self.mask_duplicates:
            config["mask_duplicates"] = True
        if self.tile_size is not None:
            config["tile_size"] = self.tile_size
        return config

    # ------------------------------------------------------------------ forward

    def _core_kwargs(self, keys: list[Tensor] | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if keys is not None:
            kwargs.update(anchor_keys=keys[0], candidate_keys=keys[1:])
        return {
            **kwargs,
            "similarity": self.similarity,
            "symmetric": self.symmetric,
            "path": self.path,
            "tile_size": self.tile_size,
            "memory_budget": self.memory_budget,
        }

    #: Tells sentence-transformers' MatryoshkaLoss (and AdaptiveLayerLoss) that this loss back-propagates
    #: by replaying the encoder: Matryoshka then decorates :meth:`calculate_loss` instead of the model.
    uses_gradient_cache = True

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The loss of already computed embeddings (sentence-transformers' cached-loss interface).

        Args:
            reps: per column (anchors, positives, hard negatives...), a list of ``(m_j, d)`` pieces that
                concatenate to the column's ``(B, d)`` embeddings in row order.
            labels: unused (the positive of row ``i`` is row ``i`` of the second column).
            with_backward: also put the gradient of the loss in each piece's ``.grad`` (the pieces must
                be leaves that require grad) and return the loss without a graph to the embeddings. (With
                a learnable scale, inside GradCache's stage 2, the returned loss keeps a graph to a leaf
                standing for the scale that carries exactly the scale's gradient: a wrapper that weighs
                and sums several calls, like MatryoshkaLoss, thus weighs the scale's gradient too.)
                Without it the loss is returned with autograd (or without a graph under
                ``torch.no_grad``).

        With ``gather_across_devices``, each process returns its share of the global loss (see
        ``st_cached_losses.functional.parallel``): DDP's gradient average is the full batch's gradient.
        """
        embeddings = [torch.cat(r) if len(r) > 1 else r[0] for r in reps]
        keys = self._keys if self._keys is not None and len(self._keys[0]) == len(embeddings[0]) else None
        if self.gather_across_devices and not is_distributed():
            warn_no_process_group_once(type(self).__name__)
        # also the finiteness check, agreed on by every process
        sizes = agree_on_sizes(embeddings, self.gather_across_devices)
        scale, kwargs = self.scale_tensor(), self._core_kwargs(keys)
        if not with_backward and torch.is_grad_enabled():  # a caller asking for autograd, not the cache
            if sizes is None:
                return infonce(embeddings[0], embeddings[1:], scale=scale, check_finite=False, **kwargs)
            return gathered_infonce(embeddings[0], embeddings[1:], sizes, scale=scale, **kwargs)
        scale = self._scale_for_grad(scale) if with_backward else scale
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
                g = g.to(piece.dtype)
                piece.grad = g if piece.grad is None else piece.grad + g
        loss = out.loss.detach()
        if out.grad_scale is not None and self._scale_leaf is not None:
            # the value of the loss, with d/d(leaf) = the scale's gradient: a caller's weights reach it
            leaf = self._scale_leaf
            loss = loss + (leaf - leaf.detach()) * out.grad_scale.detach().to(leaf.dtype)
        return loss

    def _scale_for_grad(self, scale: Tensor | float) -> Tensor | float:
        """The scale the core differentiates: stage 2's leaf. Outside stage 2 nobody reads the scale's
        gradient, so the core gets it detached and does not compute one."""
        if not isinstance(scale, Tensor):
            return scale
        return self._scale_leaf if self._scale_leaf is not None else scale.detach()

    def _stage2(
        self, embeddings: list[Tensor], labels: Tensor | None
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """GradCache's stage 2 through :meth:`calculate_loss`, so that a wrapper that decorates it works."""
        reps = [[e.detach().requires_grad_()] for e in embeddings]
        scale = self.scale_tensor()
        self._scale_leaf = scale.detach().requires_grad_() if isinstance(scale, Tensor) else None
        try:
            loss = self.calculate_loss(reps, labels, with_backward=True)
            scale_grad = None
            if self._scale_leaf is not None and loss.requires_grad:
                # through whatever a wrapper did with the returned losses (e.g. Matryoshka's weights)
                (scale_grad,) = torch.autograd.grad(loss, self._scale_leaf)
        finally:
            self._scale_leaf = None
        grads = [r[0].grad if r[0].grad is not None else torch.zeros_like(r[0]) for r in reps]
        return loss.detach(), grads, [scale_grad]

    def forward(self, sentence_features: Iterable[dict[str, Any]], labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        check_columns(features, type(self).__name__)
        if self.learnable_scale:
            # the stock trainer saves only the model: have the trainer calling us checkpoint, restore and log
            # the scale too; on every call, as the same loss may be handed to a second trainer to resume
            self._attached = attach_to_calling_trainer(self)
        # false negatives are recognised by their token ids (embeddings differ under dropout)
        self._keys = [input_hashes(f) for f in features] if self.mask_duplicates else None
        try:
            if not torch.is_grad_enabled():
                # evaluation: the same loss, mini-batched, no caching and no graph
                embeddings = self.cache.embed(self.model, features)
                return self.calculate_loss([[e] for e in embeddings], labels)
            scale = self.scale_tensor()
            extra = [scale] if isinstance(scale, Tensor) else []
            return self.cache.step(self.model, features, lambda e: self._stage2(e, labels), extra=extra)
        finally:
            self._keys = None
