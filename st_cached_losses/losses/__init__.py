"""The losses layer: one thin ``nn.Module`` per cached loss, in sentence-transformers' own style and
positional order (settings readable and settable, orchestration only, no collective calls), and the
callback that checkpoints a loss's state with the trainer's (``callbacks``).

May import the engine and the functional layer (and ``st_cached_losses.distributed``), torch,
sentence-transformers and transformers; never the configuration or the demo.
"""

from st_cached_losses.losses._base import CachedInfoNCEBase, EngineOptions, LossStageOptions
from st_cached_losses.losses.cached_clip import CachedCLIPLoss
from st_cached_losses.losses.cached_cross_encoder import CachedCrossEncoderLoss
from st_cached_losses.losses.cached_distill import CachedDistillKLDivLoss, CachedMarginMSELoss
from st_cached_losses.losses.cached_gist import CachedGISTLoss
from st_cached_losses.losses.cached_mnr import CachedMNRLoss
from st_cached_losses.losses.cached_multi_vector import CachedMultiVectorLoss
from st_cached_losses.losses.cached_multi_vector_distill import (
    CachedMultiVectorDistillKLDivLoss,
    CachedMultiVectorMarginMSELoss,
)
from st_cached_losses.losses.cached_sparse import CachedSparseLoss
from st_cached_losses.losses.cached_tiled import CachedTiledLoss

__all__ = [
    "CachedCLIPLoss",
    "CachedCrossEncoderLoss",
    "CachedDistillKLDivLoss",
    "CachedGISTLoss",
    "CachedInfoNCEBase",
    "CachedMNRLoss",
    "CachedMarginMSELoss",
    "CachedMultiVectorDistillKLDivLoss",
    "CachedMultiVectorLoss",
    "CachedMultiVectorMarginMSELoss",
    "CachedSparseLoss",
    "CachedTiledLoss",
    "EngineOptions",
    "LossStageOptions",
]
