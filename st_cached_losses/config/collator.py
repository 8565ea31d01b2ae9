"""The data collator for list-valued columns: sentence-transformers' own collator, whose preprocessing of a column
also takes rows that hold a list of texts (mined hard negatives, each row its own number, empty allowed) and rows
that hold ``None`` (``negative_1 ... negative_K`` where a row has fewer).

sentence-transformers 6.3's collator hands each column's values to ``model.preprocess`` as they are: a list of
two texts is tokenised as a text *pair* (one sequence, silently), a list of another length and ``None`` are
refused. [`ListDataCollator`][st_cached_losses.config.collator.ListDataCollator] is that collator with one change:
such a column is preprocessed as its existing texts, flattened row after row, and its per-row counts are added
to its features (``<column>_row_counts``, ``(B,)``; [`ROW_COUNTS`][st_cached_losses.engine.lists.ROW_COUNTS]),
which the trainer hands to the loss with the column's other features. A column of one text per row is
preprocessed as before, untouched."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

from st_cached_losses.engine.lists import ROW_COUNTS

__all__ = ["ListDataCollator", "ListPreprocess"]


class ListPreprocess:
    """A column's preprocessing (``model.preprocess``) that also takes list-valued rows and ``None``: the texts
    that exist are preprocessed together, row after row, and ``row_counts`` ``(B,)`` says how many each row
    has. A column with none at all gives its inputs' keys with 0 rows (so that the loss still sees the
    column)."""

    def __init__(self, preprocess: Callable[..., dict[str, Any]]) -> None:
        self.preprocess = preprocess

    def __call__(self, inputs: Sequence[Any], **kwargs: Any) -> dict[str, Any]:
        if not any(x is None or isinstance(x, list) for x in inputs):
            return self.preprocess(inputs, **kwargs)
        rows = [[] if x is None else list(x) if isinstance(x, list) else [x] for x in inputs]
        for i, row in enumerate(rows):
            if any(not isinstance(t, str) for t in row):
                raise ValueError(
                    f"a list-valued column's row {i} holds {[type(t).__name__ for t in row]}: each row of such a "
                    "column must be a list of texts (or None), e.g. the mined hard negatives of its anchor."
                )
        flat = [t for row in rows for t in row]
        counts = torch.tensor([len(row) for row in rows], dtype=torch.long)
        if flat:
            out = dict(self.preprocess(flat, **kwargs))
        else:  # the column's keys with no rows: one empty text, cut away
            out = {
                k: v[:0] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
                for k, v in self.preprocess([""], **kwargs).items()
            }
        out[ROW_COUNTS] = counts
        return out


@dataclass
class ListDataCollator(SentenceTransformerDataCollator):
    """sentence-transformers' data collator that also takes list-valued columns and ``None`` values (see the
    module's notes); give it to the stock trainer:

    ```python
    collator = ListDataCollator(preprocess_fn=model.preprocess)
    trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss, data_collator=collator)
    ```

    Its arguments are sentence-transformers' collator's (``prompts``, ``router_mapping``, ``max_length`` as the
    trainer's arguments would give them). A batch of one text per row in every column is collated exactly as
    sentence-transformers collates it."""

    def __post_init__(self) -> None:
        if not isinstance(self.preprocess_fn, ListPreprocess):
            self.preprocess_fn = ListPreprocess(self.preprocess_fn)
