"""The argument and input checks of the whole package, in one place: the losses, the caching engine,
the functional core and the configuration all call these, so one value is accepted or refused with the
same words everywhere. Pure torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_positive_int",
    "nonfinite_columns",
    "nonfinite_error",
    "raise_if_nonfinite",
    "scale_value",
]


def check_positive_int(name: str, value: int | None) -> None:
    """``value`` is None or a positive ``int`` (``True`` is refused: it is an int to Python only)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=1024 or None.")


def scale_value(scale: float | Tensor) -> float:
    """The scale (1 / temperature) as a float: any real number (Python, NumPy) or one-element tensor,
    finite and positive."""
    if isinstance(scale, (bool, str)):
        raise ValueError(f"scale must be a positive number (1 / temperature), got {scale!r}; e.g. 20.0.")
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"scale must be a float or a 0-d tensor, got a tensor of shape {tuple(scale.shape)}."
            )
        value = float(scale.detach())
    else:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            raise ValueError(
                f"scale must be a positive number (1 / temperature), got {scale!r}; e.g. 20.0."
            ) from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"scale must be a finite positive number (1 / temperature), got {value}; typical values are 20 to 100."
        )
    return value


def nonfinite_error(where: str) -> ValueError:
    """The one error for NaN / inf embeddings, whichever path (one process, gathered, ring) finds them.

    A non-finite embedding makes the loss and every gradient NaN without any other symptom, so every
    path refuses it with the same words: a user gets the same advice on one process and on many.
    """
    return ValueError(
        f"non-finite (NaN or inf) values in {where}: the encoder diverged or its inputs are corrupt. Check the "
        "inputs, lower the learning rate, and under fp16 use a loss scaler or train in bf16 (fp16 overflows "
        "above 65504)."
    )


#: Column ``j`` sets bit ``min(j, _LAST_BIT)`` of the non-finite mask (the mask is one int64).
_LAST_BIT = 62


def nonfinite_columns(columns: Sequence[Tensor]) -> Tensor:
    """A 0-d int64 tensor on the columns' device: bit ``j`` is set when ``columns[j]`` holds NaN or inf
    (columns from ``_LAST_BIT`` on share the last bit).

    It stays on the device (no host sync) so that it can travel in :func:`exchange_shapes`' all-gather,
    which the step does anyway: agreeing on finiteness then costs no extra collective.
    """
    bad = torch.stack([~torch.isfinite(c).all() for c in columns]).long()
    low = bad[:_LAST_BIT]
    mask = (low << torch.arange(low.numel(), device=low.device)).sum()
    if bad.numel() > _LAST_BIT:
        mask = mask | (bad[_LAST_BIT:].amax() << _LAST_BIT)
    return mask


def _column_name(j: int) -> str:
    """A column of a loss's inputs: (anchors, positives, hard negatives...)."""
    if j >= _LAST_BIT:
        return f"{j} or later"
    return f"{j} ({'anchors' if j == 0 else 'positives' if j == 1 else f'hard negatives #{j - 1}'})"


def raise_if_nonfinite(masks: Sequence[int]) -> None:
    """Raise :func:`nonfinite_error` naming every rank and column
    with NaN / inf embeddings, given every rank's :func:`nonfinite_columns` mask in rank order.

    Every rank calls it with the same masks (after :func:`~st_cached_losses.distributed.exchange_shapes`), so every rank raises the same
    error at the same point, before any other collective of the step: none is left waiting on a peer
    that has already raised.
    """
    bad = {r: m for r, m in enumerate(masks) if m}
    if not bad:
        return
    parts = []
    for r, m in bad.items():
        cols = [_column_name(j) for j in range(_LAST_BIT + 1) if m >> j & 1]
        what = f"column{'s' if len(cols) > 1 else ''} {', '.join(cols)}"
        parts.append(what if len(masks) == 1 else f"rank {r}: {what}")
    if len(masks) == 1:
        raise nonfinite_error(f"{parts[0]} of the embeddings")
    raise nonfinite_error(
        f"the embeddings of {len(bad)} of {len(masks)} processes ({'; '.join(parts)}; every rank stops with "
        "this error)"
    )
