"""Listwise distillation over the whole batch: the KL divergence of the student's softmax over every candidate
of the (global) batch from the teacher's, both computed from embeddings, in tiles with running log-sum-exps.

For anchor ``i`` and every candidate ``j`` (every candidate column's rows; across processes every process's),
with unit rows ``q``, ``c`` (the student's) and ``u``, ``v`` (the teacher's, of any width):

```text
z_ij = scale * <q_i, c_j>          y_ij = teacher_scale * <u_i, v_j>
loss_i = KL(softmax_j(y_i) || softmax_j(z_i))
       = sum_j p_ij (y_ij - z_ij) - lse_j(y_ij) + lse_j(z_ij)        p = softmax(y)
```

and the loss is the mean of ``loss_i`` over the anchors. Its gradient wrt the student's logits is
``softmax(z) - softmax(y)`` (the teacher's side has none), so per anchor tile two sweeps over the candidate
tiles suffice: the first keeps a running max and sum of both softmaxes (their log-sum-exps), the second
recomputes each tile's log-probabilities from those statistics and accumulates the loss (each
log-probability formed before the difference, as a dense ``log_softmax`` would) and the gradients. Nothing of size ``B x C`` is kept: one ``(tile, tile)`` block of each
softmax at a time. Products, statistics and gradients are fp32 (fp64 for fp64 inputs).

Across processes each process's anchors are scored against every process's candidates: gathered once (the
student's and the teacher's), or passed around a ring of processes block by block, twice (the statistics, then
the loss and the gradients, which travel with their block and come home summed). Each process returns
``W / B_global`` times its anchors' summed loss (DDP's gradient average is then the global gradient), and the
gradients wrt the candidates are summed over the processes before each keeps its own (the gather's true
backward)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.distributed import all_gather_rows, all_reduce_sum, own_rows, ring_exchange
from st_cached_losses.functional.precision import accumulation_dtype, fp32_loss_stage

__all__ = ["ListwiseOutput", "listwise_kl_loss_and_grad", "listwise_tile_size"]


@dataclass
class ListwiseOutput:
    """What [`listwise_kl_loss_and_grad`][st_cached_losses.functional.distill.listwise.listwise_kl_loss_and_grad]
    returns."""

    #: 0-d, detached: the loss (this process's share of the global mean across processes), fp32 (fp64 for fp64
    #: inputs)
    loss: Tensor
    #: with ``with_grad``, the gradient wrt ``anchors`` ``(B, d_s)``
    grad_anchors: Tensor | None = None
    #: with ``with_grad``, the gradient wrt ``candidates`` ``(C, d_s)`` (this process's rows)
    grad_candidates: Tensor | None = None


def listwise_tile_size(memory_budget: int) -> int:
    """The side of the square logit tiles that ``memory_budget`` bytes hold: about six fp32 ``(t, t)`` blocks
    (both softmaxes' logits and probabilities and their difference), at most 2048."""
    return max(1, min(int(math.sqrt(max(memory_budget, 1) / (4 * 6))), 2048))


def _unit(x: Tensor, dtype: torch.dtype, with_grad: bool) -> tuple[Tensor, Tensor]:
    """A leaf of ``x`` in ``dtype`` and its unit rows (with a graph to the leaf where ``with_grad``)."""
    leaf = x.detach().to(dtype).requires_grad_(with_grad)
    with torch.enable_grad() if with_grad else torch.no_grad():
        return leaf, F.normalize(leaf, dim=-1)


class _Tiles:
    """This process's anchors (unit rows, the student's ``q`` and the teacher's ``u``) and their running
    statistics, swept against candidate blocks in ``(tile, tile)`` blocks: ``stats`` over every block first
    (both softmaxes' running max and sum), then ``loss`` over every block (the loss and the gradients)."""

    def __init__(self, q: Tensor, u: Tensor, scale: float, teacher_scale: float, step: int, weight: float):
        self.q, self.u, self.scale, self.teacher_scale, self.step, self.weight = (
            q,
            u,
            scale,
            teacher_scale,
            step,
            weight,
        )
        b = q.shape[0]
        self.m_s = torch.full((b,), -math.inf, dtype=q.dtype, device=q.device)
        self.m_t = self.m_s.clone()
        self.l_s, self.l_t = torch.zeros_like(self.m_s), torch.zeros_like(self.m_s)
        self.total = torch.zeros((), dtype=torch.float64, device=q.device)
        self.grad_q = torch.zeros_like(q)

    def _blocks(self, n_cand: int) -> Iterator[tuple[slice, slice]]:
        n = self.q.shape[0]
        for a0 in range(0, n, self.step):
            for c0 in range(0, n_cand, self.step):
                yield slice(a0, min(a0 + self.step, n)), slice(c0, min(c0 + self.step, n_cand))

    def stats(self, c: Tensor, v: Tensor) -> None:
        """The first sweep over one candidate block ``c`` (student unit rows) / ``v`` (teacher's)."""
        for rows, cols in self._blocks(c.shape[0]):
            z = self.scale * (self.q[rows] @ c[cols].T)  # (b, t) student logits
            y = self.teacher_scale * (self.u[rows] @ v[cols].T)  # (b, t) teacher logits
            m_s, m_t = self.m_s[rows], self.m_t[rows]
            new_s, new_t = torch.maximum(m_s, z.amax(1)), torch.maximum(m_t, y.amax(1))
            self.l_s[rows] = self.l_s[rows] * torch.exp(m_s - new_s) + torch.exp(z - new_s[:, None]).sum(1)
            self.l_t[rows] = self.l_t[rows] * torch.exp(m_t - new_t) + torch.exp(y - new_t[:, None]).sum(1)
            self.m_s[rows], self.m_t[rows] = new_s, new_t

    def finish_stats(self) -> None:
        """After the first sweep: the sums' logs."""
        # kept as (max, log of the sum): a logit minus the max is exact where they are close, whereas
        # max + log(sum), at the logits' size (scale 100), would round away the small log-probabilities' bits
        self.log_l_s, self.log_l_t = torch.log(self.l_s)[:, None], torch.log(self.l_t)[:, None]

    def loss(self, c: Tensor, v: Tensor, grads: list[Tensor], with_grad: bool) -> None:
        """The second sweep over one block: the loss as ``sum_j p_t (log p_t - log p_s)``, each
        log-probability formed before the difference (as a dense ``log_softmax`` would: no cancellation of
        logits of size ``scale``), and with ``with_grad`` the gradients wrt the anchors' and (into
        ``grads[0]``) the block's unit rows."""
        for rows, cols in self._blocks(c.shape[0]):
            qa = self.q[rows]
            log_ps = (self.scale * (qa @ c[cols].T) - self.m_s[rows, None]) - self.log_l_s[rows]  # (b, t)
            log_pt = (self.teacher_scale * (self.u[rows] @ v[cols].T) - self.m_t[rows, None]) - self.log_l_t[
                rows
            ]
            p_t = torch.exp(log_pt)
            self.total += ((p_t * (log_pt - log_ps)).sum() * self.weight).double()
            if not with_grad:
                continue
            g = (torch.exp(log_ps) - p_t) * (self.weight * self.scale)  # (b, t): d loss / d unit-row products
            self.grad_q[rows] += g @ c[cols]  # (b, t) @ (t, d_s)
            grads[0][cols] += g.T @ qa  # (t, b) @ (b, d_s)


@fp32_loss_stage
def listwise_kl_loss_and_grad(
    anchors: Tensor,
    candidates: Tensor,
    teacher_anchors: Tensor,
    teacher_candidates: Tensor,
    *,
    scale: float,
    teacher_scale: float,
    candidate_sizes: list[int] | None = None,
    ring: bool = False,
    row_weight: float | None = None,
    tile_size: int = 1024,
    with_grad: bool = True,
) -> ListwiseOutput:
    """The listwise KL distillation loss (see the module's notes) and its gradient wrt the student's rows.

    Args:
        anchors: the student's anchors ``(B, d_s)``.
        candidates: the student's candidates ``(C, d_s)`` (this process's).
        teacher_anchors: the teacher's embeddings of the same anchors ``(B, d_t)``; no gradient.
        teacher_candidates: the teacher's embeddings of the same candidates ``(C, d_t)``; no gradient.
        scale: the student's logits' scale (``1 / temperature``) on the cosine similarities.
        teacher_scale: the teacher's logits' scale on its cosine similarities.
        candidate_sizes: every process's candidate count (rank order), to score against every process's
            candidates; None: this process's only.
        ring: with ``candidate_sizes``, pass the candidate blocks around a ring of processes (Inf-CL's
            exchange: memory of one process's rows whatever the number of processes) instead of gathering them.
        row_weight: the weight of each anchor's loss (default ``1 / B``; across processes ``W / B_global``).
        tile_size: anchors and candidates of one logit tile; sets the memory, not the result.
        with_grad: also return the gradients.

    Returns:
        [`ListwiseOutput`][st_cached_losses.functional.distill.listwise.ListwiseOutput].
    """
    n_anchors = anchors.shape[0]
    if candidates.shape[0] != teacher_candidates.shape[0] or n_anchors != teacher_anchors.shape[0]:
        raise ValueError(
            "the teacher's rows must be the student's: got anchors "
            f"{n_anchors} / {teacher_anchors.shape[0]} and candidates {candidates.shape[0]} / "
            f"{teacher_candidates.shape[0]} (student / teacher)."
        )
    dtype = accumulation_dtype(anchors)
    weight = row_weight if row_weight is not None else 1.0 / max(n_anchors, 1)
    q_leaf, q = _unit(anchors, dtype, with_grad)
    c_leaf, c_own = _unit(candidates, dtype, with_grad)
    u = F.normalize(teacher_anchors.detach().to(dtype), dim=-1)
    v_own = F.normalize(teacher_candidates.detach().to(dtype), dim=-1)
    tiles = _Tiles(q.detach(), u, scale, teacher_scale, max(tile_size, 1), weight)
    with torch.no_grad():
        grad_c: Tensor | None = None
        if ring and candidate_sizes is not None:
            # every process's candidate blocks travel the ring twice (the statistics, then the loss and the
            # gradients, which travel with their block and come home summed over the processes)
            def first(owner: int, block: list[Tensor], carried: list[Tensor]) -> None:
                tiles.stats(block[0], block[1])

            def second(owner: int, block: list[Tensor], carried: list[Tensor]) -> None:
                tiles.loss(block[0], block[1], carried, with_grad)

            ring_exchange([c_own.detach(), v_own], [], candidate_sizes, first)
            tiles.finish_stats()
            home = ring_exchange(
                [c_own.detach(), v_own],
                [torch.zeros_like(c_own)] if with_grad else [],
                candidate_sizes,
                second,
            )
            grad_c = home[0] if with_grad else None
        else:
            c = (
                all_gather_rows(c_own.detach(), candidate_sizes)
                if candidate_sizes is not None
                else c_own.detach()
            )
            v = all_gather_rows(v_own, candidate_sizes) if candidate_sizes is not None else v_own
            tiles.stats(c, v)
            tiles.finish_stats()
            grads = [torch.zeros_like(c)] if with_grad else []
            tiles.loss(c, v, grads, with_grad)
            if with_grad:
                grad_c = grads[0]
                if candidate_sizes is not None:
                    # the gather's backward: every process's gradient wrt the gathered candidates, summed; ours kept
                    grad_c = own_rows(all_reduce_sum(grad_c, "all_reduce_grad"), candidate_sizes)
    loss = tiles.total.to(dtype)
    if not with_grad:
        return ListwiseOutput(loss)
    assert grad_c is not None
    grad_q = tiles.grad_q
    # through the normalisation, by autograd on the leaves' small (rows, d) graphs
    found_q, found_c = torch.autograd.grad([q, c_own], [q_leaf, c_leaf], [grad_q, grad_c])
    return ListwiseOutput(loss, found_q.to(anchors.dtype), found_c.to(candidates.dtype))
