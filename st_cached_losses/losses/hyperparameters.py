"""The hyperparameters of the cached losses as properties: each can be read and set after construction
(as sentence-transformers' losses allow), and setting one checks it again, so an assignment is never
silently ignored nor accepted when invalid. Also the config for the model card and the citation."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.functional import LossPath, Similarity, scale_value
from st_cached_losses.losses.citations import GRADCACHE_CITATION, GTE_CITATION, HARDNESS_CITATION
from st_cached_losses.losses.mini_batch_settings import MiniBatchSettings
from st_cached_losses.losses.options import (
    ONE_DIRECTION,
    TWO_DIRECTIONS,
    VALID_DIRECTIONS,
    ConfigTuple,
    check_directions,
    check_hardness,
    resolve_similarity,
    similarity_name,
)
from st_cached_losses.losses.settings import SPECS, Setting, check_bool, check_max_scale

__all__ = ["CachedLossHyperparameters"]


class CachedLossHyperparameters(MiniBatchSettings, nn.Module):
    """The settable hyperparameters of :class:`~st_cached_losses.losses._base.CachedInfoNCEBase`; the
    values live in private attributes (and in the engine, ``self.cache``) set by its constructor."""

    _citations: tuple[str, ...] = (GRADCACHE_CITATION,)
    cache: GradCache
    logit_scale: nn.Parameter
    _scale: float
    _learnable_scale: bool
    _max_scale: float
    _similarity_fct: Callable[..., Tensor] | str
    _similarity: Similarity
    _directions: tuple[str, ...]
    _partition_mode: str
    _hardness_mode: str | None
    _hardness_strength: float

    def __setattr__(self, name: str, value: Any) -> None:
        # a property's setter, whatever the value: nn.Module would file an nn.Module value (e.g. a similarity
        # module) or a Parameter under _modules / _parameters, where the setter never sees it
        if isinstance(getattr(type(self), name, None), (property, Setting)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ configuration

    def _init_settings(self, **values: Any) -> None:
        """The constructor's plain settings, each checked by its spec; through this class's own
        descriptors, so that a subclass that hides a setting (CachedGISTLoss) still starts from its default."""
        for name, value in values.items():
            descriptor = inspect.getattr_static(CachedLossHyperparameters, name)
            if isinstance(descriptor, Setting):
                descriptor.__set__(self, value)
            else:
                setattr(self, name, value)

    # the plain settings (checked by their spec, see settings.py)
    gather_across_devices = Setting[bool]()
    mask_duplicates = Setting[bool]()
    path = Setting[LossPath]()
    tile_size = Setting[int | None]()
    memory_budget = Setting[int]()
    show_progress_bar = Setting[bool](on_engine=True)
    sort_by_length = Setting[bool](on_engine=True)
    reuse_last_graph = Setting[bool](on_engine=True)
    keep_params_unsharded = Setting[bool](on_engine=True)
    graph_memory_budget = Setting[int | None](on_engine=True)

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
    def temperature(self) -> float:
        """``1 / scale``."""
        return 1.0 / self.scale

    @temperature.setter
    def temperature(self, value: float) -> None:
        temperature = scale_value(value, name="temperature")
        if temperature != self.temperature:  # else unchanged: 1 / (1 / s) may round
            self.scale = 1.0 / temperature

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
        """The core's similarity: ``"cosine"``, ``"dot"`` (GEMM tiles) or the function itself."""
        return self._similarity

    @property
    def directions(self) -> tuple[str, ...]:
        return self._directions

    @directions.setter
    def directions(self, value: Sequence[str]) -> None:
        directions = check_directions(value, self._partition_mode, type(self).__name__)
        self._directions = directions

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
        return set(self._directions) == set(TWO_DIRECTIONS) and self._partition_mode == "per_direction"

    @symmetric.setter
    def symmetric(self, value: bool) -> None:
        if check_bool("symmetric", value) == self.symmetric:
            return  # e.g. False for four directions: stays four directions
        directions, partition_mode = (
            (TWO_DIRECTIONS, "per_direction") if value else (ONE_DIRECTION, self._partition_mode)
        )
        self._directions, self._partition_mode = directions, partition_mode

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

    def _citation_parts(self) -> tuple[str, ...]:
        return self._citations

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        extra = []
        if set(self._directions) == set(VALID_DIRECTIONS) and self._partition_mode == "joint":
            extra.append(GTE_CITATION)
        if self._hardness_mode is not None and self._hardness_strength > 0:
            extra.append(HARDNESS_CITATION)
        return "".join([*self._citation_parts(), *extra])

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

    def _changed_settings(self) -> dict[str, Any]:
        """The extras of the config: a learnable scale and its clamp, and each ``"changed"`` setting of this
        loss that differs from its default. A setting assigned after construction to a loss whose constructor
        lacks it (``learnable_scale`` on ``CachedMNRLoss``) is listed too: the config says how the model was
        trained, even where ``type(loss)(model, **config)`` cannot rebuild that loss."""
        extras: dict[str, Any] = {}
        if self.learnable_scale:
            extras.update(learnable_scale=True, max_scale=self.max_scale)
        for name, spec in SPECS.items():
            if spec.config == "changed" and isinstance(getattr(type(self), name, None), Setting):
                value = getattr(self, name)
                if value != spec.default:
                    extras[name] = value
        return extras
