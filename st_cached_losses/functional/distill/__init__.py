"""Distillation math: from a teacher's scores ([`scores`][st_cached_losses.functional.distill.scores]: KL,
MarginMSE), listwise over the whole batch ([`listwise`][st_cached_losses.functional.distill.listwise]) and from a
teacher's embeddings ([`embed`][st_cached_losses.functional.distill.embed]). Imports the shared floor only.

Re-exports what ``st_cached_losses.functional.distill`` (a module before the rooms) exported, defined in
[`scores`][st_cached_losses.functional.distill.scores]."""

from st_cached_losses.functional.distill.scores import (
    DistillObjective,
    DistillOutput,
    distill_loss_and_grad,
    margin_targets,
)

__all__ = ["DistillObjective", "DistillOutput", "distill_loss_and_grad", "margin_targets"]
