"""Sparse (SPLADE) embeddings kept compact: only their non-zero entries, as a plug-in of the one core.

A vocabulary-sized SPLADE row ``(V,)`` has a few hundred non-zero entries out of ``V = 30,522``. Its
*packed* form is one ``(n, k, 2)`` tensor per block of ``n`` rows: for each row its non-zero entries'
vocabulary indices (channel 0, stored as floats: exact up to ``2 ** 24``) and values (channel 1), ``k`` the
largest count of the block, shorter rows padded with index 0 and value 0. Only zeros are dropped, so
[`dense_rows`][st_cached_losses.functional.representations.sparse.dense_rows] gives back the dense rows bit for bit (a padding entry adds ``+0.0``). [`SparseDot`][st_cached_losses.functional.representations.sparse.SparseDot]
is their dot product as a similarity function of [`score`][st_cached_losses.functional.score].

Why padded rows and not CSR: the packed tensor is an ordinary dense tensor with rows on dim 0, so it
travels through every tile slice, ``index_select`` (the engine's mini-batch rows) and gradient buffer of the
core unchanged, as the multi-vector rows do ([`multi_vector`][st_cached_losses.functional.representations.multi_vector]); a tile's rows are densified with one
``scatter_add_``. Its cost is the padding (``k`` is the block's largest count): the caller compares the
bytes before choosing it. A gradient wrt a packed tensor has the packed shape: the value channel holds
the gradient wrt each kept entry, the index channel is 0 (an index has no gradient).

Shapes: ``n`` rows, ``k`` kept entries per row, ``V`` the vocabulary, ``b`` rows of a tile, ``t`` columns
of a tile."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from st_cached_losses.functional.distributed import all_reduce_min
from st_cached_losses.functional.precision import accumulation_dtype

__all__ = [
    "MAX_PACKED_DIM",
    "SparseDot",
    "agree_packed",
    "dense_rows",
    "kept",
    "pack_rows",
    "packed_index",
    "scatter_columns",
]

#: Indices are stored in the values' float channel: exact up to ``2 ** 24`` (fp32's mantissa).
MAX_PACKED_DIM = 2**24


def agree_packed(packed: bool, device: torch.device) -> bool:
    """Whether every process keeps its rows packed this step: the minimum of each process's ``packed`` flag,
    one all-reduce (every process must call it). Processes that read one another's rows (gathered, or by
    ring) must read one form: one process's dense mini-batch keeps every process's step dense."""
    flag = torch.tensor([int(packed)], dtype=torch.long, device=device)
    return bool(all_reduce_min(flag, "all_reduce_cache_form")[0])


def pack_rows(x: Tensor) -> Tensor:
    """``(n, V)`` rows as packed ``(n, k, 2)`` (fp32, fp64 kept), ``k`` their largest number of non-zero
    entries (at least 1); each row's entries in increasing index order, then padding."""
    if x.dim() != 2 or x.shape[1] > MAX_PACKED_DIM:
        raise ValueError(f"pack_rows takes (rows, V) with V <= 2**24, got {tuple(x.shape)}.")
    dtype = accumulation_dtype(x)
    n = x.shape[0]
    nz = x != 0
    counts = nz.sum(1)  # (n,)
    k = max(int(counts.max()) if n else 0, 1)
    rows, cols = nz.nonzero(as_tuple=True)  # row-major: each row's entries in index order
    # position of each entry within its row: its rank minus the number of entries of the rows before
    starts = torch.cumsum(counts, 0) - counts  # (n,)
    pos = torch.arange(rows.numel(), device=x.device) - starts[rows]
    out = torch.zeros(n, k, 2, dtype=dtype, device=x.device)
    out[rows, pos, 0] = cols.to(dtype)
    out[rows, pos, 1] = x[rows, cols].to(dtype)
    return out


def packed_index(packed: Tensor) -> Tensor:
    """``(n, k)`` int64 vocabulary indices of the entries (0 for padding)."""
    return packed[..., 0].detach().long()


def kept(packed: Tensor) -> Tensor:
    """``(n, k)`` True for a kept (non-zero) entry, False for padding: only zeros were dropped, so a kept
    value is never 0."""
    return packed[..., 1] != 0


def dense_rows(packed: Tensor, dim: int, values: Tensor | None = None) -> Tensor:
    """``(n, dim)`` dense rows of a packed ``(n, k, 2)`` tensor (or of ``values (n, k)`` at its indices: a
    packed gradient's), exactly: padding adds ``+0.0`` at index 0."""
    vals = packed[..., 1] if values is None else values
    out = torch.zeros(packed.shape[0], dim, dtype=vals.dtype, device=vals.device)
    return out.scatter_add_(1, packed_index(packed), vals)


def scatter_columns(packed: Tensor, dim: int, row_weight: Tensor | None = None) -> Tensor:
    """``(dim,)`` column sums ``sum_i w_i x_i`` of packed rows (``w``: ``(n,)`` or None for 1), by
    scatter-add of the kept entries: the dense rows' column sums without the dense rows."""
    vals = packed[..., 1]
    if row_weight is not None:
        vals = vals * row_weight[:, None].to(vals.dtype)
    out = torch.zeros(dim, dtype=vals.dtype, device=vals.device)
    return out.index_add_(0, packed_index(packed).flatten(), vals.flatten())


def _sparse_csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": used for mm only
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _csr(packed: Tensor, dim: int) -> Tensor:
    """``(n, dim)`` sparse CSR of the kept entries of packed rows (in index order, padding left out)."""
    keep = kept(packed)
    crow = torch.zeros(packed.shape[0] + 1, dtype=torch.long, device=packed.device)
    torch.cumsum(keep.sum(1), 0, out=crow[1:])
    return _sparse_csr(crow, packed_index(packed)[keep], packed[..., 1][keep], (packed.shape[0], dim))


def _csr_t(packed: Tensor, dim: int) -> Tensor:
    """``(dim, n)`` sparse CSR of the transposed rows (their kept entries ordered by index, then row)."""
    keep = kept(packed)
    idx = packed_index(packed)[keep]
    rows = torch.arange(packed.shape[0], device=packed.device)[:, None].expand_as(keep)[keep]
    order = torch.argsort(idx, stable=True)  # by index; rows stay in order within an index
    crow = torch.zeros(dim + 1, dtype=torch.long, device=packed.device)
    torch.cumsum(torch.bincount(idx, minlength=dim), 0, out=crow[1:])
    return _sparse_csr(crow, rows[order], packed[..., 1][keep][order], (dim, packed.shape[0]))


@dataclass(unsafe_hash=True)
class SparseDot:
    """The dot product of packed sparse rows ([`pack_rows`][st_cached_losses.functional.representations.sparse.pack_rows]) of dimension ``dim``, as a similarity
    function ``f(a (b, ka, 2), c (t, kc, 2)) -> (b, t)`` of [`score`][st_cached_losses.functional.score]: the same scores as ``"dot"`` on the
    dense rows, exactly (``<a, c> = sum_m c_val[m] * a[c_idx[m]]`` over ``c``'s kept entries). A tile of rows
    is densified (``(b, V)``) and its columns become a sparse CSR matrix: ``O(b V + t k)`` memory and
    ``t k b`` multiply-adds instead of a ``t V b`` GEMM. The gradient of each kept entry comes from
    [`vjp`][st_cached_losses.functional.representations.sparse.SparseDot.vjp] (in closed form: no autograd graph of a tile; wrt the columns, a sampled product at their
    kept entries)."""

    dim: int
    #: operands are packed 3-D rows (read by [`Score`][st_cached_losses.functional.score.Score])
    packed_rows = True

    def __post_init__(self) -> None:
        if not 0 < self.dim <= MAX_PACKED_DIM:
            raise ValueError(f"SparseDot needs 0 < dim <= 2**24, got {self.dim}.")
        self.dim = int(self.dim)
        # the CSR forms of the column blocks already read (the chunked path reads every column once per row
        # chunk), keyed by the block's memory, layout and version; each entry holds its block, so that the
        # block's memory cannot be reused by another tensor while the key is cached. One instance per call.
        self._columns: dict[tuple[Any, ...], list[Tensor | None]] = {}

    def _csr_of(self, c: Tensor, transposed: bool) -> Tensor:
        """The CSR (or transposed CSR) of a column block, built once per block."""
        key = (c.data_ptr(), tuple(c.shape), c.stride(), c._version, c.device, c.dtype)
        entry = self._columns.setdefault(key, [c, None, None])
        slot = 2 if transposed else 1
        if entry[slot] is None:
            entry[slot] = _csr_t(c, self.dim) if transposed else _csr(c, self.dim)
        return cast(Tensor, entry[slot])

    def release(self) -> None:
        """Forget the column blocks read so far (the ring calls it after each visiting block)."""
        self._columns.clear()

    @torch.no_grad()
    def __call__(self, a: Tensor, c: Tensor) -> Tensor:
        """``(b, t)`` dot products of packed rows ``a (b, ka, 2)`` and packed columns ``c (t, kc, 2)``, without
        a graph: the gradient is [`vjp`][st_cached_losses.functional.representations.sparse.SparseDot.vjp]'s (the core calls it for each tile)."""
        # (t, V) sparse @ (V, b) -> (t, b)
        return torch.sparse.mm(self._csr_of(c, False), dense_rows(a, self.dim).T).T

    @torch.no_grad()
    def vjp(
        self, g: Tensor, a: Tensor, c: Tensor, rows: bool, cols: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of ``sum(g * self(a, c))`` (``g``: ``(b, t)``) wrt ``a`` (if ``rows``) and ``c`` (if
        ``cols``), packed like them: the value channel holds each kept entry's, 0 for the index channel
        and the padding."""
        dim = self.dim
        g_t = g.T.to(a.dtype).contiguous()  # (t, b)
        grad_a = grad_c = None
        if rows:
            # dL/da_i = sum_j g_ij c_j: (V, t) sparse @ (t, b) -> (V, b), read at each row's kept indices
            m_t = torch.sparse.mm(self._csr_of(c, True), g_t)
            at = torch.arange(a.shape[0], device=a.device)[:, None]
            vals = m_t[packed_index(a), at] * kept(a)  # (b, ka): 0 for padding
            grad_a = torch.stack([torch.zeros_like(vals), vals], dim=-1)
        if cols:
            # dL/dc_jm = sum_i g_ij a_i[c_idx[j, m]]: (t, b) @ (b, V) sampled at the kept entries of c
            sampled = torch.sparse.sampled_addmm(self._csr_of(c, False), g_t, dense_rows(a, dim), beta=0.0)
            vals = torch.zeros(c.shape[:2], dtype=a.dtype, device=a.device)
            vals[kept(c)] = sampled.values()
            grad_c = torch.stack([torch.zeros_like(vals), vals], dim=-1)
        return grad_a, grad_c

    def pairwise(self, a: Tensor, c: Tensor) -> Tensor:
        """``(b,)`` ``<a_i, c_i>`` of ``b`` packed rows each."""
        dense = dense_rows(a, self.dim)  # (b, V)
        return (dense.gather(1, packed_index(c)) * c[..., 1]).sum(1)

    def entry_cost(self, rows: Tensor, cols: list[Tensor]) -> int:
        """fp32 elements per logit of a block: the logit, plus each block row's dense ``(V,)`` and its
        gradient spread over the row's logits (every column of every term)."""
        width = max(1, sum(c.shape[0] for c in cols))
        return 1 + -(-2 * self.dim // width)
