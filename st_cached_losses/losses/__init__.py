from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.cached_clip import CachedCLIPLoss
from st_cached_losses.losses.cached_gist import CachedGISTLoss
from st_cached_losses.losses.cached_mnr import CachedMNRLoss
from st_cached_losses.losses.cached_tiled import CachedTiledLoss

__all__ = ["CachedCLIPLoss", "CachedGISTLoss", "CachedInfoNCEBase", "CachedMNRLoss", "CachedTiledLoss"]
