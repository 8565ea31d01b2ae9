"""What a call of the sigmoid loss is given and what it returns: [`SigmoidOptions`][st_cached_losses.functional.sigmoid.options.SigmoidOptions], the options of every
entry point of [`sigmoid`][st_cached_losses.functional.sigmoid.loss], written once, and [`SigmoidOutput`][st_cached_losses.functional.sigmoid.options.SigmoidOutput]."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import (
    bias_value,
    check_matmul_precision,
    check_path,
    check_positive_int,
    scale_value,
)
from st_cached_losses.functional.kernels.tiles import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.placement import LossPath
from st_cached_losses.functional.precision import MatmulPrecision, Products, global_matmul_precision
from st_cached_losses.functional.score import Score, Similarity

__all__ = ["SigmoidOptions", "SigmoidOutput"]


@dataclass(frozen=True, kw_only=True, eq=False)
class SigmoidOptions:
    """The options of every entry point of the sigmoid loss ([`sigmoid_loss`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss],
    [`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad]), as keywords
    (``sigmoid_loss(a, c, scale=10.0, bias=-10.0)``) or as one object whose fields the keywords replace.
    Checked when made.

    Args:
        scale: ``t`` in ``t * sim + b``: a positive float or a 0-d tensor (its gradient is returned when it
            requires grad). SigLIP learns it through its log (``scale = t'.exp()``, ``t'`` initialised to
            ``log 10``): pass ``log_scale.exp()``; its gradient then reaches ``log_scale`` through autograd,
            or, from [`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad], is ``grad_scale * scale``.
        bias: ``b`` in ``t * sim + b``: a finite float or a 0-d tensor (its gradient is returned when it
            requires grad). SigLIP starts it at -10, so that the many negative pairs do not dominate the
            first steps.
        similarity: ``"cosine"`` (embeddings normalised once), ``"dot"``, or a function
            ``f(a (b, d), c (t, d)) -> (b, t)`` scored exactly tile by tile through autograd (slower).
        path: ``"chunked"`` (row chunks against a whole column at a time), ``"tiled"`` (tiles in both
            dimensions, the columns normalised tile by tile: no fp32 copy of them) or ``"auto"`` (chunked
            when ``memory_budget`` allows chunks of at least 64 rows). Both are one pass: every pair's
            term is independent, so no statistics are needed before the gradients.
        chunk_size: rows per chunk for the chunked path (default: from ``memory_budget``).
        tile_size: tile side for the tiled path (default: from ``memory_budget``, at most 2048).
        memory_budget: bytes of blocks (two fp32 blocks of ``rows x columns``) to hold at once when sizes
            are not given.
        bank: ``(n, d)`` embeddings scored as extra negative columns of every row, without gradient (a
            negative bank: earlier steps' candidates). Across processes, this process's share (which may
            have 0 rows; every process passes one, or every process None); the strategies exchange every
            process's share like the candidates.
        row_offset: index of this process's first positive in the (gathered) candidate columns, for a
            caller who gathered the columns itself (0 on one process; the strategies across processes set
            it and refuse another value).
        check_finite: raise ``ValueError`` on NaN / inf embeddings (one cheap pass over the inputs; across
            processes [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes] checks every process at once instead).
        listed_negatives: the hard-negative columns (``candidates[1:]``) may have any number of rows, empty
            too (lists of hard negatives, each row its own number, flattened into one column): every one is a
            negative of every row, as a hard-negative column's rows are. One process only.
        matmul_precision: the precision of the similarity products, with
            ``torch.set_float32_matmul_precision``'s names: ``"highest"`` (fp32 products whatever torch's
            global setting, the exact path), ``"high"`` (TF32 on CUDA; fp32 on a CPU), ``"medium"`` (bf16
            operands: each normalised and scaled in fp32, then rounded; the gradient products' logit
            gradients rounded too; fp32 sums); None (default): ``torch.get_float32_matmul_precision()`` at
            the call. The softplus terms, the sigmoids, every sum and every accumulated gradient are fp32
            whatever it says; a similarity function and fp64 inputs keep fp32 (fp64) products
            ([`Products`][st_cached_losses.functional.precision.Products])."""

    scale: float | Tensor = 10.0
    bias: float | Tensor = -10.0
    similarity: Similarity = "cosine"
    path: LossPath = "auto"
    chunk_size: int | None = None
    tile_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    bank: Tensor | None = None
    row_offset: int = 0
    check_finite: bool = True
    listed_negatives: bool = False
    matmul_precision: MatmulPrecision | None = None

    def __post_init__(self) -> None:
        check_matmul_precision("matmul_precision", self.matmul_precision)
        scale_value(self.scale)
        bias_value(self.bias)
        score = Score(self.similarity)  # refuses anything but "cosine", "dot" or a function
        if score.packed:
            raise ValueError(
                "the sigmoid loss scores (rows, dim) embeddings: a score of packed rows (multi-vector, sparse) "
                "is not supported; pass similarity='cosine', 'dot' or a function of two (rows, dim) tensors."
            )
        check_path("path", self.path)
        for name in ("chunk_size", "tile_size", "memory_budget"):
            check_positive_int(name, getattr(self, name))

    @classmethod
    def of(cls, options: SigmoidOptions | None, keywords: dict[str, Any]) -> SigmoidOptions:
        """An entry point's options: ``options`` (default: the defaults) with ``keywords`` replacing its fields."""
        if options is None:
            return cls(**keywords)
        if not isinstance(options, cls):
            raise TypeError(
                f"options must be a SigmoidOptions, got {options!r}: pass the options as keywords."
            )
        return replace(options, **keywords) if keywords else options

    def products(self, anchors: Tensor) -> Products:
        """``matmul_precision`` as a call on ``anchors`` runs it: fp32 products for a similarity function and
        fp64 inputs, and for ``"high"`` where the device has no TF32 (a CPU); the torch blocks (the sigmoid
        loss has no fused kernels)."""
        if anchors.dtype == torch.float64 or not Score(self.similarity).gemm:
            return Products()
        precision = self.matmul_precision or global_matmul_precision(anchors.device.type)
        if precision == "highest" or (precision == "high" and anchors.device.type != "cuda"):
            return Products()
        return Products(precision)

    def score(self, anchors: Tensor) -> Score:
        """The blocks' score for a call on ``anchors``: the similarity, its products at
        [`products`][st_cached_losses.functional.sigmoid.options.SigmoidOptions.products]'s precision."""
        return Score(self.similarity, self.products(anchors))

    @property
    def scale_needs_grad(self) -> bool:
        return isinstance(self.scale, Tensor) and self.scale.requires_grad

    @property
    def bias_needs_grad(self) -> bool:
        return isinstance(self.bias, Tensor) and self.bias.requires_grad


@dataclass
class SigmoidOutput:
    """What [`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad] returns. Gradients are of ``grad_output * loss``."""

    loss: Tensor  #: 0-d, detached; fp32 (fp64 for fp64 inputs); across processes this process's share
    grad_anchors: Tensor | None  #: ``(B, d)`` in the anchors' dtype (None when only the loss was asked for)
    grad_candidates: list[Tensor]  #: one per candidate column, in its dtype (empty: loss only)
    grad_scale: Tensor | None  #: 0-d, when ``scale`` is a tensor that requires grad
    grad_bias: Tensor | None  #: 0-d, when ``bias`` is a tensor that requires grad
