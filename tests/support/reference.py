"""Naive dense InfoNCE and sigmoid (SigLIP) losses: the oracle for every test and benchmark.

Builds the full ``(B, C)`` logit matrix with plain autograd ops; nothing clever, nothing shared
with the package. Computes in the inputs' dtype (so a bf16 call shows the naive bf16 error).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def _prep(x: Tensor, similarity: str) -> Tensor:
    return F.normalize(x, dim=-1) if similarity == "cosine" else x


def reference_infonce(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    *,
    scale: float | Tensor = 20.0,
    similarity: str = "cosine",
    symmetric: bool = False,
    anchors_all: Tensor | None = None,
    row_offset: int = 0,
    anchor_keys: Tensor | None = None,
    candidate_keys: Sequence[Tensor] | None = None,
    anchors_all_keys: Tensor | None = None,
    bank_candidates: Tensor | None = None,
    bank_anchors: Tensor | None = None,
) -> Tensor:
    """Mean InfoNCE of ``anchors (B, d)`` against ``cat(candidates) (K*N, d)``; positive of row i at
    ``row_offset + i``. Symmetric: average with positives ``candidates[0][offset:offset+B]`` against
    ``anchors_all`` (or ``anchors``).

    With keys, pairs ``i != j`` sharing an anchor key or a positive key are duplicates: row i's logit
    of positive j and, symmetric, positive i's logit of anchor j are set to -inf; so is row i's logit
    of any candidate whose key equals its positive's. ``anchors_all_keys`` (or ``anchor_keys``): the
    ``(N,)`` keys of every positive's anchor.

    A negative bank: ``bank_candidates`` ``(n, d)`` are concatenated as extra negative columns of every
    row, ``bank_anchors`` ``(m, d)`` (symmetric) as extra negative columns of every positive."""
    cols = [candidates] if isinstance(candidates, Tensor) else list(candidates)
    b = anchors.shape[0]
    q = _prep(anchors, similarity)
    extra = [bank_candidates] if bank_candidates is not None else []
    c = _prep(torch.cat(cols + extra, dim=0), similarity)
    labels = torch.arange(b, device=anchors.device) + row_offset
    rows = torch.arange(b, device=anchors.device)
    logits = scale * q @ c.T  # (B, K*N)
    same = None  # (B, N): pair j duplicates pair i (one mask for both directions)
    if candidate_keys is not None:
        pos_keys = candidate_keys[0][labels]  # (B,)
        same = pos_keys[:, None] == candidate_keys[0][None, :]
        if anchor_keys is not None:
            all_keys = anchor_keys if anchors_all_keys is None else anchors_all_keys
            same = same | (anchor_keys[:, None] == all_keys[None, :])
        same[rows, labels] = False
        negs = [pos_keys[:, None] == key[None, :] for key in candidate_keys[1:]]
        logits = logits.masked_fill(torch.cat([same, *negs], dim=1), float("-inf"))
    loss = F.cross_entropy(logits, labels)
    if not symmetric:
        return loss
    a_all = anchors if anchors_all is None else anchors_all
    a_all = _prep(torch.cat([a_all, bank_anchors]) if bank_anchors is not None else a_all, similarity)
    p = _prep(cols[0][row_offset : row_offset + b], similarity)
    back_logits = scale * p @ a_all.T  # (B, N)
    if same is not None:
        back_logits = back_logits.masked_fill(same, float("-inf"))
    back = F.cross_entropy(back_logits, labels)
    return (loss + back) / 2


def reference_infonce_blockwise_float64(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    *,
    scale: float = 20.0,
    similarity: str = "cosine",
    symmetric: bool = False,
    block: int = 2048,
) -> float:
    """The same loss value in float64, a block of rows at a time (for batches whose dense logits do
    not fit in memory). Value only, no gradients; single process (``N == B`` when symmetric)."""
    cols = [candidates] if isinstance(candidates, Tensor) else list(candidates)
    with torch.no_grad():
        q = _prep(anchors.double(), similarity)
        c = _prep(torch.cat(cols, dim=0).double(), similarity)
        b = q.shape[0]
        total = 0.0
        for r0 in range(0, b, block):
            r1 = min(r0 + block, b)
            logits = scale * q[r0:r1] @ c.T
            pos = logits[torch.arange(r1 - r0), torch.arange(r0, r1)]
            total += float((torch.logsumexp(logits, dim=1) - pos).sum())
        loss = total / b
        if not symmetric:
            return loss
        p = c[: cols[0].shape[0]]
        back = 0.0
        for r0 in range(0, p.shape[0], block):
            r1 = min(r0 + block, p.shape[0])
            logits = scale * p[r0:r1] @ q.T
            pos = logits[torch.arange(r1 - r0), torch.arange(r0, r1)]
            back += float((torch.logsumexp(logits, dim=1) - pos).sum())
        return (loss + back / p.shape[0]) / 2


def reference_sigmoid(
    anchors: Tensor,
    candidates: Tensor | Sequence[Tensor],
    *,
    scale: float | Tensor = 10.0,
    bias: float | Tensor = -10.0,
    similarity: str | Callable[[Tensor, Tensor], Tensor] = "cosine",
    row_offset: int = 0,
    bank: Tensor | None = None,
) -> Tensor:
    """SigLIP's loss as the paper writes it, ``-(1/B) sum_i sum_j log sigmoid(z_ij (scale * sim_ij + bias))``,
    over ``anchors (B, d)`` against ``cat(candidates, bank) (C, d)``; ``z_ij = +1`` at row i's positive
    ``candidates[0][row_offset + i]``, -1 elsewhere. The full ``(B, C)`` logits, plain autograd."""
    cols = [candidates] if isinstance(candidates, Tensor) else list(candidates)
    c = torch.cat(cols + ([bank] if bank is not None else []), dim=0)
    if callable(similarity):
        sim = similarity(anchors, c)
    else:
        sim = _prep(anchors, similarity) @ _prep(c, similarity).T  # (B, C)
    logits = scale * sim + bias
    b = anchors.shape[0]
    z = -torch.ones_like(logits)
    z[torch.arange(b), torch.arange(b) + row_offset] = 1.0
    return -F.logsigmoid(z * logits).sum() / b


def reference_listwise_kl(
    anchors: Tensor,
    candidates: Tensor,
    teacher_anchors: Tensor,
    teacher_candidates: Tensor,
    *,
    scale: float = 20.0,
    teacher_scale: float = 20.0,
) -> Tensor:
    """Listwise distillation as the issue states it: per anchor, ``KL(softmax(teacher_scale * cos(u_i, v_j)) ||
    softmax(scale * cos(q_i, c_j)))`` over every candidate ``j``, the mean over the anchors. The full ``(B, C)``
    matrices of both, plain autograd (the teacher's rows detached)."""
    z = scale * F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T  # (B, C)
    u, v = teacher_anchors.detach(), teacher_candidates.detach()
    y = teacher_scale * F.normalize(u, dim=-1) @ F.normalize(v, dim=-1).T  # (B, C)
    log_p, log_q = torch.log_softmax(y, dim=1), torch.log_softmax(z, dim=1)
    return (log_p.exp() * (log_p - log_q)).sum(1).mean()


def reference_listed_infonce(
    anchors: Tensor,
    positives: Sequence[Tensor],
    negatives: Sequence[Tensor],
    *,
    scale: float | Tensor = 20.0,
    similarity: str = "cosine",
    symmetric: bool = False,
    all_negatives_penalty: float = 0.0,
    masked_negatives: Collection[tuple[int, int, int]] = (),
) -> Tensor:
    """InfoNCE with lists, in float64, one (anchor, positive) pair at a time: ``anchors`` ``(B, d)``;
    ``positives[i]`` ``(m_i, d)`` (``m_i >= 1``) and ``negatives[i]`` ``(n_i, d)`` (``n_i >= 0``) row ``i``'s.

    Every row's candidates flattened: each positive ``p`` of row ``i`` is scored against itself, every other
    row's positives and every row's negatives (row ``i``'s other positives are masked: they are not its
    negatives); ``-s <q_i, p> + logsumexp``, averaged over the row's positives, then the mean over the rows.
    Symmetric: each positive ``p`` of row ``i`` also against every anchor, its target ``q_i``, averaged the same
    way, and the two directions averaged. ``all_negatives_penalty``: sentence-transformers' ``all_negatives``
    hardness (``alpha * stop_grad(sim)`` added to every logit but the positive's, not scaled).
    ``masked_negatives``: ``(i, j, n)``, the ``n``-th negative (every row's flattened) is no candidate of row ``i``'s
    ``j``-th positive's softmax (a duplicate of that positive, as ``mask_duplicates`` finds it)."""
    q = _prep(anchors.double(), similarity)
    pos = [_prep(p.double(), similarity) for p in positives]
    negs = [_prep(n.double(), similarity) for n in negatives]
    s = scale.double() if isinstance(scale, Tensor) else scale
    b = q.shape[0]
    all_pos = torch.cat(pos)
    all_neg = torch.cat(negs) if negs else all_pos[:0]
    owner = torch.cat([torch.full((len(p),), i) for i, p in enumerate(pos)])
    fwd = q.new_zeros(())
    back = q.new_zeros(())
    for i in range(b):
        row = q.new_zeros(())
        back_row = q.new_zeros(())
        for j in range(len(pos[i])):
            p = pos[i][j]
            others = all_pos[owner != i]
            keep = torch.ones(len(all_neg), dtype=torch.bool)
            for mi, mj, mn in masked_negatives:
                if (mi, mj) == (i, j):
                    keep[mn] = False
            cands = torch.cat([p[None], others, all_neg[keep]])  # the positive first
            sims = cands @ q[i]
            logits = s * sims
            if all_negatives_penalty:
                logits = torch.cat([logits[:1], logits[1:] + all_negatives_penalty * sims[1:].detach()])
            row = row + torch.logsumexp(logits, 0) - logits[0]
            if symmetric:
                back_logits = s * (q @ p)
                back_row = back_row + torch.logsumexp(back_logits, 0) - back_logits[i]
        fwd = fwd + row / len(pos[i])
        back = back + back_row / len(pos[i])
    if not symmetric:
        return fwd / b
    return (fwd / b + back / b) / 2
