"""What a call of the loss stage is given besides the embeddings: a guide model's embeddings (GIST), the
duplicate keys, and :class:`LossSpec`, the options the drivers read, fixed for a call."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from st_cached_losses.functional._kernels import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.terms import PairKeys, TermSet

__all__ = ["Guide", "Keys", "LossSpec"]


@dataclass
class Guide:
    """A guide model's embeddings of the same batch (GIST): ``anchors`` ``(B, g)`` of this process,
    ``candidates`` one ``(N, g)`` per column, laid out like the loss's candidates (gathered)."""

    anchors: Tensor
    candidates: list[Tensor]


@dataclass
class Keys:
    """Duplicate keys of a call (``mask_duplicates``): ``anchors`` ``(B,)`` this process's anchors' (or
    None: pairs are then compared by their positives only), ``candidates`` one ``(N,)`` per column, and
    ``anchors_all`` ``(N,)`` every positive's anchor's (across processes; None on one process)."""

    anchors: Tensor | None
    candidates: list[Tensor]
    anchors_all: Tensor | None = None

    def sources(self, row_offset: int, b: int) -> dict[str, PairKeys]:
        """The keys of every row and column source (see :class:`~.terms.PairKeys`)."""
        pos = self.candidates[0]
        pair_anchor = self.anchors_all if self.anchors_all is not None else self.anchors
        rows = PairKeys(pos[row_offset : row_offset + b], self.anchors)
        out = {"q": rows, "d": rows, "q_local": rows, "q_all": PairKeys(pos, pair_anchor)}
        out["c0"] = out["q_all"]
        out.update({f"c{k}": PairKeys(c, pairs=False) for k, c in enumerate(self.candidates) if k > 0})
        return out


@dataclass(frozen=True)
class LossSpec:
    """Everything a driver needs besides the embeddings and the scale, fixed for a call: the loss's
    terms and score, where this process's positives are (``row_offset``), the block plan's inputs, and the
    guide's embeddings and duplicate keys when the loss uses them."""

    terms: TermSet
    score: Score
    row_offset: int = 0
    path: str = "auto"
    chunk_size: int | None = None
    tile_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    guide: Guide | None = None
    keys: Keys | None = None
