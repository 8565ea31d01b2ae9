"""Pure-torch loss math (InfoNCE, SigLIP's sigmoid loss): exact, chunked or tiled, with gradients wrt the
embeddings.

Imports nothing from sentence_transformers or accelerate."""

from st_cached_losses.functional.checks import check_positive_int, scale_value
from st_cached_losses.functional.infonce import (
    DEFAULT_MEMORY_BUDGET,
    Guide,
    InfoNCEOptions,
    InfoNCEOutput,
    LossPath,
    Similarity,
    infonce,
    infonce_loss_and_grad,
)
from st_cached_losses.functional.sigmoid import (
    SigmoidOptions,
    SigmoidOutput,
    sigmoid_loss,
    sigmoid_loss_and_grad,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Guide",
    "InfoNCEOptions",
    "InfoNCEOutput",
    "LossPath",
    "SigmoidOptions",
    "SigmoidOutput",
    "Similarity",
    "check_positive_int",
    "infonce",
    "infonce_loss_and_grad",
    "scale_value",
    "sigmoid_loss",
    "sigmoid_loss_and_grad",
]
