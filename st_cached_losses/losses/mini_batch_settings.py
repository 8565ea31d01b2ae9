"""The encoder mini-batch settings every cached loss keeps on its engine (``loss.cache``): rows or a token
budget per mini-batch, and the memory budget that ``"auto"`` sizes them to. Shared by the embedding losses
(:class:`~st_cached_losses.losses.hyperparameters.CachedLossHyperparameters`) and the reranker loss."""

from __future__ import annotations

from st_cached_losses.engine.checks import check_mini_batch_num_tokens, check_mini_batch_size
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.losses.settings import SPECS

__all__ = ["MiniBatchSettings"]


class MiniBatchSettings:
    """Readable and assignable mini-batch sizes, checked as the constructors check them; a change forgets
    what ``"auto"`` chose, so the next step sizes the mini-batches again."""

    cache: GradCache

    @property
    def mini_batch_size(self) -> int | str:
        """Rows per encoder mini-batch, or ``"auto"``: the largest that fits ``mini_batch_memory_budget``,
        sized at the first step and again for longer rows (what it chose: ``loss.cache.auto_size``)."""
        return self.cache.mini_batch_size

    @mini_batch_size.setter
    def mini_batch_size(self, value: int | str) -> None:
        check_mini_batch_size(value)
        if value != self.cache.mini_batch_size:
            self.cache.auto_size = None  # sized again at the next step if "auto"
        self.cache.mini_batch_size = value

    @property
    def mini_batch_num_tokens(self) -> int | str | None:
        """The budget of real tokens per mini-batch, or None (``mini_batch_size`` rows per mini-batch)."""
        return self.cache.mini_batch_num_tokens

    @mini_batch_num_tokens.setter
    def mini_batch_num_tokens(self, value: int | str | None) -> None:
        check_mini_batch_num_tokens(value)
        if value != self.cache.mini_batch_num_tokens:
            self.cache.auto_size = None
        self.cache.mini_batch_num_tokens = value

    @property
    def mini_batch_memory_budget(self) -> int | None:
        """Bytes of activations one encoder mini-batch may take, for ``mini_batch_size="auto"`` (or
        ``mini_batch_num_tokens="auto"``); set in bytes or as a size such as ``"2GB"``."""
        return self.cache.mini_batch_memory_budget

    @mini_batch_memory_budget.setter
    def mini_batch_memory_budget(self, value: int | str | None) -> None:
        parsed = SPECS["mini_batch_memory_budget"].check("mini_batch_memory_budget", value)
        if parsed != self.cache.mini_batch_memory_budget:
            self.cache.auto_size = None
        self.cache.mini_batch_memory_budget = parsed
