"""Re-export of [`st_cached_losses.config.model_card`][st_cached_losses.config.model_card] under its documented path."""

from st_cached_losses.config.model_card import (
    SECTION_TITLE,
    CachedLossCardCallback,
    add_card_section,
    add_training_section,
    global_batch_size,
    metrics_table,
)

__all__ = [
    "SECTION_TITLE",
    "CachedLossCardCallback",
    "add_card_section",
    "add_training_section",
    "global_batch_size",
    "metrics_table",
]
