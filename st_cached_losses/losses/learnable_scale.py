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
    the loss's state, not a setting: the settings keep the ``scale`` given (the initial value, or the learned
    one when another setting last changed), ``loss.scale`` reads the learned value, and the config writes it.
    Assigning ``scale`` sets the parameter; turning learning off keeps the learned value as the fixed scale.
    Turning it on after the optimizer was built leaves the new parameter out of it."""

    logit_scale: nn.Parameter
    learned_settings = frozenset({"scale", "temperature"})

    def _learning(self) -> bool:
        return bool(self.settings.learnable_scale) and "logit_scale" in self._parameters

    def learned(self) -> dict[str, Any]:
        """The learned scale (``exp(logit_scale)`` clamped at ``max_scale``), as ``"scale"``, while learnable."""
        if not self._learning():
            return {}
        return {"scale": float(self.logit_scale.detach().exp().clamp(max=self.settings.max_scale))}

    @property
    def scale(self) -> float:
        """The current scale (1 / temperature), as a float: the learned value while learnable (a view of
        ``logit_scale``, which an assignment sets), else the setting."""
        return float(self.learned().get("scale", self.settings.scale))

    @scale.setter
    def scale(self, value: float) -> None:
        self.update_settings(scale=value)

    def _settings_changed(self, old: Any, new: Any) -> None:
        super()._settings_changed(old, new)
        was = old is not None and old.learnable_scale and "logit_scale" in self._parameters
        if new.learnable_scale and not was:
            # CLIP's parametrisation: the log of the scale is learned, the scale is clamped at max_scale
            self.logit_scale = nn.Parameter(torch.tensor(math.log(new.scale), dtype=torch.float32))
        elif new.learnable_scale and new.scale != old.scale:  # (old: with the learned value; not through
            with torch.no_grad():  # log(exp(x)), which rounds)
                self.logit_scale.fill_(math.log(new.scale))
        elif not new.learnable_scale and was:
            del self.logit_scale

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The learned scale with its graph to ``logit_scale``, as ``"scale"`` (nothing when fixed).

        A learnable scale is kept at most ``max_scale`` by clamping the parameter itself (as CLIP does after
        each optimizer step), not its image: a clamp inside the graph would have no gradient above the limit,
        so a scale that one step carried past it could never come back."""
        settings = self.settings
        if not settings.learnable_scale:
            return {}
        if training:
            # the stock trainer saves only the model: say so once if no LossStateCallback saves the scale
            warn_if_scale_unsaved(self)
        with torch.no_grad():
            self.logit_scale.clamp_(max=math.log(settings.max_scale))
        return {"scale": self.logit_scale.float().exp()}
