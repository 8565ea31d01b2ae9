from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.cached_clip import CachedCLIPLoss
from st_cached_losses.losses.cached_mnr import CachedMNRLoss

__all__ = ["CachedCLIPLoss", "CachedInfoNCEBase", "CachedMNRLoss"]
