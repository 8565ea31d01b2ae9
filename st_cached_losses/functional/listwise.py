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

Across processes each process's anchors are scored against every process's candidates (gathered once, the
student's and the teacher's); each process returns ``W / B_global`` times its anchors' summed loss (DDP's
gradient average is then the global gradient), and the gradients wrt the gathered candidates are summed over
the processes before each keeps its own slice (the gather's true backward)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from st_cached_losses.functional.distributed import all_gather_rows, all_reduce_sum, own_rows
from st_cached_losses.functional.precision import accumulation_dtype, fp32_loss_stage

__all__ = ["ListwiseOutput", "listwise_kl_loss_and_grad", "listwise_tile_size"]


@dataclass
class ListwiseOutput:
    """What [`listwise_kl_loss_and_grad`][st_cached_losses.functional.listwise.listwise_kl_loss_and_grad]
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
            candidates (gathered); None: this process's only.
        row_weight: the weight of each anchor's loss (default ``1 / B``; across processes ``W / B_global``).
        tile_size: anchors and candidates of one logit tile; sets the memory, not the result.
        with_grad: also return the gradients.

    Returns:
        [`ListwiseOutput`][st_cached_losses.functional.listwise.ListwiseOutput].
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
    qd, c_own_d = q.detach(), c_own.detach()
    c = all_gather_rows(c_own_d, candidate_sizes) if candidate_sizes is not None else c_own_d
    v = all_gather_rows(v_own, candidate_sizes) if candidate_sizes is not None else v_own
    n_cand = c.shape[0]
    step = max(tile_size, 1)
    total = torch.zeros((), dtype=torch.float64, device=anchors.device)
    grad_q = torch.zeros_like(qd) if with_grad else None
    grad_c = torch.zeros_like(c) if with_grad else None
    with torch.no_grad():
        for a0 in range(0, n_anchors, step):
            rows = slice(a0, min(a0 + step, n_anchors))
            qa, ua = qd[rows], u[rows]
            b = qa.shape[0]
            neg_inf = torch.full((b,), -math.inf, dtype=dtype, device=qa.device)
            m_s, m_t = neg_inf.clone(), neg_inf.clone()
            l_s, l_t = (torch.zeros(b, dtype=dtype, device=qa.device) for _ in range(2))
            for c0 in range(0, n_cand, step):  # the first sweep: both softmaxes' statistics
                cols = slice(c0, min(c0 + step, n_cand))
                z = scale * (qa @ c[cols].T)  # (b, t) student logits
                y = teacher_scale * (ua @ v[cols].T)  # (b, t) teacher logits
                new_s, new_t = torch.maximum(m_s, z.amax(1)), torch.maximum(m_t, y.amax(1))
                l_s = l_s * torch.exp(m_s - new_s) + torch.exp(z - new_s[:, None]).sum(1)
                l_t = l_t * torch.exp(m_t - new_t) + torch.exp(y - new_t[:, None]).sum(1)
                m_s, m_t = new_s, new_t
            # kept as (max, log of the sum): a logit minus the max is exact where they are close, whereas
            # max + log(sum), at the logits' size (scale 100), would round away the small log-probabilities' bits
            log_l_s, log_l_t = torch.log(l_s)[:, None], torch.log(l_t)[:, None]
            # the second sweep: the loss as sum_j p_t (log p_t - log p_s), each log-probability formed before
            # the difference (as a dense log_softmax would: no cancellation of logits of size scale), and
            # the gradients from the same probabilities
            for c0 in range(0, n_cand, step):
                cols = slice(c0, min(c0 + step, n_cand))
                log_ps = (scale * (qa @ c[cols].T) - m_s[:, None]) - log_l_s  # (b, t)
                log_pt = (teacher_scale * (ua @ v[cols].T) - m_t[:, None]) - log_l_t  # (b, t)
                p_t = torch.exp(log_pt)
                total += ((p_t * (log_pt - log_ps)).sum() * weight).double()
                if not with_grad:
                    continue
                assert grad_q is not None and grad_c is not None
                g = (torch.exp(log_ps) - p_t) * (weight * scale)  # (b, t): d loss / d unit-row products
                grad_q[rows] += g @ c[cols]  # (b, t) @ (t, d_s)
                grad_c[cols] += g.T @ qa  # (t, b) @ (b, d_s)
    loss = total.to(dtype)
    if not with_grad:
        return ListwiseOutput(loss)
    assert grad_q is not None and grad_c is not None
    if candidate_sizes is not None:
        # the gather's backward: every process's gradient wrt the gathered candidates, summed; keep ours
        grad_c = own_rows(all_reduce_sum(grad_c, "all_reduce_grad"), candidate_sizes)
    # through the normalisation, by autograd on the leaves' small (rows, d) graphs
    found_q, found_c = torch.autograd.grad([q, c_own], [q_leaf, c_leaf], [grad_q, grad_c])
    return ListwiseOutput(loss, found_q.to(anchors.dtype), found_c.to(candidates.dtype))
