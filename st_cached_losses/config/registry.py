"""The loss registry: which cached loss each name (or alias) means, the defaults the configuration fills in,
and the "did you mean" hint every configuration error uses.

The bottom of the configuration layer: it imports the losses only, so that the arguments class
(:mod:`st_cached_losses.config.training_args`), the factory (:mod:`st_cached_losses.config.factory`) and the
parser (:mod:`st_cached_losses.config.cli`) share one table.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from st_cached_losses.losses import (
    CachedCLIPLoss,
    CachedGISTLoss,
    CachedInfoNCEBase,
    CachedMNRLoss,
    CachedTiledLoss,
)

__all__ = [
    "DEFAULT_GIST_TEMPERATURE",
    "DEFAULT_SCALE",
    "DEFAULT_SCALE_LEARNING_RATE",
    "LOSSES",
    "LOSS_ALIASES",
    "closest_name_hint",
]

#: canonical loss name -> class
LOSSES: dict[str, type[CachedInfoNCEBase]] = {
    "mnr": CachedMNRLoss,
    "clip": CachedCLIPLoss,
    "tiled": CachedTiledLoss,
    "gist": CachedGISTLoss,
}
#: every accepted spelling (case-insensitive) -> canonical name
LOSS_ALIASES: dict[str, str] = {
    **{name: name for name in LOSSES},
    **{cls.__name__.lower(): name for name, cls in LOSSES.items()},
}
DEFAULT_SCALE = 20.0
#: GISTEmbedLoss's default temperature (scale 100), used by loss='gist' when neither scale nor temperature is given
DEFAULT_GIST_TEMPERATURE = 0.01
#: the default learning rate of a learnable scale (its own optimizer group, see ``scale_learning_rate``)
DEFAULT_SCALE_LEARNING_RATE = 1e-2


def closest_name_hint(word: str, choices: Sequence[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to a misspelt ``word``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
