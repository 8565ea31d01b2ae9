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
    from the token ids rather than the embeddings, which differ under dropout. ``(B,)`` int64.
    """
    ids = features.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("mask_duplicates needs token ids (a 2-D input_ids) to recognise identical inputs.")
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
    seq = tokens.shape[1]
    powers = torch.empty(seq, dtype=torch.long, device=ids.device)
    acc = 1
    for t in range(seq):
        powers[t] = acc - (1 << 64) if acc >= (1 << 63) else acc
        acc = (acc * _HASH_MULT) % (1 << 64)
    return ((tokens + 2) * powers).sum(1)
