"""Keys of a column's rows, to recognise identical inputs (false negatives) from their token ids, and keys of
tensors' entries (an image's pixels), bit for bit, to tell rows of one text with different images apart."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

__all__ = ["combine_hashes", "content_hashes", "input_hashes", "segment_hashes"]

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


#: elements per chunk of ``content_hashes`` (its int64 working copy: 128 MiB)
_CONTENT_CHUNK = 1 << 24
#: integer types of each element size, to read a tensor's bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def content_hashes(values: Tensor) -> Tensor:
    """A 64-bit key per entry (first dimension) of ``values``, of any dtype and shape: entries equal bit for bit
    (and of one size) give equal keys, others differ but by a 2**-64 chance. ``(n,)`` int64, on ``values``'
    device; computed chunk by chunk (a working copy of at most ``_CONTENT_CHUNK`` elements)."""
    n = values.shape[0]
    width = math.prod(values.shape[1:])
    flat = values.detach().reshape(n, width)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_floating_point():  # their bits (an integer type of the same size): equal values, equal keys
        flat = flat.contiguous().view(_BITS[flat.element_size()])
    weights = _weights(flat.shape[1]).to(flat.device)
    out = torch.empty(n, dtype=torch.long, device=flat.device)
    step = max(1, _CONTENT_CHUNK // max(flat.shape[1], 1))
    for i in range(0, n, step):
        # (rows, width) int64 products wrap around: a sum modulo 2**64, weighted per position
        out[i : i + step] = ((flat[i : i + step].long() + 1) * weights).sum(1)
    return out + _wrapped(width * _HASH_MULT)


def segment_hashes(hashes: Tensor, counts: Tensor) -> Tensor:
    """Keys of consecutive segments of entries: ``hashes`` ``(n,)`` int64, ``counts`` ``(B,)`` the entries of
    each segment, in order (``sum(counts) == n``). Equal sequences of keys give equal keys; a segment of no
    entry gets 0. ``(B,)`` int64, on ``hashes``' device."""
    counts = counts.to(hashes.device, torch.long)
    rows = torch.repeat_interleave(torch.arange(len(counts), device=hashes.device), counts)
    starts = counts.cumsum(0) - counts
    position = torch.arange(len(hashes), device=hashes.device) - starts[rows]
    longest = int(counts.max()) if len(counts) else 0
    weighted = (hashes + 1) * _weights(longest, salt=1).to(hashes.device)[position]
    out = torch.zeros(len(counts), dtype=torch.long, device=hashes.device).index_add_(0, rows, weighted)
    return out + counts * _HASH_MULT


def combine_hashes(first: Tensor, second: Tensor) -> Tensor:
    """One key of two keys each (elementwise, order matters): ``first * m + second`` in wrapping int64."""
    return first * _HASH_MULT + second.to(first.device)


@lru_cache(maxsize=16)
def _weights(length: int, salt: int = 0) -> Tensor:
    """``length`` odd pseudo-random int64 weights, the same on every process and machine (splitmix64 of the
    position, in wrapping int64 arithmetic), on the CPU."""
    z = torch.arange(length, dtype=torch.long) + _wrapped(0x9E3779B97F4A7C15 * (salt + 1))
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = (z ^ _shift_right(z, shift)) * _wrapped(mult)
    return (z ^ _shift_right(z, 31)) | 1


def _wrapped(value: int) -> int:
    """An unsigned 64-bit constant as the int64 of the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: Tensor, shift: int) -> Tensor:
    """The logical right shift of int64 bits (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)
