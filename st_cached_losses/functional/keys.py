"""Keys of a column's rows, to recognise identical inputs (false negatives) from their token ids."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["input_hashes"]

_HASH_MULT = 0x5851F42D4C957F2D  # odd 64-bit multiplier (as in PCG); int64 products wrap around


def input_hashes(features: dict[str, Any]) -> Tensor:
    """A 64-bit key per row of a column's inputs: equal token ids (ignoring padding) give equal keys.

    Used to mask false negatives (the same text as a row's positive, elsewhere in the batch); computed
    from the token ids rather than the embeddings, which differ under dropout. A padded column
    (``input_ids`` ``(B, T)``, padding where ``attention_mask`` is 0) or a flattened one (every row's
    ids concatenated, ``input_ids`` ``(1, total)``, rows delimited by ``cu_seq_lens_q`` ``(B + 1,)``):
    one text has the same key in either. ``(B,)`` int64."""
    ids = features.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("mask_duplicates needs token ids (a 2-D input_ids) to recognise identical inputs.")
    bounds = features.get("cu_seq_lens_q")
    if isinstance(bounds, Tensor) and bounds.dim() == 1:
        return _flattened_hashes(ids, bounds)
    mask = features.get("attention_mask")
    valid = (
        mask.ne(0)
        if isinstance(mask, Tensor) and mask.shape == ids.shape
        else torch.ones_like(ids, dtype=torch.bool)
    )
    # left-align each row's valid tokens so left- and right-padded copies of one text agree
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    # padding becomes -2, so that (token + 2) is 0 there and the key does not depend on the padded length
    tokens = torch.gather(ids.long(), 1, order).masked_fill(~torch.gather(valid, 1, order), -2)
    return ((tokens + 2) * _powers(tokens.shape[1], ids.device)).sum(1)


def _flattened_hashes(ids: Tensor, bounds: Tensor) -> Tensor:
    """[`input_hashes`][st_cached_losses.functional.keys.input_hashes] of a flattened column: each token weighted by the power of its position
    within its row, summed per row (what the padded sum gives: its padding adds 0)."""
    bounds = bounds.to(ids.device, torch.long)
    lengths = bounds[1:] - bounds[:-1]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
    tokens = ids.reshape(-1).long()
    position = torch.arange(tokens.numel(), device=ids.device) - bounds[:-1][rows]
    longest = int(lengths.max()) if len(lengths) else 0
    weighted = (tokens + 2) * _powers(longest, ids.device)[position]
    return torch.zeros(len(lengths), dtype=torch.long, device=ids.device).index_add_(0, rows, weighted)


def _powers(length: int, device: torch.device) -> Tensor:
    """``_HASH_MULT ** t`` modulo 2**64 as wrapped int64, for positions ``t < length``: ``(length,)``."""
    powers = torch.empty(length, dtype=torch.long, device=device)
    acc = 1
    for t in range(length):
        powers[t] = acc - (1 << 64) if acc >= (1 << 63) else acc
        acc = (acc * _HASH_MULT) % (1 << 64)
    return powers
