"""Where the rows are, decided once for every family: each row against its own candidates, this process's rows
against the columns it holds, against every process's columns all-gathered, or passed around a ring
([`placement`][st_cached_losses.functional.placement.placement]); and what every family needs of rows spread over
processes: every process's row count, agreed on in the step's first collective with the finiteness check
([`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]), every process's row count of each
list column ([`column_sizes`][st_cached_losses.functional.placement.column_sizes]), and the gradient of a tensor the loss
owns averaged over processes ([`mean_scale_grad`][st_cached_losses.functional.placement.mean_scale_grad]). The
path type ([`LossPath`][st_cached_losses.functional.placement.LossPath]) is here too: both families take it, and
across processes ``"tiled"`` is the ring ([`ring_path`][st_cached_losses.functional.placement.ring_path])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from st_cached_losses.functional.checks import nonfinite_columns, raise_if_nonfinite
from st_cached_losses.functional.distributed import (
    all_gather_rows,
    all_reduce_sum,
    exchange_tagged_shapes,
    is_distributed,
    world_size,
)

__all__ = [
    "LossPath",
    "Placement",
    "agree_on_sizes",
    "agree_on_sizes_and_tag",
    "column_sizes",
    "mean_scale_grad",
    "placement",
    "ring_path",
]

#: how the loss stage walks the logits: ``"chunked"`` holds a chunk of rows against every column, ``"tiled"``
#: one tile at a time (across processes: the ring), ``"auto"`` picks by the memory budget
LossPath = Literal["auto", "chunked", "tiled"]

#: where a process's rows meet their candidates (see [`placement`][st_cached_losses.functional.placement.placement])
Placement = Literal["own", "local", "gathered", "ring"]


def placement(sizes: Sequence[int] | None, *, ring: bool = False, in_batch: bool = True) -> Placement:
    """Where this process's rows meet their candidates, for every family (the InfoNCE drivers', the sigmoid
    loss's):

    * ``"own"``: each row against its own candidates only (``in_batch`` False: no in-batch negatives), on one
      process and across processes alike: nothing is gathered;
    * ``"local"``: this process's rows against the columns it holds (``sizes`` None: one process, or a loss
      that does not gather);
    * ``"gathered"``: against every process's columns, all-gathered once (``sizes``: every process's row count
      in rank order, [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]);
    * ``"ring"``: against every process's columns, passed around a ring of processes (``ring``); nothing is
      gathered."""
    if not in_batch:
        return "own"
    if sizes is None:
        return "local"
    return "ring" if ring else "gathered"


def ring_path(path: LossPath) -> bool:
    """Whether a loss's plan passes the columns around a ring across processes, rather than gathering them:
    ``path="tiled"`` (the ring is tiled by construction); every other path gathers."""
    return path == "tiled"


def agree_on_sizes(columns: Sequence[Tensor], across_processes: bool) -> list[int] | None:
    """Every process's row count (``across_processes`` in a group of more than one process), else None;
    on every path, the check that the embeddings ``columns`` (``K + 1`` of ``(b, d)``) are finite (NaN /
    inf give a NaN loss and gradients with no other symptom). Across processes the check rides on the
    shape exchange, the step's first collective, so every process raises the same ``ValueError`` naming
    the culprits before any other collective (a process raising alone would leave the others waiting;
    the ring would spread the NaN silently)."""
    return agree_on_sizes_and_tag(columns, across_processes)[0]


def agree_on_sizes_and_tag(
    columns: Sequence[Tensor], across_processes: bool, tag: int = 0
) -> tuple[list[int] | None, int]:
    """[`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes], and ``tag`` (bits saying what kind of
    batch this process has, e.g. lists) OR-ed over the processes, in the same collective (this process's own
    outside a group)."""
    flags = nonfinite_columns(columns)
    if not across_processes or not is_distributed():
        raise_if_nonfinite([int(flags)])
        return None, tag
    b, d = columns[0].shape[0], columns[0].shape[-1]
    sizes, all_flags, tags = exchange_tagged_shapes(
        b, [len(columns), d], columns[0].device, "the number of columns and the embedding dim", flags, tag
    )
    raise_if_nonfinite(all_flags)
    return sizes, tags


def mean_scale_grad(grad: Tensor | None, w: int | None = None) -> Tensor | None:
    """The gradient of a tensor the loss owns (a scale, a learnable activation's weights), of any shape,
    averaged over the ``w`` processes (default: the process group's size).

    Such a tensor lives outside DDP / FSDP / DeepSpeed (it belongs to the loss), so nobody else averages its
    gradient: without this, each process would step it by its own rows' gradient and the processes would
    drift apart. One all-reduce; nothing outside a process group of more than one process."""
    if grad is None or not is_distributed():
        return grad
    summed = all_reduce_sum(grad.reshape(-1).clone(), "all_reduce_scale")
    return summed.reshape(grad.shape) / (w or world_size())


def column_sizes(candidates: Sequence[Tensor], sizes: list[int], listed: bool) -> list[list[int]]:
    """Every process's row count of each candidate column: ``sizes`` for each, or with ``listed`` (lists of hard
    negatives, each process its own number) the hard-negative columns' own, agreed in one small all-gather."""
    if not listed or len(sizes) == 1:
        return [sizes] * len(candidates) if not listed else [sizes] + [[len(c)] for c in candidates[1:]]
    own = torch.tensor([[len(c) for c in candidates[1:]]], dtype=torch.long, device=candidates[0].device)
    every = all_gather_rows(own, [1] * len(sizes)).cpu()  # (W, K - 1)
    return [sizes] + [every[:, k].tolist() for k in range(len(candidates) - 1)]
