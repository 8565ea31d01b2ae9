"""Memory-efficient, exact contrastive losses for sentence-transformers."""

from st_cached_losses import functional

__version__ = "0.1.0"

__all__ = ["__version__", "functional"]
