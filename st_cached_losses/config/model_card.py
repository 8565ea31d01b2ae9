"""The model card of a model trained with a cached loss: what sentence-transformers cannot know by itself.

sentence-transformers writes the card on ``save_pretrained`` / ``push_to_hub``: the loss class (also as a
``loss:`` tag), its ``get_config_dict()``, its citations, the training arguments and the evaluation.
Two things it misses, added here:

* [`CachedLossCardCallback`][st_cached_losses.config.model_card.CachedLossCardCallback]: it lists "non-default hyperparameters" by comparing with a default
  ``SentenceTransformerTrainingArguments``, which has no loss fields, so a changed ``mini_batch_size``
  or ``temperature`` appeared only under "all hyperparameters";
* [`add_training_section`][st_cached_losses.config.model_card.add_training_section]: a "Cached loss training" section with what caching changed (the global
  batch, the processes, the encoder mini-batch), metrics before and after training, and the loss fields.

This module sits above [`st_cached_losses.config.training_args`][st_cached_losses.config.training_args] (the callback needs the arguments class),
not in [`st_cached_losses.losses.callbacks`][st_cached_losses.losses.callbacks], which the losses import.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from st_cached_losses.config.training_args import LOSS_DEFAULTS, CachedLossArguments

SECTION_TITLE = "Cached loss training"


class CachedLossCardCallback(TrainerCallback):
    """Lists the loss fields of [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] that differ from their defaults among
    the model card's "non-default hyperparameters".

    sentence-transformers compares the arguments with a default ``SentenceTransformerTrainingArguments``,
    which has none of these fields, so it shows them only under "all hyperparameters". Pass it as
    ``callbacks=[CachedLossCardCallback()]`` to the trainer.
    """

    def _update(self, args: TrainingArguments, model: Any) -> None:
        if not isinstance(args, CachedLossArguments) or model is None:
            return
        card = getattr(model, "model_card_data", None)
        if card is None or card.non_default_hyperparameters.get("loss") == args.loss:
            return  # no card, or listed already since the trainer last filled the hyperparameters in
        changed = {k: v for k, v in args.loss_settings().items() if v != LOSS_DEFAULTS[k]}
        # the loss choice always, so the card says which loss these settings belong to
        card.non_default_hyperparameters = {"loss": args.loss, **changed, **card.non_default_hyperparameters}

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # before sentence-transformers' own card callback, whose on_init_end computes the card's widget
        # examples behind a tqdm bar of its own ("Computing widget examples") that disable_tqdm does not reach
        if getattr(args, "disable_tqdm", False):
            quiet_widget_examples(getattr(kwargs.get("model"), "model_card_data", None))

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # not on_train_begin: the trainer's own model card callback, which comes after the user's callbacks,
        # refills the hyperparameters there; from then on one update per run is enough
        self._update(args, kwargs.get("model"))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._update(args, kwargs.get("model"))


def quiet_widget_examples(card: Any) -> None:
    """Make the next ``card.set_widget_examples(dataset)`` (sentence-transformers' model card data) run
    without its "Computing widget examples" progress bar: for one call, the ``tqdm`` of the module that
    defines the method is a ``tqdm(..., disable=True)``. No card, or one without that method or module
    name, is left as it is."""
    method = getattr(type(card), "set_widget_examples", None)
    module = sys.modules.get(getattr(method, "__module__", ""))
    if card is None or method is None or module is None or not callable(getattr(module, "tqdm", None)):
        return
    if "set_widget_examples" in vars(card):
        return  # already quiet for the next call

    def set_widget_examples(*args: Any, **kwargs: Any) -> Any:
        vars(card).pop("set_widget_examples", None)  # one call: later trainers decide again
        bar = getattr(module, "tqdm")  # noqa: B009 - a module's global, unknown to the type checker
        setattr(module, "tqdm", functools.partial(bar, disable=True))  # noqa: B010
        try:
            return method(card, *args, **kwargs)
        finally:
            setattr(module, "tqdm", bar)  # noqa: B010

    card.set_widget_examples = set_widget_examples


def global_batch_size(args: TrainingArguments) -> int:
    """Rows per optimizer step, the batch the in-batch negatives come from when gathered across
    processes: per-device batch x processes x accumulation steps."""
    return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps


def metrics_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """A Markdown table: one row per run (``"before"``, ``"after"``, ...), one column per metric, in the
    order of the first row's metrics."""
    labels = list(next(iter(rows.values()), {}))
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, metrics in rows.items():
        values = " | ".join(f"{metrics.get(label, float('nan')):.4f}" for label in labels)
        lines.append(f"| {name} | {values} |")
    return "\n".join(lines)


def add_card_section(model_dir: str | Path, title: str, body: str) -> Path:
    """Add a ``## title`` section to the card (``README.md``) saved in ``model_dir``, before its citations.

    Returns the card's path.
    """
    card = Path(model_dir) / "README.md"
    if not card.is_file():
        raise FileNotFoundError(
            f"{card} does not exist: call model.save_pretrained({str(model_dir)!r}) first."
        )
    text = card.read_text(encoding="utf-8")
    section = f"## {title}\n\n{body.strip()}\n\n"
    marker = "## Citation"
    text = text.replace(marker, section + marker, 1) if marker in text else text + "\n" + section
    card.write_text(text, encoding="utf-8")
    return card


@functools.cache
def project_url() -> str | None:
    """The project's ``Repository`` address (``[project.urls]`` in pyproject.toml, the one place it is written),
    read from the installed package's metadata; None where the package is not installed (a bare checkout)."""
    try:
        entries = importlib.metadata.metadata("st_cached_losses").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository" and url.strip():
            return url.strip()
    return None


def add_training_section(
    model_dir: str | Path,
    trainer: Any,
    metrics: Mapping[str, Mapping[str, float]] | None = None,
    trained_by: str | None = None,
    metrics_caption: str = "Evaluation",
) -> Path:
    """Add a "Cached loss training" section to the card saved in ``model_dir``.

    It says what caching changed and the model card cannot tell: the global batch the negatives came
    from, the processes, the encoder mini-batch, the optimizer steps and the training time, then an
    optional metrics table and the loss fields of [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] as JSON.

    Args:
        model_dir: where ``model.save_pretrained`` wrote the model and its card.
        trainer: the ``SentenceTransformerTrainer`` that trained it with a cached loss.
        metrics: optional ``{"before": {"MRR@10": ...}, "after": {...}}``, one table row per key.
        trained_by: what ran the training (a script's name), for the first sentence.
        metrics_caption: the sentence introducing the table (what was evaluated, on what).

    Returns:
        The card's path.
    """
    args, loss = trainer.args, trainer.loss
    train_runtime = next(
        (entry["train_runtime"] for entry in reversed(trainer.state.log_history) if "train_runtime" in entry),
        None,
    )
    timing = f"{train_runtime:.0f} s, " if train_runtime is not None else ""
    library = f"[st_cached_losses]({project_url()})" if project_url() else "st_cached_losses"
    by = f"`{trained_by}` ({library})" if trained_by else library
    body = (
        f"Trained by {by} with `{type(loss).__name__}`: {len(trainer.train_dataset)} training samples, batch "
        f"{global_batch_size(args)} ({args.world_size} process(es)), encoder mini-batch "
        f"{getattr(args, 'mini_batch_size', getattr(loss, 'mini_batch_size', '-'))}, "
        f"{trainer.state.global_step} optimizer steps ({timing}{os.cpu_count()} CPU cores)."
    )
    ours = isinstance(args, CachedLossArguments)
    if getattr(loss, "learnable", False) and hasattr(loss, "logit_bias"):  # SigLIP: its scale and bias
        scale_from = f"from {args.loss_scale:g} " if ours else ""
        bias_from = f"from {args.siglip_bias:g} " if ours else ""
        body += (
            f" The scale and the bias were learned: scale {scale_from}to {float(loss.scale):.4g}, bias "
            f"{bias_from}to {float(loss.bias):.4g} at the end of training; the loss parameters above list them "
            "as the trainer began."
        )
    elif getattr(loss, "learnable_scale", False):
        start = f"from {args.loss_scale:g} " if ours else ""
        scale = float(loss.scale)
        body += (
            f" The scale (1 / temperature) was learned: {start}to {scale:.4g} at the end of training "
            f"(temperature {1 / scale:.4g}); the loss parameters above list it as the trainer began."
        )
    if metrics:
        body += f" {metrics_caption}:\n\n" + metrics_table(metrics)
    if isinstance(args, CachedLossArguments):
        body += "\n\n" + loss_settings_block(args)
    return add_card_section(model_dir, SECTION_TITLE, body)


def card_loss_settings(args: CachedLossArguments) -> dict[str, Any]:
    """The loss settings the card lists: `loss_settings` with the scale the loss
    starts from (the loss's default when the fields leave it unset, not ``null``); ``temperature``,
    ``similarity``, ``symmetric``, ``directions`` and ``partition_mode`` only where they were given (else the
    loss's own default, which the card's loss parameters show); the negative bank's fields only where a bank
    is used (``negative_bank_size`` above 0), ``in_batch_negatives`` only where it is off."""
    settings = dict(args.loss_settings())
    if "scale" in settings:
        settings["scale"] = args.loss_scale
    for name in _LOSS_OWN_DEFAULT:  # None: the loss's own default, which its parameters above show
        if settings.get(name, 0) is None:
            del settings[name]
    if not settings.get("negative_bank_size"):  # no negative bank: its fields say nothing
        settings.pop("negative_bank_size", None)
        settings.pop("negative_bank_max_age", None)
    if settings.get("in_batch_negatives") is True:  # the default: in-batch negatives, as every loss has them
        del settings["in_batch_negatives"]
    return settings


#: fields whose None leaves the loss its own default (listed among the loss's parameters by sentence-transformers)
_LOSS_OWN_DEFAULT = ("temperature", "similarity", "symmetric", "directions", "partition_mode")


def loss_settings_block(args: CachedLossArguments) -> str:
    """The card's "Loss settings" paragraph: the arguments class and `card_loss_settings` as JSON (built
    from the arguments alone, so a test can compare a committed card with what the current code writes)."""
    settings = json.dumps(card_loss_settings(args), indent=4)
    return f"Loss settings (`{type(args).__name__}`):\n\n```json\n{settings}\n```"
