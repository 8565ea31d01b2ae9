"""Configure a cached loss through TrainingArguments (command line, JSON or YAML via HfArgumentParser).

``CachedLossTrainingArguments`` adds the loss choice and every loss hyperparameter to
sentence-transformers' ``SentenceTransformerTrainingArguments``; invalid combinations fail when the
arguments are built, naming the field, before any training starts. ``build_loss(model, args)`` builds
the loss. The settings are saved with every checkpoint (they are part of the TrainingArguments).
"""

from dataclasses import dataclass, field
from typing import Optional  # HfArgumentParser needs runtime-resolvable annotations

from sentence_transformers import SentenceTransformerTrainingArguments
from torch import nn

from st_cached_losses.losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss

LOSS_NAMES = {
    "mnr": CachedMNRLoss,
    "cachedmnrloss": CachedMNRLoss,
    "clip": CachedCLIPLoss,
    "cachedcliploss": CachedCLIPLoss,
    "tiled": CachedTiledLoss,
    "cachedtiledloss": CachedTiledLoss,
}


@dataclass
class CachedLossTrainingArguments(SentenceTransformerTrainingArguments):
    """``SentenceTransformerTrainingArguments`` plus the cached loss and its hyperparameters."""

    loss: str = field(
        default="mnr",
        metadata={
            "help": "Which cached loss: 'mnr' (CachedMNRLoss), 'clip' (CachedCLIPLoss) or 'tiled' (CachedTiledLoss)."
        },
    )
    scale: Optional[float] = field(  # noqa: UP045
        default=None, metadata={"help": "1 / temperature (default 20). Give scale or temperature, not both."}
    )
    temperature: Optional[float] = field(  # noqa: UP045
        default=None,
        metadata={"help": "Softmax temperature (= 1 / scale). Give scale or temperature, not both."},
    )
    learnable_scale: bool = field(
        default=False, metadata={"help": "Learn the scale (as log(scale)); 'clip' and 'tiled' only."}
    )
    max_scale: float = field(default=100.0, metadata={"help": "Clamp of a learnable scale."})
    similarity: str = field(default="cosine", metadata={"help": "'cosine' or 'dot'."})
    mini_batch_size: int = field(
        default=32, metadata={"help": "Rows per encoder forward: sets the memory, not the result."}
    )
    mini_batch_num_tokens: Optional[int] = field(  # noqa: UP045
        default=None,
        metadata={"help": "Token budget per encoder mini-batch (rows x padded length), optional."},
    )
    tile_size: Optional[int] = field(  # noqa: UP045
        default=None,
        metadata={"help": "Logit tile side of the 'tiled' loss (default from its memory budget)."},
    )
    symmetric: Optional[bool] = field(  # noqa: UP045
        default=None, metadata={"help": "'tiled' only: also the positive -> anchor direction (CLIP-style)."}
    )
    gather_across_devices: bool = field(
        default=False,
        metadata={"help": "Use every process's candidates as negatives (multi-GPU / multi-node)."},
    )
    mask_duplicates: bool = field(
        default=False,
        metadata={
            "help": "Drop candidates whose text equals a row's positive from its negatives, across processes."
        },
    )
    loss_show_progress_bar: bool = field(
        default=False, metadata={"help": "Progress bars over the loss's encoder mini-batches."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        key = self.loss.lower()
        if key not in LOSS_NAMES:
            raise ValueError(
                f"loss={self.loss!r} is not a cached loss; choose one of 'mnr', 'clip' or 'tiled'."
            )
        self.loss = {CachedMNRLoss: "mnr", CachedCLIPLoss: "clip", CachedTiledLoss: "tiled"}[LOSS_NAMES[key]]
        if (
            self.scale is not None
            and self.temperature is not None
            and abs(self.scale * self.temperature - 1.0) > 1e-6
        ):
            raise ValueError(
                f"scale={self.scale} and temperature={self.temperature} disagree (scale = 1 / temperature); give one."
            )
        for name in ("scale", "temperature", "max_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}.")
        if self.learnable_scale and self.loss == "mnr":
            raise ValueError("learnable_scale is supported by loss='clip' or loss='tiled', not loss='mnr'.")
        if self.symmetric is not None and self.loss != "tiled":
            raise ValueError(
                f"symmetric applies to loss='tiled' only ('mnr' is one-directional, 'clip' always symmetric); "
                f"got loss={self.loss!r}."
            )
        if self.tile_size is not None and self.loss != "tiled":
            raise ValueError(f"tile_size applies to loss='tiled' only, got loss={self.loss!r}.")
        for name in ("mini_batch_size", "mini_batch_num_tokens", "tile_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if self.similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be 'cosine' or 'dot', got {self.similarity!r}.")

    @property
    def loss_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        if self.temperature is not None:
            return 1.0 / self.temperature
        return 20.0


def build_loss(model: nn.Module, args: CachedLossTrainingArguments) -> nn.Module:
    """The loss ``args`` describe, for ``model``."""
    common = {
        "scale": args.loss_scale,
        "similarity_fct": args.similarity,
        "mini_batch_size": args.mini_batch_size,
        "mini_batch_num_tokens": args.mini_batch_num_tokens,
        "gather_across_devices": args.gather_across_devices,
        "show_progress_bar": args.loss_show_progress_bar,
        "mask_duplicates": args.mask_duplicates,
    }
    if args.loss == "mnr":
        return CachedMNRLoss(model, **common)
    if args.loss == "clip":
        return CachedCLIPLoss(model, learnable_scale=args.learnable_scale, max_scale=args.max_scale, **common)
    return CachedTiledLoss(
        model,
        symmetric=bool(args.symmetric),
        tile_size=args.tile_size,
        learnable_scale=args.learnable_scale,
        max_scale=args.max_scale,
        **common,
    )
