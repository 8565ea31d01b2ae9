"""Re-export of [`st_cached_losses.demo.data`][st_cached_losses.demo.data] (the standard-library pairs) under its documented path."""

from st_cached_losses.demo.data import SKIP_DIRS, split_pairs, stdlib_pairs

__all__ = ["SKIP_DIRS", "split_pairs", "stdlib_pairs"]
