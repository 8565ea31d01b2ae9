"""SPLADE's FLOPS regulariser (Paria et al., 2020), exactly, from column sums: its value and its gradient
wrt every row, without a graph and without a second pass over the batch.

For the ``N`` rows of one or more ``(n_k, V)`` blocks (the document columns of a batch, say):

```text
flops = sum_v mu_v ** 2,    mu = (1 / N) sum_i m_i w_i        (V,)
```

where ``m_i`` is 1, or with a ``threshold`` whether row ``i`` has more than ``threshold`` non-zero entries
(sentence-transformers' ``FlopsLoss(threshold=...)``, "FLOPS with l0 masking": a masked row still counts in
``N``). The mask is a step function of the row, so its gradient is zero almost everywhere, and:

```text
d flops / d w_i = 2 m_i mu / N                                (V,)
```

one outer product of the row mask with the column mean: nothing of the batch but its column sums is kept.

Across processes (``across_processes`` in a process group), the column sums and row counts are summed
over processes (one all-reduce of ``V + 1`` numbers), so every process returns the global value, and each
row's gradient times the number of processes: DDP's gradient average then gives the exact gradient of the
global regulariser, whatever each process's number of rows.

Blocks may also be packed sparse rows (``(n_k, k, 2)``, [`sparse`][st_cached_losses.functional.representations.sparse]: only the non-zero entries): the
column sums are then a scatter-add of the kept entries, the row counts those of the kept entries (only
zeros were dropped: the same counts), and the gradient is returned on each row's kept entries only,
packed like the block (index channel 0). That is the whole gradient wherever the encoder's Jacobian is
zero at an exactly-zero output (SPLADE's ``log1p(relu(.))`` pooling): the caller decides."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from st_cached_losses.functional.distributed import all_reduce_sum, is_distributed, world_size
from st_cached_losses.functional.precision import accumulation_dtype
from st_cached_losses.functional.representations.sparse import kept, packed_index, scatter_columns

__all__ = ["FlopsOutput", "flops_loss_and_grad", "row_mask"]


@dataclass
class FlopsOutput:
    """What [`flops_loss_and_grad`][st_cached_losses.functional.representations.flops.flops_loss_and_grad] returns."""

    loss: Tensor  #: 0-d, detached, ``grad_output * flops``; fp32 (fp64 for fp64 inputs)
    grads: list[Tensor]  #: per block ``(n_k, V)`` the gradient of ``loss`` (empty when not asked for)


def row_mask(block: Tensor, threshold: float | None) -> Tensor | None:
    """``(n,)`` 1 for the rows with more than ``threshold`` non-zero entries, else 0; None: no threshold.
    ``block``: ``(n, V)`` rows, or packed ``(n, k, 2)`` ones."""
    if threshold is None:
        return None
    nonzero = kept(block) if block.dim() == 3 else block != 0
    return (nonzero.sum(dim=1) > threshold).to(accumulation_dtype(block))


@torch.no_grad()
def flops_loss_and_grad(
    blocks: Sequence[Tensor],
    threshold: float | None = None,
    *,
    grad_output: float = 1.0,
    with_grad: bool = True,
    across_processes: bool = False,
    accumulate: Sequence[Tensor] | None = None,
    dim: int | None = None,
) -> FlopsOutput:
    """``grad_output * flops`` of the rows of ``blocks`` (each ``(n_k, V)``, read as one ``(N, V)`` batch)
    and its gradient wrt every block.

    Args:
        blocks: the rows, in any number of ``(n_k, V)`` pieces (never concatenated).
        threshold: count only the rows with more than this many non-zero entries (None: every row).
        grad_output: multiplies the value and the gradients (the regulariser's weight).
        with_grad: also the gradients; else the value only.
        across_processes: the regulariser of every process's rows together (see the module's notes);
            ignored outside a process group of more than one process.
        accumulate: per block a ``(n_k, V)`` tensor to add the gradient into, in place (then returned as
            ``grads``): no second ``(N, V)`` buffer; for packed blocks, a packed ``(n_k, k, 2)`` one.
        dim: ``V``, for packed blocks (``(n_k, k, 2)``: every block packed), whose gradient is packed too."""
    if not blocks:
        raise ValueError("flops_loss_and_grad needs at least one block of rows.")
    packed = blocks[0].dim() == 3
    if packed and (dim is None or any(b.dim() != 3 for b in blocks)):
        raise ValueError("packed blocks need dim (the vocabulary size V), and every block packed.")
    acc = accumulation_dtype(blocks[0])
    device = blocks[0].device
    masks = [row_mask(b, threshold) for b in blocks]
    width = dim if packed and dim is not None else blocks[0].shape[1]
    col_sum = torch.zeros(width, dtype=acc, device=device)  # (V,)
    for block, mask in zip(blocks, masks):
        b = block.to(acc)
        if packed:
            col_sum += scatter_columns(b, col_sum.shape[0], mask)  # the kept entries, scattered
            continue
        # (V,) = (n,) @ (n, V): a masked row adds nothing
        col_sum += b.sum(dim=0) if mask is None else mask @ b
    n = torch.tensor(float(sum(b.shape[0] for b in blocks)), dtype=acc, device=device)
    factor = 1.0
    if across_processes and is_distributed():
        # the global column sums and row count in one collective
        total = all_reduce_sum(torch.cat([col_sum, n.reshape(1)]), "all_reduce_flops")
        col_sum, n = total[:-1], total[-1]
        factor = float(world_size())  # DDP averages the processes' gradients
    mean = col_sum / n  # (V,); N == 0 gives NaN, as the mean of no rows does in sentence-transformers
    loss = (mean * mean).sum() * grad_output
    if not with_grad:
        return FlopsOutput(loss, [])
    scale = 2.0 * grad_output * factor / float(n)
    grads = []
    for k, (block, mask) in enumerate(zip(blocks, masks)):
        row = torch.ones(block.shape[0], dtype=acc, device=device) if mask is None else mask
        if packed:
            # (n_k, k) = (n_k, 1) * the column mean at each kept index (padding: 0)
            vals = (row * scale)[:, None] * mean[packed_index(block)] * kept(block)
            if accumulate is not None:
                accumulate[k][..., 1].add_(vals.to(accumulate[k].dtype))
                grads.append(accumulate[k])
            else:
                grads.append(torch.stack([torch.zeros_like(vals), vals], dim=-1).to(block.dtype))
            continue
        if accumulate is not None:
            out = accumulate[k]
            # in place, (n_k, V) += (n_k, 1) * (1, V): the outer product of the row mask with the column mean
            out.addcmul_(row.unsqueeze(1).to(out.dtype), mean.unsqueeze(0).to(out.dtype), value=scale)
            grads.append(out)
        else:
            # (n_k, V) = (n_k, 1) * (1, V)
            grads.append(((row * scale).unsqueeze(1) * mean.unsqueeze(0)).to(block.dtype))
    return FlopsOutput(loss, grads)
