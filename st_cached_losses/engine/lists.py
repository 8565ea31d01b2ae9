"""List-valued columns as the engine sees them: a column whose rows each hold a list of texts (a ``negative``
column of mined hard negatives, each row its own number, empty allowed), or a column with ``None`` where a row
has no text (``negative_1 ... negative_K`` padded with ``None``), comes from the collator
(``st_cached_losses.config.collator.ListDataCollator``) as an ordinary column of the texts that exist,
flattened row after row, plus its per-row counts under [`ROW_COUNTS`][st_cached_losses.engine.lists.ROW_COUNTS]
``(B,)``. The engine embeds such a column as any other (its own number of rows; a text that does not exist
costs no forward); the counts say which row each text belongs to, for the losses that need it. No model is
run here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROW_COUNTS", "ListColumns", "check_list_columns", "every_column", "list_columns", "row_counts"]

#: the key of a list-valued column's per-row text counts ``(B,)`` (int64) in its features, after the
#: column's name in the collated batch (``negative_row_counts``), as sentence-transformers' trainer splits it
ROW_COUNTS = "row_counts"


def row_counts(features: Any) -> Tensor | None:
    """A column's per-row text counts ``(B,)`` if it is list-valued, else None."""
    counts = features.get(ROW_COUNTS) if isinstance(features, dict) else None
    return counts if isinstance(counts, Tensor) else None


@dataclass
class ListColumns:
    """A batch's columns with their list-valued ones resolved ([`list_columns`][st_cached_losses.engine.lists.list_columns])."""

    #: what the engine embeds: each kept column's features without its counts
    columns: list[Any]
    #: per kept column, its per-row counts ``(B,)`` (int64, on the CPU), None for one text per row
    counts: list[Tensor | None]
    #: each kept column's index among the given ones
    kept: list[int]
    #: how many columns were given
    given: int

    @property
    def listed(self) -> bool:
        """Whether a column has rows with other than one text (a list column left out included)."""
        return any(c is not None for c in self.counts) or len(self.kept) != self.given


def list_columns(inputs: Sequence[Any]) -> ListColumns:
    """Resolve the list-valued columns of ``inputs`` (the features of each column, as the trainer gives them).

    A list-valued column whose every row holds exactly one text is an ordinary column (its counts dropped, so
    the batch takes the path of fixed columns). A list column with no text in any row is left out: it costs no
    forward, and holds no candidate."""
    columns: list[Any] = []
    counts: list[Tensor | None] = []
    kept: list[int] = []
    for k, features in enumerate(inputs):
        c = row_counts(features)
        if c is None:
            columns.append(features)
            counts.append(None)
            kept.append(k)
            continue
        c = c.detach().to("cpu", torch.long)
        if int(c.sum()) == 0:
            continue
        columns.append({key: value for key, value in features.items() if key != ROW_COUNTS})
        counts.append(None if bool((c == 1).all()) else c)
        kept.append(k)
    return ListColumns(columns, counts, kept, len(inputs))


def check_list_columns(
    sizes: Sequence[int], lists: ListColumns, owner: str, one_positive: str | None = None
) -> None:
    """Refuse a batch with lists whose columns a loss of (anchor, positive[, negatives...]) cannot read, before
    any forward: ``sizes`` the rows of each kept column; the anchors (column 0) one text per row, every row at
    least one positive (column 1), and each column as many texts as its per-row counts say. ``one_positive``:
    the loss takes one positive per row, and this says why and what to do instead (a positive column of lists
    is refused with it)."""
    if lists.kept[:2] != [0, 1] or lists.counts[0] is not None:
        raise ValueError(
            f"{owner} takes lists (or None values) in its positive and hard-negative columns only: the "
            "anchors (column 0) must hold one text per row, and every row at least one positive (column 1)."
        )
    positives = lists.counts[1]
    if positives is not None and bool((positives < 1).any()):
        raise ValueError(
            f"{owner}: rows {(positives < 1).nonzero().flatten().tolist()} have no positive: every anchor needs "
            "at least one positive (column 1)."
        )
    if positives is not None and one_positive is not None:
        raise ValueError(
            f"{owner} takes one positive per row: the positive column holds lists. {one_positive}"
        )
    b = sizes[0]
    for k, (n, counts) in enumerate(zip(sizes, lists.counts)):
        expected = b if counts is None else int(counts.sum())
        if (counts is not None and len(counts) != b) or n != expected:
            raise ValueError(
                f"{owner}: column {lists.kept[k]} has {n} texts for {b} anchors (its per-row counts say "
                f"{expected}): every hard-negative column needs one entry (a list, or None) per anchor."
            )


def every_column(
    embeddings: Sequence[Tensor], kept: Sequence[int] | None, given: int
) -> tuple[list[Tensor], list[int] | None]:
    """A step's embedded columns with a ``(0, ...)`` one in place of each list column that was not embedded
    (no row of this process holds a text of it: [`list_columns`][st_cached_losses.engine.lists.list_columns]
    left it out), so that every process has every column across processes; and the embedded columns'
    indices among them (None: every column was embedded)."""
    if kept is None or len(kept) == given:
        return list(embeddings), None
    like = embeddings[0]
    full = [like.new_zeros((0, *like.shape[1:])) for _ in range(given)]
    for k, e in zip(kept, embeddings):
        full[k] = e
    return full, list(kept)
