"""The losses layer: the template every cached loss is ([`CachedLoss`][st_cached_losses.losses.base.CachedLoss],
``base``), the stages it composes (``stages``), each loss's settings (one frozen object, ``settings``) and one
module per loss, in sentence-transformers' own style and positional order; the registry of the losses' names
(``registry``) and the callback that checkpoints a loss's state with the trainer's (``callbacks``).

May import the engine and the functional layer (and ``st_cached_losses.distributed``), torch,
sentence-transformers and transformers; never the configuration or the demo.
"""

# isort: off
# the registry lists the losses in the order their classes are defined: the order of these imports
from st_cached_losses.losses.base import CachedLoss, Stage, StageOutput, StepData
from st_cached_losses.losses.cached_mnr import CachedMNRLoss
from st_cached_losses.losses.cached_clip import CachedCLIPLoss
from st_cached_losses.losses.cached_tiled import CachedTiledLoss
from st_cached_losses.losses.cached_gist import CachedGISTLoss
from st_cached_losses.losses.cached_sparse import CachedSparseLoss
from st_cached_losses.losses.cached_multi_vector import CachedMultiVectorLoss
from st_cached_losses.losses.cached_cross_encoder import CachedCrossEncoderLoss
from st_cached_losses.losses.cached_distill import CachedDistillKLDivLoss, CachedMarginMSELoss
from st_cached_losses.losses.cached_multi_vector_distill import (
    CachedMultiVectorDistillKLDivLoss,
    CachedMultiVectorMarginMSELoss,
)
from st_cached_losses.losses.cached_siglip import CachedSigLIPLoss
from st_cached_losses.losses.cached_embed_distill import CachedEmbedDistillLoss
from st_cached_losses.losses.learnable_scale import LearnableScale
from st_cached_losses.losses.settings import EngineSettings, LossStageSettings, Settings, setting
# isort: on

#: the template's name in 0.2.0 (``losses/_base.py``), kept for ``isinstance`` checks: every cached loss
CachedInfoNCEBase = CachedLoss

__all__ = [
    "CachedCLIPLoss",
    "CachedCrossEncoderLoss",
    "CachedDistillKLDivLoss",
    "CachedEmbedDistillLoss",
    "CachedGISTLoss",
    "CachedLoss",
    "CachedMNRLoss",
    "CachedMarginMSELoss",
    "CachedMultiVectorDistillKLDivLoss",
    "CachedMultiVectorLoss",
    "CachedMultiVectorMarginMSELoss",
    "CachedSigLIPLoss",
    "CachedSparseLoss",
    "CachedTiledLoss",
    "EngineSettings",
    "LearnableScale",
    "LossStageSettings",
    "Settings",
    "Stage",
    "StageOutput",
    "StepData",
    "setting",
]
