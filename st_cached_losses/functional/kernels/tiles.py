"""The building blocks of the loss stage's tiles: operands read tile by tile (fp32, normalised, scaled), a
running log-sum-exp, the tile plan and the map from gradients of normalised embeddings to raw ones.

Nothing of size ``rows x candidates`` is ever held beyond one block. Notation of the shape comments:
``b`` rows in a row tile, ``t`` columns in a column tile, ``d`` the embedding dimension."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from st_cached_losses.functional.precision import accumulation_dtype

NORM_EPS = 1e-12


class Operand:
    """An embedding matrix ``x (n, d)`` whose tiles come out as fp32, normalised and scaled.

    With ``prenormalize=True`` one fp32 copy is made up front (the chunked path, where each chunk
    spans whole columns and re-normalising them per chunk would repeat work); otherwise only the
    per-row multipliers (``mult / ||x_i||``) are stored and each tile is normalised when it is read,
    so memory stays ``O(n)`` beyond the input (the tiled path).

    ``rounds`` (bf16 products, ``matmul_precision="medium"``): the normalised rows are rounded to bf16 (the
    prenormalised copy is kept in bf16) and ``mult`` multiplies them after, in fp32, so that a product of two
    operands is ``mult * (bf16 . bf16)`` whichever of the two carries the scale (the symmetric loss scores
    one pair of rows from both sides)."""

    def __init__(
        self, x: Tensor, cosine: bool, mult: float, prenormalize: bool, rounds: bool = False
    ) -> None:
        self.x = x
        self.n = x.shape[0]
        self.dtype = accumulation_dtype(x)
        self.cosine = cosine
        self.mult = float(mult)
        self.rounds = rounds
        self.kernel_copy: Tensor | None = None  # the whole operand as the kernels read it (flash)
        # (n,) fp32: 1 / max(||x_i||, eps), the same clamp as F.normalize
        self.inv_norm = (
            torch.linalg.vector_norm(x, dim=1, dtype=self.dtype).clamp_min_(NORM_EPS).reciprocal_()
            if cosine
            else None
        )
        if rounds:
            data = x
            if prenormalize:  # normalised in fp32, rounded once, kept in half the bytes
                data = x.to(self.dtype)
                data = (data * self.inv_norm[:, None] if self.inv_norm is not None else data).to(
                    torch.bfloat16
                )
            self.data, self.row_mult = data, (None if prenormalize else self.inv_norm)
            return
        row_mult = self.inv_norm * mult if self.inv_norm is not None else None
        if row_mult is None and mult != 1.0:
            row_mult = torch.full((self.n,), mult, dtype=self.dtype, device=x.device)
        if prenormalize and (row_mult is not None or x.dtype != self.dtype):
            data = x.to(self.dtype)
            if row_mult is not None:
                data = data * row_mult[:, None]
            self.data, self.row_mult = data, None
        else:
            self.data, self.row_mult = x, row_mult

    def tile(self, i0: int, i1: int) -> Tensor:
        """Rows ``i0:i1`` in the compute dtype, normalised and scaled: ``(i1 - i0, d)``."""
        if self.rounds:
            t = self.unscaled_tile(i0, i1)
            return t * self.mult if self.mult != 1.0 else t
        t = self.data[i0:i1].to(self.dtype)
        if self.row_mult is not None:
            return t * self.row_mult[i0:i1, None]
        return t

    def unscaled_tile(self, i0: int, i1: int) -> Tensor:
        """Rows ``i0:i1`` normalised, without ``mult`` (rounded to bf16 values when ``rounds``): what the
        kernels multiply (they scale the product)."""
        if self.rounds:
            t = self.data[i0:i1].to(self.dtype)
            if self.data.dtype == torch.bfloat16 and self.row_mult is None:
                return t
            if self.row_mult is not None:
                t = t * self.row_mult[i0:i1, None]
            return t.to(torch.bfloat16).to(self.dtype)
        t = self.x[i0:i1].to(self.dtype)
        return t * self.inv_norm[i0:i1, None] if self.inv_norm is not None else t


#: Log-probabilities (relative to the row's largest logit) below this are flushed to exactly zero
#: before ``exp``. Left alone they would be denormal floats, which make CPU GEMMs tens of times slower
#: (seen: 37x for a 2048 x 8192 by 8192 x 384 product), and ``torch.set_flush_denormal`` does not reach
#: the GEMM's worker threads. The flushed mass is below N * e^-64 of the row's total: nothing in fp32.
FLUSH_BELOW = -64.0


def exp_flushed_(x: Tensor) -> Tensor:
    """``exp`` in place, with entries below `FLUSH_BELOW` (including -inf) giving exactly 0."""
    return torch.threshold_(x, FLUSH_BELOW, -torch.inf).exp_()


def spans(n: int, size: int) -> Iterator[tuple[int, int]]:
    for i0 in range(0, n, size):
        yield i0, min(i0 + size, n)


def diagonal_entries(
    r0: int, r1: int, c0: int, c1: int, offset: int | None, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """Tile-local indices ``(ri, ci)`` of the entries ``(i, offset + i)`` of rows ``r0:r1`` that fall in
    columns ``c0:c1`` (a row's positive, or its own entry), or None when there are none."""
    if offset is None:
        return None
    lo, hi = max(r0, c0 - offset), min(r1, c1 - offset)
    if lo >= hi:
        return None
    i = torch.arange(lo, hi, device=device)
    return i - r0, i + offset - c0


@dataclass
class LogSumExp:
    """``m + log_s`` kept as its two parts: a softmax ``exp(x - m - log_s)`` is then accurate even
    where the probability is close to 1 (``x - m`` is exact for nearby values, while ``x - lse`` would
    inherit the fp32 rounding of a large ``lse``)."""

    m: Tensor  # (n,) running max
    log_s: Tensor  # (n,) log of the sum of exp(x - m)

    def __getitem__(self, idx: slice) -> LogSumExp:
        return LogSumExp(self.m[idx], self.log_s[idx])

    def total(self) -> Tensor:
        """``(n,)`` float64 log-sum-exp."""
        return self.m.double() + self.log_s.double()

    def stacked(self) -> Tensor:
        """``(n, 2)``, to send it as one block."""
        return torch.stack([self.m, self.log_s], dim=1)

    @staticmethod
    def unstack(t: Tensor) -> LogSumExp:
        return LogSumExp(t[:, 0], t[:, 1])

    def log_softmax(self, logits: Tensor) -> Tensor:
        """``logits - lse`` down the columns of a ``(b, t)`` block (this holds the ``t`` columns'
        log-sum-exps), as a new tensor."""
        return (logits - self.m[None, :]).sub_(self.log_s[None, :])


def online_lse_update(m: Tensor, s: Tensor, block: Tensor, dim: int, scratch: Tensor | None) -> None:
    """Fold ``block`` into a running (max ``m``, sum-of-exp ``s``) along ``dim``, in place. Entries
    may be -inf (masked), including whole rows of a tile."""
    m_new = torch.maximum(m, block.amax(dim))
    m_safe = m_new.masked_fill(m_new == -torch.inf, 0.0)  # exp(-inf - -inf) would be nan
    s.mul_(torch.exp(m - m_safe))
    m_b = m_safe[:, None] if dim == 1 else m_safe[None, :]
    if scratch is None:  # block may be destroyed
        s.add_(exp_flushed_(block.sub_(m_b)).sum(dim))
    else:
        s.add_(exp_flushed_(torch.sub(block, m_b, out=scratch)).sum(dim))
    m.copy_(m_new)


def merge_stats(m: Tensor, s: Tensor, m2: Tensor, s2: Tensor) -> None:
    """Fold the running statistics ``(m2, s2)`` into ``(m, s)``, in place."""
    m_new = torch.maximum(m, m2)
    m_safe = m_new.masked_fill(m_new == -torch.inf, 0.0)
    s.mul_(torch.exp(m - m_safe)).add_(s2 * torch.exp(m2 - m_safe))
    m.copy_(m_new)


def init_stats(n: int, like: Operand) -> tuple[Tensor, Tensor]:
    """A running (max, sum-of-exp) pair for ``n`` log-sum-exps."""
    dev = like.x.device
    return (
        torch.full((n,), -torch.inf, dtype=like.dtype, device=dev),
        torch.zeros(n, dtype=like.dtype, device=dev),
    )


def raw_grad(op: Operand, g: Tensor, out_dtype: torch.dtype, tile: int) -> Tensor:
    """Gradient wrt the raw embedding from the one wrt its normalised version, in place:
    ``dL/dx = (g - x_hat <g, x_hat>) / ||x||``."""
    if op.inv_norm is not None:
        for r0, r1 in spans(op.n, tile):
            inv = op.inv_norm[r0:r1, None]
            x_hat = op.x[r0:r1].to(op.dtype) * inv  # (b, d)
            gr = g[r0:r1]
            gr.sub_(x_hat * (gr * x_hat).sum(1, keepdim=True)).mul_(inv)
    return g.to(out_dtype)


# --------------------------------------------------------------------------- planning

#: Bytes of logit blocks the loss stage may hold at once, when neither chunk nor tile size is given.
DEFAULT_MEMORY_BUDGET = 64 * 2**20
#: Largest tile side the tiled path picks on its own.
MAX_TILE = 2048
#: The chunked path is chosen by ``path="auto"`` when the budget allows chunks of at least this many rows.
MIN_AUTO_CHUNK = 64


@dataclass(frozen=True)
class Plan:
    """``chunked``: row chunks against every column (one pass when no softmax runs down the columns);
    ``tiled``: square tiles in both dimensions, a statistics pass and a gradient pass."""

    path: Literal["chunked", "tiled"]
    row_tile: int
    col_tile: int


def plan_blocks(
    n_rows: int,
    n_cols: int,
    *,
    path: str,
    chunk_size: int | None,
    tile_size: int | None,
    memory_budget: int,
    buffers: int,
) -> Plan:
    """Pick the path and block sizes: ``buffers`` fp32 blocks of ``rows x columns-in-block`` live at once;
    ``"auto"`` chunks when the budget holds `MIN_AUTO_CHUNK` rows (fewer rows make thin GEMMs)."""
    row_bytes = 4 * buffers * n_cols
    if path == "auto":
        if chunk_size is not None:
            path = "chunked"
        elif tile_size is not None:
            path = "tiled"
        else:
            path = "chunked" if memory_budget // row_bytes >= min(n_rows, MIN_AUTO_CHUNK) else "tiled"
    if path == "chunked":
        chunk = chunk_size if chunk_size is not None else max(1, memory_budget // row_bytes)
        return Plan("chunked", min(chunk, n_rows), n_cols)
    tile = tile_side(tile_size, memory_budget, buffers)
    return Plan("tiled", min(tile, n_rows), min(tile, n_cols))


def tile_side(tile_size: int | None, memory_budget: int, buffers: int) -> int:
    """The side of a square tile: ``tile_size`` if given, else the largest (up to ``MAX_TILE``) for which
    ``buffers`` fp32 tiles fit in ``memory_budget`` bytes."""
    if tile_size is not None:
        return tile_size
    return min(MAX_TILE, max(1, math.isqrt(memory_budget // (4 * buffers))))
