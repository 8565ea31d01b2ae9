"""A learnable scale, for the losses whose settings have ``learnable_scale`` (MNR, CLIP, tiled, GIST): the
scale learned as CLIP's ``logit_scale = log(scale)`` parameter of the loss, clamped at ``max_scale``, and handed
to the stage as ``step.inputs["scale"]``, whose gradient the stage returns."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.losses.base import CachedLoss
from st_cached_losses.losses.callbacks import warn_if_scale_unsaved

__all__ = ["LearnableScale"]


class LearnableScale(CachedLoss):
    """A loss whose scale may be learned (``learnable_scale``): ``logit_scale`` is its parameter while it is,
    ``scale`` reads the learned value (and its settings say it), and assigning ``scale`` sets the parameter.
    Turning it on after the optimizer was built leaves the new parameter out of it."""

    logit_scale: nn.Parameter

    @property
    def settings(self) -> Any:
        """The loss's settings (frozen), the learned scale in them when learnable."""
        settings = self.__dict__["_settings"]
        if settings.learnable_scale and "logit_scale" in self._parameters:
            learned = self._learned()
            if learned != settings.scale:
                settings = settings.replace(scale=learned)
        return settings

    def _learned(self) -> float:
        return float(self.logit_scale.detach().exp().clamp(max=self.__dict__["_settings"].max_scale))

    @property
    def scale(self) -> float:
        """The current scale (1 / temperature), as a float; the learned value when learnable (a view of
        ``logit_scale`` then, which an assignment sets)."""
        return float(self.settings.scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self.update_settings(scale=value)

    def _settings_changed(self, old: Any, new: Any) -> None:
        super()._settings_changed(old, new)
        was = old is not None and old.learnable_scale and "logit_scale" in self._parameters
        if new.learnable_scale and not was:
            # CLIP's parametrisation: the log of the scale is learned, the scale is clamped at max_scale
            self.logit_scale = nn.Parameter(torch.tensor(math.log(new.scale), dtype=torch.float32))
        elif (
            new.learnable_scale and new.scale != old.scale
        ):  # (not rewritten through log(exp(x)), which rounds)
            with torch.no_grad():
                self.logit_scale.fill_(math.log(new.scale))
        elif not new.learnable_scale and was:
            del self.logit_scale

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The learned scale with its graph to ``logit_scale``, as ``"scale"`` (nothing when fixed).

        A learnable scale is kept at most ``max_scale`` by clamping the parameter itself (as CLIP does after
        each optimizer step), not its image: a clamp inside the graph would have no gradient above the limit,
        so a scale that one step carried past it could never come back."""
        settings = self.__dict__["_settings"]
        if not settings.learnable_scale:
            return {}
        if training:
            # the stock trainer saves only the model: say so once if no LossStateCallback saves the scale
            warn_if_scale_unsaved(self)
        with torch.no_grad():
            self.logit_scale.clamp_(max=math.log(settings.max_scale))
        return {"scale": self.logit_scale.float().exp()}
