"""The functional layer's checks of its arguments and inputs (the losses and the configuration call the
scalar ones too, so that one value is accepted or refused with the same words everywhere). Pure torch;
the engine's checks (mini-batch sizes, memory budgets) are in [`st_cached_losses.engine.checks`][st_cached_losses.engine.checks]."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "bias_value",
    "candidate_columns",
    "check_matmul_precision",
    "check_path",
    "check_positive_int",
    "nonfinite_columns",
    "nonfinite_error",
    "raise_if_nonfinite",
    "scale_value",
    "validate_inputs",
    "validate_keys",
]


def check_positive_int(name: str, value: int | None) -> int | None:
    """``value`` is None or a positive ``int`` (``True`` is refused: it is an int to Python only); returned."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=1024 or None.")
    return value


def check_path(name: str, value: object) -> str:
    """The loss stage's algorithm: ``"auto"``, ``"chunked"`` or ``"tiled"``; returned."""
    if value not in ("auto", "chunked", "tiled"):
        raise ValueError(f"{name} must be 'auto', 'chunked' or 'tiled', got {value!r}.")
    return str(value)


def check_matmul_precision(name: str, value: object) -> str | None:
    """The loss stage's product precision: None (torch's ``get_float32_matmul_precision()`` at the step),
    ``"highest"``, ``"high"`` or ``"medium"``; returned."""
    if value is not None and value not in ("highest", "high", "medium"):
        raise ValueError(
            f"{name} must be 'highest' (fp32 products), 'high' (TF32), 'medium' (bf16) or None (torch's "
            f"float32 matmul precision), got {value!r}."
        )
    return value


def scale_value(scale: float | Tensor, name: str = "scale") -> float:
    """The scale (1 / temperature) as a float: any real number (Python, NumPy) or one-element tensor,
    finite and positive. ``name``: the argument named in errors (``"temperature"`` checks a temperature
    by the same rules).

    Every refusal starts with sentence-transformers' sentence, ``"Scale must be a positive value."``
    (their tests match it; ``"Temperature must be a positive value."`` for a temperature), then says what
    was given."""
    example = "20.0" if name == "scale" else "0.05"
    other = "1 / temperature" if name == "scale" else "1 / scale"
    first = f"{name.capitalize()} must be a positive value."
    if isinstance(scale, (bool, str)):
        raise ValueError(f"{first} Got {scale!r}: {name} = {other} is a number, e.g. {example}.")
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{first} Got a tensor of shape {tuple(scale.shape)}: {name} = {other} is a float or a "
                "one-element tensor."
            )
        value = float(scale.detach())
    else:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            raise ValueError(
                f"{first} Got {scale!r}: {name} = {other} is a number, e.g. {example}."
            ) from None
    if not math.isfinite(value) or value <= 0:
        typical = "typical values are 20 to 100" if name == "scale" else f"e.g. {example}"
        raise ValueError(f"{first} Got {value}: {name} = {other} must be finite and positive; {typical}.")
    return value


def bias_value(bias: float | Tensor, name: str = "bias") -> float:
    """A bias (added to every logit, SigLIP's ``b``) as a float: any finite real number or one-element tensor."""
    if isinstance(bias, (bool, str)):
        raise ValueError(f"{name} must be a finite number, got {bias!r}; e.g. {name}=-10.0.")
    if isinstance(bias, Tensor):
        if bias.numel() != 1:
            raise ValueError(
                f"{name} must be a float or a one-element tensor, got a tensor of shape {tuple(bias.shape)}."
            )
        value = float(bias.detach())
    else:
        try:
            value = float(bias)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a finite number, got {bias!r}; e.g. {name}=-10.0.") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}; e.g. {name}=-10.0.")
    return value


def nonfinite_error(where: str) -> ValueError:
    """The one error for NaN / inf embeddings (they make the loss and every gradient NaN without any other
    symptom): the same words and advice whichever path finds them (one process, gathered, ring)."""
    return ValueError(
        f"non-finite (NaN or inf) values in {where}: the encoder diverged or its inputs are corrupt. Check the "
        "inputs, lower the learning rate, and under fp16 use a loss scaler or train in bf16 (fp16 overflows "
        "above 65504)."
    )


#: Column ``j`` sets bit ``min(j, _LAST_BIT)`` of the non-finite mask (the mask is one int64).
_LAST_BIT = 62


def nonfinite_columns(columns: Sequence[Tensor]) -> Tensor:
    """A 0-d int64 tensor on the columns' device, bit ``j`` set when ``columns[j]`` holds NaN or inf (from
    ``_LAST_BIT`` on, columns share the last bit). No host sync: it travels in the step's
    [`exchange_shapes`][st_cached_losses.functional.distributed.exchange_shapes] all-gather, so agreeing on finiteness costs no extra collective."""
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
    """Raise [`nonfinite_error`][st_cached_losses.functional.checks.nonfinite_error] naming every rank and column with NaN / inf embeddings, given every
    rank's [`nonfinite_columns`][st_cached_losses.functional.checks.nonfinite_columns] mask in rank order. Every rank calls it with the same masks (after
    [`exchange_shapes`][st_cached_losses.functional.distributed.exchange_shapes]) and raises the same error before any other collective of the
    step: none is left waiting on a peer that has already raised."""
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


def candidate_columns(candidates: Tensor | Sequence[Tensor]) -> list[Tensor]:
    if isinstance(candidates, Tensor):
        return [candidates]
    cols = list(candidates)
    if not cols:
        raise ValueError("candidates is empty: pass at least the positives, a (N, d) tensor.")
    return cols


def validate_inputs(
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    *,
    symmetric: bool,
    row_offset: int,
    check_finite: bool,
    tokens: bool = False,
    listed: bool = False,
) -> None:
    """The core's inputs: ``(rows, dim)`` embeddings, or with ``tokens`` (a score of packed rows) 3-D packed
    rows (multi-vector ``(rows, tokens, dim + 1)``, sparse ``(rows, k, 2)``) whose widths may differ. With
    ``listed``, the hard-negative columns (``cols[1:]``) may have any number of rows (lists of negatives)."""
    named = [("anchors", anchors)] + [(f"candidates[{k}]", c) for k, c in enumerate(cols)]
    if anchors_all is not None:
        named.append(("anchors_all", anchors_all))
    for name, t in named:
        if not isinstance(t, Tensor) or t.dim() != (3 if tokens else 2):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            if tokens:
                raise ValueError(
                    f"{name} must be a 3-D tensor of packed rows for this score: (rows, tokens, dim + 1) packed "
                    f"token embeddings for a multi-vector score (st_cached_losses.functional.representations.multi_vector."
                    f"pack_tokens), (rows, k, 2) for SparseDot (functional.representations.sparse.pack_rows); got {shape}."
                )
            raise ValueError(f"{name} must be a 2-D (rows, dim) tensor of embeddings, got {shape}.")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}.")
        if t.shape[0] == 0 and not (listed and name.startswith("candidates[") and name != "candidates[0]"):
            raise ValueError(
                f"{name} is empty (0 rows): the loss needs at least one pair; skip empty batches."
            )
        if t.device != anchors.device:
            raise ValueError(
                f"{name} is on {t.device} but anchors are on {anchors.device}; move them to one device."
            )
    dim = anchors.shape[-1]
    for name, t in named[1:]:
        if t.shape[-1] != dim:
            raise ValueError(
                f"{name} has embedding dim {t.shape[-1]} but anchors have {dim}: every column must come from "
                "encoders with the same output dimension."
            )
    n = cols[0].shape[0]
    for k, c in enumerate(cols[1:], start=1):
        if c.shape[0] != n and not listed:
            raise ValueError(
                f"candidates[{k}] has {c.shape[0]} rows but the positives have {n}: every candidate column "
                "(positives, then each hard-negative column) needs one row per positive."
            )
    b = anchors.shape[0]
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or not 0 <= row_offset <= n - b:
        raise ValueError(
            f"row_offset={row_offset!r} puts the positives of the {b} anchors at candidate rows "
            f"{row_offset}..{row_offset + b - 1 if isinstance(row_offset, int) else '?'}, outside the {n} candidate "
            "rows; pass the index of this process's first row within the gathered columns (0 on one process)."
        )
    if symmetric:
        if anchors_all is None and (n != b or row_offset != 0):
            raise ValueError(
                f"the symmetric loss scores every positive against every anchor, but {n} positives were given "
                f"for {b} anchors (row_offset={row_offset}); pass anchors_all=<the gathered (N, d) anchors>."
            )
        if anchors_all is not None and anchors_all.shape[0] != n:
            raise ValueError(
                f"anchors_all has {anchors_all.shape[0]} rows but there are {n} positives: gather anchors and "
                "positives the same way."
            )
    elif anchors_all is not None:
        raise ValueError("anchors_all is only used by the symmetric loss; pass symmetric=True or drop it.")
    if check_finite:
        for name, t in named:
            if not bool(torch.isfinite(t).all()):
                raise nonfinite_error(name)


def validate_keys(
    anchor_keys: Tensor | None,
    candidate_keys: Sequence[Tensor] | None,
    anchors_all_keys: Tensor | None,
    anchors: Tensor,
    cols: list[Tensor],
    anchors_all: Tensor | None,
    symmetric: bool,
) -> None:
    """Validate the duplicate keys against the embeddings they describe."""
    if candidate_keys is None:
        if anchor_keys is not None or anchors_all_keys is not None:
            raise ValueError(
                "anchor_keys / anchors_all_keys need candidate_keys (one key vector per column) too."
            )
        return
    cand = list(candidate_keys)
    if len(cand) != len(cols):
        raise ValueError(
            f"candidate_keys has {len(cand)} key vectors for {len(cols)} candidate columns; pass one per column."
        )
    named = [(f"candidate_keys[{k}]", key, c.shape[0]) for k, (key, c) in enumerate(zip(cand, cols))]
    n_pos = cols[0].shape[0]
    if symmetric and anchor_keys is None:
        raise ValueError(
            "the symmetric loss masks duplicate anchors too: pass anchor_keys with candidate_keys."
        )
    if anchor_keys is not None:
        named.append(("anchor_keys", anchor_keys, anchors.shape[0]))
        # pairs are compared by their anchors too, so every positive's anchor needs a key
        if anchors_all_keys is None and (anchors_all is not None or n_pos != anchors.shape[0]):
            raise ValueError(
                f"anchor_keys with {n_pos} gathered candidate rows: pass anchors_all_keys, the ({n_pos},) "
                "keys of the anchors of every positive (gathered like the candidates)."
            )
    if anchors_all_keys is not None:
        if anchor_keys is None:
            raise ValueError("anchors_all_keys needs anchor_keys (this process's anchors' keys) too.")
        named.append(("anchors_all_keys", anchors_all_keys, n_pos))
    for name, key, n in named:
        if not isinstance(key, Tensor) or key.dim() != 1 or key.shape[0] != n or key.is_floating_point():
            raise ValueError(
                f"{name} must be a 1-D integer tensor with {n} entries (one key per embedding row)."
            )
