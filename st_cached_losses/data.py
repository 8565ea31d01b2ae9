"""Deprecated as a name of the library: the demo's data helper (the standard-library pairs), whose home is
[`st_cached_losses.demo.data`][st_cached_losses.demo.data]. It is not part of the library's API (the losses,
their arguments and the functional core); this module only keeps ``from st_cached_losses.data import
stdlib_pairs`` working for the examples (self-contained scripts, which import no demo module) and for scripts
written before. New code: ``from st_cached_losses.demo.data import stdlib_pairs``."""

from st_cached_losses.demo.data import SKIP_DIRS, split_pairs, stdlib_pairs

__all__ = ["SKIP_DIRS", "split_pairs", "stdlib_pairs"]
