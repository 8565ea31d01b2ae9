"""Checkpointing and logging of a loss's own parameters (the learnable scale) with the stock trainer.

sentence-transformers' trainer already puts a loss's parameters in the optimizer, but it saves and
restores only the model: a learned ``logit_scale`` would be lost by ``resume_from_checkpoint`` and
never appear in the logs. :class:`LossStateCallback` fills the gap: it writes the losses' state into
every checkpoint folder, restores it when training resumes, and adds the current scale to each log.

A loss with a learnable scale attaches the callback to the trainer that calls it by itself (on its
first call, found on the call stack), so users need no custom trainer and no extra argument; passing
``callbacks=[LossStateCallback(loss)]`` explicitly works too and takes precedence.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)

STATE_FILE = "st_cached_losses_state.pt"


def _named_losses(losses: nn.Module | dict[str, nn.Module] | list[nn.Module]) -> dict[str, nn.Module]:
    if isinstance(losses, dict):
        return dict(losses)
    if isinstance(losses, nn.Module):
        return {"": losses}
    return {str(i): loss for i, loss in enumerate(losses)}


def _stateful(loss: nn.Module) -> list[nn.Module]:
    """The modules inside ``loss`` (itself, or an inner loss of a wrapper such as MatryoshkaLoss) that
    carry a learnable scale."""
    return [m for m in loss.modules() if getattr(m, "learnable_scale", False) and hasattr(m, "logit_scale")]


class LossStateCallback(TrainerCallback):
    """Saves / restores the learnable scale of the given losses with each checkpoint, and logs it.

    Args:
        losses: a loss, a list of losses or a dict of losses (as passed to the trainer).
    """

    def __init__(self, losses: nn.Module | dict[str, nn.Module] | list[nn.Module]) -> None:
        self.losses = _named_losses(losses)

    def _modules(self) -> dict[str, nn.Module]:
        out = {}
        for name, loss in self.losses.items():
            for i, module in enumerate(_stateful(loss)):
                out[f"{name}.{i}" if name else str(i)] = module
        return out

    def state_dict(self) -> dict[str, Any]:
        return {key: module.logit_scale.detach().cpu().clone() for key, module in self._modules().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, module in self._modules().items():
            if key in state:
                with torch.no_grad():
                    module.logit_scale.copy_(state[key].to(module.logit_scale.device))

    def restore_from(self, checkpoint: str) -> bool:
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            return False
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        logger.info("Restored the losses' learnable scale from %s", path)
        return True

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step > 0:
            self.restore_from(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.state_dict(), os.path.join(folder, STATE_FILE))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or not ("loss" in logs or "eval_loss" in logs):
            return
        scales = {
            ("scale" if key == "0" else f"scale_{key}"): float(m.scale)  # type: ignore[arg-type]
            for key, m in self._modules().items()
        }
        logs.update(scales)
        # the trainer appended this log to its history just before calling back: keep them the same
        if state.log_history and all(
            state.log_history[-1].get(k) == v for k, v in logs.items() if k not in scales
        ):
            state.log_history[-1].update(scales)


def attach_to_calling_trainer(loss: nn.Module) -> bool:
    """Find the trainer whose ``compute_loss`` is calling ``loss`` and give it a :class:`LossStateCallback`.

    Returns whether the trainer was found (or already had one). When training already began (a resumed
    run calls the loss for the first time), the checkpoint's state is restored right away.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    trainer = None
    resume = None
    depth = 0
    while frame is not None and depth < 40:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            trainer = trainer or candidate
            value = frame.f_locals.get("resume_from_checkpoint")
            if isinstance(value, str):
                resume = value
        frame = frame.f_back
        depth += 1
    if trainer is None:
        return False
    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, LossStateCallback) for cb in callbacks):
        return True
    callback = LossStateCallback(trainer.loss)  # type: ignore[arg-type]
    # first in line, so that the progress printer and the reporting integrations see the logged scale
    callbacks.insert(0, callback)
    if trainer.state.global_step > 0:
        checkpoint = resume or os.path.join(
            trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}"
        )
        if not callback.restore_from(checkpoint):
            logger.warning(
                "Training resumed at step %d but no saved scale was found in %s; the learnable scale restarts "
                "from its current value.",
                trainer.state.global_step,
                checkpoint,
            )
    return True
