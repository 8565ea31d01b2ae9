"""Memory-efficient, exact contrastive losses for sentence-transformers."""

from st_cached_losses import functional
from st_cached_losses.callbacks import LossStateCallback
from st_cached_losses.losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.training_args import CachedLossTrainingArguments, build_loss

__version__ = "0.1.0"

__all__ = [
    "CachedCLIPLoss",
    "CachedLossTrainingArguments",
    "CachedMNRLoss",
    "CachedTiledLoss",
    "LossStateCallback",
    "__version__",
    "build_loss",
    "functional",
]
