"""Shared machinery of the cached InfoNCE losses: argument checks, the scale, the forward (evaluation
without a graph, or the GradCache engine), and the loss stage on one process, gathered across
processes, or by ring exchange."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.callbacks import attach_to_calling_trainer
from st_cached_losses.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional import (
    DEFAULT_MEMORY_BUDGET,
    LossPath,
    Similarity,
    infonce,
    scale_value,
)
from st_cached_losses.functional.checks import check_positive_int
from st_cached_losses.functional.keys import input_hashes
from st_cached_losses.functional.parallel import agree_on_sizes, gathered_infonce, loss_and_grad
from st_cached_losses.gradcache import GradCache
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.options import check_columns, check_splittable_model, resolve_similarity

#: the values sentence-transformers' MultipleNegativesRankingLoss accepts for these options
VALID_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
VALID_PARTITION_MODES = ("joint", "per_direction")
VALID_HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")
ONE_DIRECTION = ("query_to_doc",)
TWO_DIRECTIONS = ("query_to_doc", "doc_to_query")


class ConfigTuple(tuple[str, ...]):
    """A tuple in a loss's config (``directions``, a tuple as in sentence-transformers' config) that also
    equals the list a JSON round trip makes of it, so a config read back from a model card compares equal."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return list(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def check_directions(directions: Sequence[str], partition_mode: str, owner: str) -> tuple[str, ...]:
    """sentence-transformers' checks of ``directions`` and ``partition_mode`` (same rules), then ours:
    the combinations the core computes so far are the one-direction loss and the symmetric loss with one
    softmax per direction; any other valid combination is refused, never ignored."""
    if isinstance(directions, str) or not isinstance(directions, Sequence):
        raise ValueError(
            f"directions must be a tuple of direction names, e.g. ('query_to_doc',), got {directions!r}."
        )
    directions = tuple(directions)
    if not directions:
        raise ValueError("At least one direction must be specified.")
    if set(directions) - set(VALID_DIRECTIONS):
        raise ValueError(
            f"Invalid directions: {set(directions) - set(VALID_DIRECTIONS)}. Valid: {set(VALID_DIRECTIONS)}"
        )
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
    if partition_mode not in VALID_PARTITION_MODES:
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError(
            "partition_mode='per_direction' is not compatible with 'query_to_query' or 'doc_to_doc' directions."
        )
    if set(directions) == set(ONE_DIRECTION) and len(directions) == 1:
        return directions
    if set(directions) == set(TWO_DIRECTIONS) and len(directions) == 2 and partition_mode == "per_direction":
        return directions
    raise ValueError(
        f"directions={directions!r} with partition_mode={partition_mode!r} is not supported yet by {owner}: "
        "supported are directions=('query_to_doc',) (the MNRL / InfoNCE loss) and directions=('query_to_doc', "
        "'doc_to_query') with partition_mode='per_direction' (the symmetric, CLIP loss). To switch to the "
        "symmetric loss after construction, set partition_mode='per_direction' before directions."
    )


def check_hardness(hardness_mode: str | None, hardness_strength: float, owner: str) -> None:
    if hardness_mode not in VALID_HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {VALID_HARDNESS_MODES}, got {hardness_mode!r}")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)):
        raise ValueError(f"hardness_strength must be a non-negative number, got {hardness_strength!r}.")
    if not hardness_strength >= 0.0:
        raise ValueError("hardness_strength must be non-negative.")
    if hardness_mode is not None:
        raise ValueError(
            f"hardness_mode={hardness_mode!r} is not supported yet by {owner}: only hardness_mode=None (no hardness "
            "weighting) is; leave it None, or use sentence_transformers' CachedMultipleNegativesRankingLoss."
        )


class CachedInfoNCEBase(nn.Module):
    """Base of :class:`CachedMNRLoss`, :class:`CachedCLIPLoss` and :class:`CachedTiledLoss`.

    The constructor takes sentence-transformers' ``CachedMultipleNegativesRankingLoss`` arguments in its
    positional order (subclasses change only defaults), then our extras, keyword-only. Every hyperparameter
    is a property, validated when constructed and again whenever it is set.
    """

    _citations: tuple[str, ...] = (GRADCACHE_CITATION,)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
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
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        mask_duplicates: bool = False,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_splittable_model(model, owner)
        self.model = model
        self._similarity_fct = similarity_fct
        self._similarity = resolve_similarity(similarity_fct)
        scale = scale_value(scale)
        max_scale = self._max_scale_value(max_scale)
        if check_bool("learnable_scale", learnable_scale) and max_scale < scale:
            raise ValueError(f"max_scale must be >= scale, got max_scale={max_scale!r} and scale={scale!r}.")
        self._directions = check_directions(directions, partition_mode, owner)
        self._partition_mode = partition_mode
        check_hardness(hardness_mode, hardness_strength, owner)
        self._hardness_mode = hardness_mode
        self._hardness_strength = hardness_strength
        for name, flag in [
            ("gather_across_devices", gather_across_devices),
            ("show_progress_bar", show_progress_bar),
            ("mask_duplicates", mask_duplicates),
            ("sort_by_length", sort_by_length),
            ("reuse_last_graph", reuse_last_graph),
        ]:
            check_bool(name, flag)
        self.cache = GradCache(
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            show_progress_bar=show_progress_bar,
        )
        self._gather_across_devices = gather_across_devices
        self._mask_duplicates = mask_duplicates
        self._path: LossPath = self._path_value(path)
        check_positive_int("tile_size", tile_size)
        self._tile_size = tile_size
        self._memory_budget = self._memory_budget_value(memory_budget)
        self._max_scale = max_scale
        self._keys: list[Tensor] | None = None
        self._scale = scale
        # the scale as a leaf during GradCache's stage 2 (see _stage2)
        self._scale_leaf: Tensor | None = None
        self._attached = False
        self._learnable_scale = False
        self.learnable_scale = learnable_scale

    def __setattr__(self, name: str, value: Any) -> None:
        # a property's setter, whatever the value: nn.Module would file an nn.Module value (e.g. a similarity
        # module) or a Parameter under _modules / _parameters, where the setter never sees it
        if isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ configuration

    @staticmethod
    def _max_scale_value(value: float) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"max_scale must be a finite positive number, got {value!r}; e.g. 100.0.")
        return float(value)

    @staticmethod
    def _path_value(value: str) -> LossPath:
        if value not in ("auto", "chunked", "tiled"):
            raise ValueError(f"path must be 'auto', 'chunked' or 'tiled', got {value!r}.")
        return value  # type: ignore[return-value]

    @staticmethod
    def _memory_budget_value(value: int) -> int:
        if value is None:
            raise ValueError("memory_budget must be a positive integer (bytes), got None; e.g. 64 * 2**20.")
        check_positive_int("memory_budget", value)
        return value

    @property
    def scale(self) -> float:
        """The current scale (1 / temperature), as a float; the learned value when learnable."""
        if self.learnable_scale:
            return float(self.logit_scale.detach().exp().clamp(max=self.max_scale))
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = scale_value(value)
        if self.learnable_scale:
            if value > self.max_scale:
                raise ValueError(
                    f"scale must be <= max_scale={self.max_scale!r} with learnable_scale, got {value!r}."
                )
            with torch.no_grad():
                self.logit_scale.fill_(math.log(value))
        self._scale = value

    @property
    def temperature(self) -> float:
        """``1 / scale``."""
        return 1.0 / self.scale

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.scale = 1.0 / scale_value(value)

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
            if self.max_scale < self._scale:
                raise ValueError(
                    f"max_scale must be >= scale, got max_scale={self.max_scale!r} and scale={self._scale!r}."
                )
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
        value = self._max_scale_value(value)
        if self.learnable_scale and value < self.scale:
            raise ValueError(f"max_scale must be >= scale, got max_scale={value!r} and scale={self.scale!r}.")
        self._max_scale = value

    @property
    def similarity_fct(self) -> Callable[..., Tensor] | str:
        """What was given: ``cos_sim`` / ``dot_score`` (or ``"cosine"`` / ``"dot"``)."""
        return self._similarity_fct

    @similarity_fct.setter
    def similarity_fct(self, value: Callable[..., Tensor] | str) -> None:
        self._similarity = resolve_similarity(value)
        self._similarity_fct = value

    @property
    def similarity(self) -> Similarity:
        """The core's name of the similarity: ``"cosine"`` or ``"dot"``."""
        return self._similarity

    @property
    def mini_batch_size(self) -> int:
        return self.cache.mini_batch_size

    @mini_batch_size.setter
    def mini_batch_size(self, value: int) -> None:
        if value is None:
            raise ValueError("mini_batch_size must be a positive integer, got None; e.g. 32.")
        check_positive_int("mini_batch_size", value)
        self.cache.mini_batch_size = value

    @property
    def mini_batch_num_tokens(self) -> int | None:
        return self.cache.mini_batch_num_tokens

    @mini_batch_num_tokens.setter
    def mini_batch_num_tokens(self, value: int | None) -> None:
        check_positive_int("mini_batch_num_tokens", value)
        self.cache.mini_batch_num_tokens = value

    @property
    def gather_across_devices(self) -> bool:
        return self._gather_across_devices

    @gather_across_devices.setter
    def gather_across_devices(self, value: bool) -> None:
        self._gather_across_devices = check_bool("gather_across_devices", value)

    @property
    def directions(self) -> tuple[str, ...]:
        return self._directions

    @directions.setter
    def directions(self, value: Sequence[str]) -> None:
        self._directions = check_directions(value, self._partition_mode, type(self).__name__)

    @property
    def partition_mode(self) -> str:
        return self._partition_mode

    @partition_mode.setter
    def partition_mode(self, value: str) -> None:
        check_directions(self._directions, value, type(self).__name__)
        self._partition_mode = value

    @property
    def symmetric(self) -> bool:
        """Whether the loss has the positive -> anchors direction too (``directions=('query_to_doc',
        'doc_to_query')``, ``partition_mode='per_direction'``); setting it sets those two."""
        return len(self._directions) == 2

    @symmetric.setter
    def symmetric(self, value: bool) -> None:
        if check_bool("symmetric", value):
            self._directions, self._partition_mode = TWO_DIRECTIONS, "per_direction"
        else:
            self._directions = ONE_DIRECTION

    @property
    def hardness_mode(self) -> str | None:
        return self._hardness_mode

    @hardness_mode.setter
    def hardness_mode(self, value: str | None) -> None:
        check_hardness(value, self._hardness_strength, type(self).__name__)
        self._hardness_mode = value

    @property
    def hardness_strength(self) -> float:
        return self._hardness_strength

    @hardness_strength.setter
    def hardness_strength(self, value: float) -> None:
        check_hardness(self._hardness_mode, value, type(self).__name__)
        self._hardness_strength = value

    @property
    def show_progress_bar(self) -> bool:
        return self.cache.show_progress_bar

    @show_progress_bar.setter
    def show_progress_bar(self, value: bool) -> None:
        self.cache.show_progress_bar = check_bool("show_progress_bar", value)

    @property
    def sort_by_length(self) -> bool:
        return self.cache.sort_by_length

    @sort_by_length.setter
    def sort_by_length(self, value: bool) -> None:
        self.cache.sort_by_length = check_bool("sort_by_length", value)

    @property
    def reuse_last_graph(self) -> bool:
        return self.cache.reuse_last_graph

    @reuse_last_graph.setter
    def reuse_last_graph(self, value: bool) -> None:
        self.cache.reuse_last_graph = check_bool("reuse_last_graph", value)

    @property
    def mask_duplicates(self) -> bool:
        return self._mask_duplicates

    @mask_duplicates.setter
    def mask_duplicates(self, value: bool) -> None:
        self._mask_duplicates = check_bool("mask_duplicates", value)

    @property
    def path(self) -> LossPath:
        return self._path

    @path.setter
    def path(self, value: LossPath) -> None:
        self._path = self._path_value(value)

    @property
    def tile_size(self) -> int | None:
        return self._tile_size

    @tile_size.setter
    def tile_size(self, value: int | None) -> None:
        check_positive_int("tile_size", value)
        self._tile_size = value

    @property
    def memory_budget(self) -> int:
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int) -> None:
        self._memory_budget = self._memory_budget_value(value)

    def _citation_parts(self) -> tuple[str, ...]:
        return self._citations

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        return "".join(self._citation_parts())

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
        """sentence-transformers' nine keys (same values for the same settings; ``scale`` is the current,
        learned value), then ``symmetric`` and the extras that differ from their defaults."""
        config: dict[str, Any] = {
            "scale": self.scale,
            "similarity_fct": {"cosine": "cos_sim", "dot": "dot_score"}[self.similarity],
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "gather_across_devices": self.gather_across_devices,
            "directions": ConfigTuple(self.directions),
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
            "symmetric": self.symmetric,
        }
        if self.learnable_scale:
            config.update(learnable_scale=True, max_scale=self.max_scale)
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
