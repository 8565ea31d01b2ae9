"""Checkpointing and logging of a loss's own state (the learnable scale, the negative bank) with the stock
trainer.

sentence-transformers' trainer already puts a loss's parameters in the optimizer, but it saves and
restores only the model: a learned ``logit_scale`` would be lost by ``resume_from_checkpoint`` and
never appear in the logs. [`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback] fills the gap: it saves the losses' scale with
every checkpoint, restores it when training resumes, and adds the current scale to each log. A loss that learns a
bias too (SigLIP's ``logit_bias``, [`CachedSigLIPLoss`][st_cached_losses.losses.cached_siglip.CachedSigLIPLoss])
has it saved, restored and logged beside its scale.

Where the scale is kept: no callback event is told which folder ``resume_from_checkpoint`` named
(``on_train_begin`` gets ``args`` and ``state`` only, and ``args.resume_from_checkpoint`` is not
filled in by ``Trainer.train``), and guessing ``output_dir/checkpoint-<step>`` restores the wrong
scale, or none, when a run resumes from another run's folder. What the trainer does load from the
very checkpoint it resumes from is its `TrainerState` (``trainer_state.json``),
whose documented ``stateful_callbacks`` dict is saved with every checkpoint and handed to every
callback. The scale is kept there, under [`STATE_KEY`][st_cached_losses.losses.callbacks.STATE_KEY]; a copy is also written next to the
checkpoint as [`STATE_FILE`][st_cached_losses.losses.callbacks.STATE_FILE] for inspection and for checkpoints that predate the state entry.
(``ExportableState`` is not used: with ``restore_callback_states_from_checkpoint`` the trainer would
rebuild the callback from JSON, without the loss it must update.)

A loss's negative bank ([`negative_bank`][st_cached_losses.losses.negative_bank], ``negative_bank_size``) is
part of the loss's state dict (the bank module's extra state), read from there; it is too large for the
trainer state's JSON, and each process holds its own share: each process writes its share
into the checkpoint folder as ``BANK_FILE.format(rank)`` ([`BANK_FILE`][st_cached_losses.losses.callbacks.BANK_FILE]), and on resume
reads it back from the folder the trainer resumed from (found as for the scale's older checkpoints; where it
cannot be told, or holds no bank file, the bank restarts empty, with a warning: the run then differs from an
uninterrupted one for the next steps only, until the bank is full again). The logs get the bank's size and
the mean and oldest age of its entries, in steps. A loss that filters false negatives
(``false_negative_filter``) has the fraction of its negatives the filter removed in the latest training step
logged as ``false_negative_fraction`` (on this process's rows).

The callback is given to the trainer explicitly: ``callbacks=[LossStateCallback(loss)]`` (the same
loss, list or dict of losses as the trainer's ``loss``). The trainer hands a loss no reference to
itself, so a loss cannot attach it on its own; instead, a loss with a learnable scale that trains while
no [`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback] covering it is active (between a trainer's ``on_train_begin`` and
``on_train_end``) warns once, naming the missing line ([`warn_if_scale_unsaved`][st_cached_losses.losses.callbacks.warn_if_scale_unsaved]).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from st_cached_losses.engine.caller import user_stacklevel
from st_cached_losses.losses.negative_bank import NegativeBank

logger = logging.getLogger(__name__)

STATE_FILE = "st_cached_losses_state.pt"
"""The losses' state, written into each checkpoint folder (a copy of the trainer-state entry)."""
BANK_FILE = "st_cached_losses_bank-{}.pt"
"""Each process's share of the losses' negative banks, written into each checkpoint folder (``{}``: the
process's index)."""
BIAS_SUFFIX = "/logit_bias"
"""Appended to a loss's key in the saved state for its learned bias (SigLIP's ``logit_bias``)."""
STATE_KEY = "st_cached_losses.LossStateCallback"
"""The entry of ``TrainerState.stateful_callbacks`` holding the losses' ``logit_scale`` values; not a
class name, so that ``restore_callback_states_from_checkpoint`` never tries to rebuild a callback
from it."""


def _stateful(loss: nn.Module) -> list[nn.Module]:
    """The modules inside ``loss`` (itself, or an inner loss of a wrapper such as MatryoshkaLoss) that
    carry a learnable scale."""
    return [m for m in loss.modules() if getattr(m, "learnable_scale", False) and hasattr(m, "logit_scale")]


def _banked(loss: nn.Module) -> list[NegativeBank]:
    """The negative banks inside ``loss`` (one per loss that can keep one, ``negative_bank_size``)."""
    return [m for m in loss.modules() if isinstance(m, NegativeBank)]


def _filtering(loss: nn.Module) -> list[nn.Module]:
    """The modules inside ``loss`` that can filter false negatives (``false_negative_filter``)."""
    return [
        m for m in loss.modules() if isinstance(getattr(type(m), "false_negative_fraction", None), property)
    ]


def _logit_bias(module: nn.Module) -> torch.Tensor | None:
    """A stateful loss's learned bias (SigLIP's ``logit_bias``), or None where it learns none."""
    return module._parameters.get("logit_bias")


def _entries(key: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """A stateful loss's learned tensors under their state keys: ``key`` its ``logit_scale`` (the form of every
    checkpoint so far), ``key + BIAS_SUFFIX`` a learned bias."""
    entries = {key: _logit_scale(module)}
    bias = _logit_bias(module)
    if bias is not None:
        entries[key + BIAS_SUFFIX] = bias
    return entries


def _logit_scale(module: nn.Module) -> torch.Tensor:
    """A stateful loss's ``logit_scale`` parameter (typed: ``nn.Module.__getattr__`` is not)."""
    value = module.logit_scale
    assert isinstance(value, torch.Tensor)
    return value


class LossStateCallback(TrainerCallback):
    """Saves / restores the learnable scale and the negative bank of the given losses with each checkpoint,
    and logs them.

    Args:
        losses: a loss, a list of losses or a dict of losses (as passed to the trainer).
    """

    def __init__(self, losses: nn.Module | dict[str, nn.Module] | list[nn.Module]) -> None:
        if isinstance(losses, nn.Module):
            losses = {"": losses}
        elif not isinstance(losses, dict):
            losses = {str(i): loss for i, loss in enumerate(losses)}
        self.losses = dict(losses)
        # found once: walking the losses means walking the whole model they hold, and the scale is read
        # after every step (a loss's submodules do not change once it is built)
        self._scaled: dict[str, nn.Module] = {}
        self._banks: dict[str, NegativeBank] = {}
        self._filters: dict[str, nn.Module] = {}
        for name, loss in self.losses.items():
            for i, module in enumerate(_stateful(loss)):
                self._scaled[f"{name}.{i}" if name else str(i)] = module
            for i, bank in enumerate(_banked(loss)):
                self._banks[f"{name}.{i}" if name else str(i)] = bank
            for i, module in enumerate(_filtering(loss)):
                self._filters[f"{name}.{i}" if name else str(i)] = module

    def _active_banks(self) -> dict[str, NegativeBank]:
        """The banks in use (a loss's ``negative_bank_size`` may be set after the callback was built)."""
        return {key: bank for key, bank in self._banks.items() if bank.size}

    def bank_state_dict(self) -> dict[str, Any]:
        """This process's share of every negative bank in use, each its loss's state (see
        [`NegativeBank.get_extra_state`][st_cached_losses.losses.negative_bank.NegativeBank.get_extra_state])."""
        return {key: bank.get_extra_state() for key, bank in self._active_banks().items()}

    def load_bank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`bank_state_dict`][st_cached_losses.losses.callbacks.LossStateCallback.bank_state_dict]'s banks (a bank it lacks restarts empty, with a warning)."""
        missing = []
        for key, bank in self._active_banks().items():
            if key in state:
                bank.set_extra_state(state[key])
            else:
                missing.append(key)
        if missing:
            logger.warning(
                "The saved losses' state holds no negative bank for %s (it has %s): those restart empty.",
                ", ".join(missing),
                sorted(state) or "none",
            )

    def restore_banks(self, args: TrainingArguments, state: TrainerState) -> bool:
        """Restore this process's share of the banks from the checkpoint the trainer resumed from (found
        as ``_resumed_checkpoint_folder`` finds it); warn, and leave the banks empty, where there is none."""
        folder = _resumed_checkpoint_folder(args, state)
        path = os.path.join(folder, BANK_FILE.format(args.process_index)) if folder is not None else None
        if path is not None and os.path.isfile(path):
            self.load_bank_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            logger.info("Restored the losses' negative bank from %s", path)
            return True
        for bank in self._active_banks().values():
            bank.clear()
        logger.warning(
            "Training resumed at step %d from a checkpoint that holds no negative bank (no %s found in the "
            "checkpoint the trainer resumed from): the bank restarts empty, so the next steps score fewer "
            "negatives than an uninterrupted run would, until it is full again. Checkpoints hold the bank when "
            "they were saved with LossStateCallback active (callbacks=[LossStateCallback(loss)]).",
            state.global_step,
            BANK_FILE.format(args.process_index),
        )
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            name: value.detach().cpu().clone()
            for key, module in self._scaled.items()
            for name, value in _entries(key, module).items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = []
        for key, module in self._scaled.items():
            for name, value in _entries(key, module).items():
                if name not in state:
                    missing.append(f"{name} ({type(module).__name__})")
                    continue
                with torch.no_grad():
                    value.copy_(torch.as_tensor(state[name]))  # copy_ casts and moves
        if missing:
            # a loss added (or renamed in the dict of losses) since the checkpoint was saved
            logger.warning(
                "The saved losses' state holds no learnable scale for %s (it has %s): those restart from their "
                "current value. Give LossStateCallback the same losses, under the same names, as the run that "
                "saved the checkpoint.",
                ", ".join(missing),
                sorted(state) or "none",
            )

    def scales(self) -> dict[str, float]:
        """The current ``logit_scale`` (and learned bias) values as plain floats, for ``trainer_state.json`` (a
        float32 value survives the JSON round trip exactly)."""
        return {
            name: float(value.detach())
            for key, module in self._scaled.items()
            for name, value in _entries(key, module).items()
        }

    def record(self, state: TrainerState) -> None:
        """Put the current scale into ``state``, which the trainer writes into the next checkpoint.

        Called after every optimizer step: the trainer saves right after ``on_step_end`` (or after an
        evaluation that found a best model, or at the epoch's end) and tells no callback beforehand, and
        ``on_save`` comes after ``trainer_state.json`` is written.
        """
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[STATE_KEY] = self.scales()

    def restore(self, args: TrainingArguments, state: TrainerState) -> bool:
        """Restore the scale saved with the checkpoint the trainer resumed from; warn if there is none.

        ``state`` is the trainer state loaded from that checkpoint, wherever it lies, so its entry is the
        right one even when the checkpoint is outside ``args.output_dir``. Checkpoints without the entry
        (saved by an earlier st_cached_losses) are read from their [`STATE_FILE`][st_cached_losses.losses.callbacks.STATE_FILE] when their folder
        can be told for sure.
        """
        saved = (
            state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
        )
        if isinstance(saved, dict):
            self.load_state_dict(saved)
            logger.info(
                "Restored the losses' learnable scale of step %d from the trainer state", state.global_step
            )
            return True
        folder = _resumed_checkpoint_folder(args, state)
        if folder is not None and self.restore_from(folder):
            return True
        current = ", ".join(f"{key}: {value:.6g}" for key, value in self.scales().items())
        logger.warning(
            "Training resumed at step %d from a checkpoint that holds no learnable scale (no %r entry in its "
            "trainer_state.json, no %s found beside it): the logit_scale restarts from its current value (%s) "
            "instead of the one it had reached, so this run will not match an uninterrupted one. Checkpoints "
            "hold the scale when they were saved with LossStateCallback active (callbacks=[LossStateCallback(loss)] "
            "given to the trainer); to continue such a run, set loss.logit_scale to the log of the scale logged "
            "at step %d before calling train().",
            state.global_step,
            STATE_KEY,
            STATE_FILE,
            current,
            state.global_step,
        )
        return False

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
        if self._active_banks() and state.global_step > 0:
            self.restore_banks(args, state)
        if not self._scaled:  # no learnable scale: nothing to save, restore or log
            return
        _ACTIVE.update(self._scaled.values())
        # train() starts from a fresh state unless it resumes, so a step past 0 means a resumed run
        if state.global_step > 0:
            self.restore(args, state)
        self.record(state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        for module in self._scaled.values():
            _ACTIVE.discard(module)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._scaled:
            self.record(state)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            return
        if self._active_banks():  # every process its own share
            torch.save(self.bank_state_dict(), os.path.join(folder, BANK_FILE.format(args.process_index)))
        if state.is_world_process_zero and self._scaled:
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
            for key, m in self._scaled.items()
        }
        scales.update(
            {
                ("bias" if key == "0" else f"bias_{key}"): float(m.bias)  # type: ignore[arg-type]
                for key, m in self._scaled.items()
                if _logit_bias(m) is not None
            }
        )
        for key, bank in self._active_banks().items():  # its size and age, on this process
            scales.update({(k if key == "0" else f"{k}_{key}"): v for k, v in bank.stats().items()})
        for key, module in self._filters.items():  # the latest training step's, on this process
            fraction: Any = (
                module.false_negative_fraction
            )  # a property of the loss (nn.Module's getattr is untyped)
            if fraction is not None:
                scales["false_negative_fraction" if key == "0" else f"false_negative_fraction_{key}"] = (
                    fraction
                )
        logs.update(scales)
        # the trainer appended this log to its history just before calling back: keep them the same
        if state.log_history and all(
            state.log_history[-1].get(k) == v for k, v in logs.items() if k not in scales
        ):
            state.log_history[-1].update(scales)


def _resumed_checkpoint_folder(args: TrainingArguments, state: TrainerState) -> str | None:
    """The folder the trainer resumed from, where it can be told for sure without being told.

    Candidates are ``args.resume_from_checkpoint`` (set by scripts that follow transformers' examples)
    and ``output_dir/checkpoint-<step>``; one is accepted only if its ``trainer_state.json`` is the one
    loaded (same step, and its log history is where the current one starts), so that another run's
    checkpoint of the same step, left in ``output_dir``, is never mistaken for it.
    """
    candidates = [os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")]
    if isinstance(args.resume_from_checkpoint, str):
        candidates.insert(0, args.resume_from_checkpoint)
    for folder in candidates:
        try:
            with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue
        history = saved.get("log_history") or []
        if saved.get("global_step") == state.global_step and state.log_history[: len(history)] == history:
            return folder
    return None


# losses whose scale a LossStateCallback saves in the training run now going on, and losses already
# warned that none does (weak: neither keeps a loss, and its model, alive)
_ACTIVE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def warn_if_scale_unsaved(loss: nn.Module) -> None:
    """Warn once per loss when ``loss`` trains its learnable scale outside a trainer run whose
    [`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback] covers it: the stock trainer saves only the model, so the scale would be
    neither written into checkpoints, restored on resume nor logged. Called by a loss with a learnable
    scale on each training call (cheap: two set look-ups)."""
    if loss in _ACTIVE or loss in _WARNED:
        return
    _WARNED.add(loss)
    warnings.warn(
        f"{type(loss).__name__} trains a learnable scale, but no LossStateCallback covering it is active: a "
        "transformers / sentence-transformers trainer saves only the model, so the scale would be neither "
        "saved with checkpoints, restored by resume_from_checkpoint nor logged. Give the trainer "
        "callbacks=[LossStateCallback(loss)] (from st_cached_losses; the same loss, list or dict of losses as "
        "its loss=). In a training loop of your own, save and load loss.state_dict() with your checkpoints.",
        UserWarning,
        stacklevel=user_stacklevel(),  # past the library's frames: the user's line
    )
