"""The score a logit tile is made of: cosine or dot products as GEMMs, or any similarity function.

``"cosine"`` and ``"dot"`` are GEMM tiles: the embeddings are normalised once (cosine), the rows carry
the scale, and a tile's logit gradient ``G`` meets the operands in two more GEMMs. Any other similarity
(``sentence_transformers.util.euclidean_sim``, ``manhattan_sim``, a user's function ``f(a (b, d), c (t, d))
-> (b, t)``) is scored exactly through autograd one tile at a time: the tile's logits are
``scale * f(a, c)`` on the raw embeddings, and its gradient is the vector-Jacobian product of ``f`` with
``G``, recomputed per tile (memory bounded by the tile, about 2-4x the GEMM path's time on CPU for
``cdist``-based functions). This class is where the scores of other embedding kinds plug in: a function
with ``token_score = True`` ([`MaxSim`][st_cached_losses.functional.representations.multi_vector.MaxSim]) reads packed ``(n, tokens, d + 1)`` token
operands (rows sliced like any other operand) and costs ``q_tokens x d_tokens`` per logit, which the
block plan accounts for ([`Score.entry_cost`][st_cached_losses.functional.score.Score.entry_cost]). A function with ``packed_rows = True``
([`SparseDot`][st_cached_losses.functional.representations.sparse.SparseDot]) reads other packed ``(n, k, c)`` rows the same way and states its own
``entry_cost``; a function with a ``vjp(g, a, c, rows, cols)`` method gives a tile's gradients in closed form
instead of through autograd, and with a ``scores_and_state(a, c)`` method it keeps what that ``vjp`` needs
of a scored tile (MaxSim: the max's winners) so that the gradient does not score the tile again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from st_cached_losses.functional.kernels.tiles import Operand, spans
from st_cached_losses.functional.precision import Products

__all__ = ["Score", "ScoreFn", "Similarity", "TileGraph"]

#: ``f(a (b, d), c (t, d)) -> (b, t)`` similarities, differentiable with torch.
ScoreFn = Callable[[Tensor, Tensor], Tensor]
Similarity = Literal["cosine", "dot"] | ScoreFn


@dataclass
class TileGraph:
    """A function score's tile ``sim (b, t)`` with its autograd graph to ``leaves`` (the tile's rows and
    columns, detached; those that want a gradient require it); or, for a function with a closed-form
    ``vjp`` that keeps what it needs of a tile (``scores_and_state``), that ``state`` and no graph."""

    sim: Tensor
    leaves: tuple[Tensor, Tensor]
    state: Any = None


class Score:
    """A similarity as the kernels use it: how to read operands, score a tile, and accumulate a tile's
    gradient into the operands' gradient buffers."""

    def __init__(self, similarity: Similarity, products: Products | None = None) -> None:
        #: how GEMM tiles are multiplied (``matmul_precision``); a function score's tiles are always fp32
        self.products = products if products is not None else Products()
        self.similarity = similarity
        if isinstance(similarity, str):
            if similarity not in ("cosine", "dot"):
                raise ValueError(f"similarity must be 'cosine', 'dot' or a function, got {similarity!r}.")
            self.fn: ScoreFn | None = None
            self.cosine = similarity == "cosine"
        elif callable(similarity):
            self.fn, self.cosine = similarity, False
        else:
            raise ValueError(
                f"similarity must be 'cosine', 'dot' or a function f(a, b) -> (len(a), len(b)) scores, got "
                f"{similarity!r}."
            )

    def with_products(self, products: Products) -> Score:
        """This score, its GEMM tiles multiplied as ``products`` says."""
        return Score(self.similarity, products)

    @property
    def gemm(self) -> bool:
        """Tiles are products of the operands (their transposes are the columns' tiles)."""
        return self.fn is None

    @property
    def tokens(self) -> bool:
        """Operands are packed ``(n, tokens, d + 1)`` multi-vector rows ([`multi_vector`][st_cached_losses.functional.representations.multi_vector])."""
        return bool(getattr(self.fn, "token_score", False))

    @property
    def packed(self) -> bool:
        """Operands are 3-D packed rows: token rows, or another packed form (``packed_rows``)."""
        return self.tokens or bool(getattr(self.fn, "packed_rows", False))

    def entry_cost(self, rows: Tensor, cols: list[Tensor]) -> int:
        """fp32 elements a tile holds per logit while it is scored and differentiated: 1 for embeddings;
        for token rows, the ``q_tokens x d_tokens`` similarities three times (their values, and in the
        per-tile backward the gradient through the max and through the mask); a function's own
        ``entry_cost(rows, cols)`` when it has one."""
        own = getattr(self.fn, "entry_cost", None)
        if own is not None:
            return int(own(rows, cols))
        if not self.tokens:
            return 1
        return 3 * rows.shape[1] * max(c.shape[1] for c in cols)

    def operand(self, x: Tensor, scale: float, prenormalize: bool) -> Operand:
        """``x`` as the kernels read it; a GEMM score folds ``scale`` (rows) into the tiles, a function
        scores the raw embeddings and its tile is scaled afterwards."""
        if self.fn is not None:
            return Operand(x, self.cosine, 1.0, prenormalize)
        return Operand(x, self.cosine, scale, prenormalize, rounds=self.products.rounds)

    def logits(self, q: Tensor, c: Tensor, scale: float) -> Tensor:
        """``(b, t)`` logits of rows ``q (b, d)`` against columns ``c (t, d)``, a new tensor."""
        if self.fn is None:
            return q @ c.T  # (b, d) @ (d, t); q carries the scale
        with torch.no_grad():
            sim = self.fn(q, c)
        return self._checked(sim, q, c).to(q.dtype) * scale

    def logits_with_graph(
        self, q: Tensor, c: Tensor, scale: float, rows_grad: bool, cols_grad: bool
    ) -> tuple[Tensor, TileGraph | None]:
        """[`logits`][st_cached_losses.functional.score.Score.logits] and, for a function score, the tile's autograd graph to the operands that want a
        gradient: [`accumulate`][st_cached_losses.functional.score.Score.accumulate] then back-propagates it instead of scoring the tile again. The graph
        holds what the function's backward saves (for MaxSim the max's indices, ``(b, t, q_tokens)``), not
        the token similarities."""
        if self.fn is None or not (rows_grad or cols_grad):
            return self.logits(q, c, scale), None
        keeping = getattr(self.fn, "scores_and_state", None)
        if keeping is not None:  # what the closed-form vjp needs of the tile, instead of a graph
            sim, state = keeping(q, c)
            return self._checked(sim, q, c).to(q.dtype) * scale, TileGraph(sim, (q, c), state)
        if hasattr(self.fn, "vjp"):
            return self.logits(q, c, scale), None
        leaves = (q.detach().requires_grad_(rows_grad), c.detach().requires_grad_(cols_grad))
        with torch.enable_grad():
            sim = self._checked(self.fn(*leaves), q, c)
        return sim.detach().to(q.dtype) * scale, TileGraph(sim, leaves)

    @staticmethod
    def _checked(sim: object, q: Tensor, c: Tensor) -> Tensor:
        if not isinstance(sim, Tensor) or sim.shape != (q.shape[0], c.shape[0]):
            got = tuple(sim.shape) if isinstance(sim, Tensor) else type(sim).__name__
            raise ValueError(
                f"the similarity function must map a ({q.shape[0]}, d) and a ({c.shape[0]}, d) tensor to "
                f"({q.shape[0]}, {c.shape[0]}) scores, got {got}."
            )
        return sim

    def accumulate(
        self,
        g: Tensor,
        q: Tensor,
        c: Tensor,
        g_rows: Tensor | None,
        g_cols: Tensor | None,
        scale: float,
        graph: TileGraph | None = None,
    ) -> None:
        """Add a tile's logit gradient ``g (b, t)`` to the rows' buffer ``g_rows (b, d)`` (before its final
        ``* scale``) and the columns' ``g_cols (t, d)``; ``graph``: the tile's, from
        [`logits_with_graph`][st_cached_losses.functional.score.Score.logits_with_graph] (else a function score is scored again, with autograd)."""
        if self.fn is None:
            if self.products.rounds:  # the gradient products' probabilities are bf16 too
                g = self.products.round(g)
            if g_rows is not None:
                g_rows.addmm_(g, c)  # (b, t) @ (t, d)
            if g_cols is not None:
                g_cols.addmm_(g.T, q)  # (t, b) @ (b, d); q carries the scale
            return
        vjp = getattr(self.fn, "vjp", None)
        if vjp is not None:  # the function's own closed-form gradients
            kept = {"state": graph.state} if graph is not None and graph.state is not None else {}
            g_q, g_c = vjp(g, q, c, g_rows is not None, g_cols is not None, **kept)
            if g_rows is not None:
                g_rows.add_(g_q)
            if g_cols is not None:
                g_cols.add_(g_c, alpha=scale)
            return
        if graph is None:
            graph = self.logits_with_graph(q, c, scale, g_rows is not None, g_cols is not None)[1]
        if graph is None:
            return
        wanted = [t for t in graph.leaves if t.requires_grad]
        with torch.enable_grad():
            grads = iter(torch.autograd.grad(graph.sim.to(g.dtype), wanted, g))
        if g_rows is not None:
            g_rows.add_(next(grads))
        if g_cols is not None:
            g_cols.add_(next(grads), alpha=scale)

    def positives(self, rows: Operand, cols: Operand, offset: int, tile: int, scale: float) -> Tensor:
        """``(n,)`` logits of row ``i`` against column entry ``offset + i``, fp32."""
        out = torch.empty(rows.n, dtype=rows.dtype, device=rows.x.device)
        for r0, r1 in spans(rows.n, tile):
            q, c = rows.tile(r0, r1), cols.tile(offset + r0, offset + r1)
            if self.fn is None:
                out[r0:r1] = (q * c).sum(1)
            elif hasattr(self.fn, "pairwise"):  # the diagonal alone (a token score's tile is costly)
                with torch.no_grad():
                    out[r0:r1] = self.fn.pairwise(q, c).to(out.dtype) * scale
            else:
                out[r0:r1] = self.logits(q, c, scale).diagonal()
        return out
