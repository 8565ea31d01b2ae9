"""The collectives, moved to [`st_cached_losses.functional.distributed`][st_cached_losses.functional.distributed]; this path re-exports them
for the imports the changelog promised to keep (users' `STATS`, the tests' and benchmarks' collective counts)."""

import st_cached_losses.functional.distributed as _moved
from st_cached_losses.functional.distributed import *  # noqa: F403

__all__ = _moved.__all__
