"""SPLADE with GradCache: sentence-transformers' ``CachedSpladeLoss``, with the loss stage of the one core.

The sparse encoder is embedded in mini-batches by the engine (stage 1, no graph), the loss and its gradient
wrt every embedding are computed (stage 2) and the encoder is replayed with them (stage 3), as for the other
cached losses. Stage 2 is:

* the base loss: a ``SparseMultipleNegativesRankingLoss`` (any ``MultipleNegativesRankingLoss`` whose
  ``compute_loss_from_embeddings`` is theirs) on the one core ([`st_cached_losses.functional`][st_cached_losses.functional]), chunked
  or tiled, gathered or by ring across processes, with every option it has (``scale``, ``similarity_fct``,
  ``directions``, ``partition_mode``, ``hardness_*``, ``gather_across_devices``), read from the base loss at
  every step; any other base loss with ``compute_loss_from_embeddings`` through autograd on the whole batch,
  as sentence-transformers does;
* the FLOPS regularisers (their ``FlopsLoss``, thresholds included) from column sums, with their analytic
  gradient ([`st_cached_losses.functional.flops`][st_cached_losses.functional.flops]); another regulariser through autograd.

The engine keeps the cached embeddings and their gradients compact (each row's non-zero entries, packed:
[`st_cached_losses.losses.sparse_cache`][st_cached_losses.losses.sparse_cache]) when that is exact and saves memory; the loss stage then
reads them packed ([`SparseDot`][st_cached_losses.functional.sparse.SparseDot], FLOPS by scatter-add) and never
builds a dense ``B x V`` matrix.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from sentence_transformers.sparse_encoder.losses import FlopsLoss
from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath
from st_cached_losses.functional.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional.flops import flops_loss_and_grad
from st_cached_losses.functional.keys import input_hashes
from st_cached_losses.functional.parallel import agree_on_sizes, loss_and_grad
from st_cached_losses.functional.sparse import SparseDot
from st_cached_losses.losses._base import StepData, check_columns
from st_cached_losses.losses.citations import (
    FLOPS_CITATION,
    GRADCACHE_CITATION,
    SPLADE_CITATION,
)
from st_cached_losses.losses.settings import check_bool
from st_cached_losses.losses.sparse_cache import CompactSparseRows, zero_gradient_at_zero
from st_cached_losses.losses.sparse_settings import SparseLossSettings, is_flops, on_core, weight_value

logger = logging.getLogger(__name__)

__all__ = ["CachedSparseLoss"]


def _autograd_loss_and_grad(
    fn: Callable[[list[Tensor]], Tensor | dict[str, Tensor]], columns: Sequence[Tensor], with_grad: bool
) -> tuple[dict[str, Tensor] | Tensor, list[Tensor] | None]:
    """A loss of the whole batch through autograd (what sentence-transformers computes), and its gradient
    wrt each column: for base losses and regularisers that are not the core's."""
    leaves = [c.detach().requires_grad_(with_grad) for c in columns]
    with torch.enable_grad() if with_grad else torch.no_grad():
        out = fn(leaves)
    if not with_grad:
        return out, None
    total = torch.stack(list(out.values())).sum() if isinstance(out, dict) else out
    found = (
        torch.autograd.grad(total, leaves, allow_unused=True) if total.requires_grad else [None] * len(leaves)
    )
    grads = [g if g is not None else torch.zeros_like(c) for g, c in zip(found, leaves)]
    detached = {k: v.detach() for k, v in out.items()} if isinstance(out, dict) else out.detach()
    return detached, grads


def _weighted(regularizer: Any, weight: float, columns: list[Tensor]) -> Tensor:
    """A regulariser of the rows of ``columns`` together (their concatenation), weighted."""
    return regularizer.compute_loss_from_embeddings(torch.cat(columns)) * weight


class CachedSparseLoss(SparseLossSettings):
    _citations = (GRADCACHE_CITATION, SPLADE_CITATION, FLOPS_CITATION)
    equivalent_st_loss = "CachedSpladeLoss"
    #: the model kind it trains (another is refused at construction)
    model_kind = "SparseEncoder"

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        document_regularizer_weight: float,
        query_regularizer_weight: float | None = None,
        document_regularizer: nn.Module | None = None,
        query_regularizer: nn.Module | None = None,
        document_regularizer_threshold: float | None = None,
        query_regularizer_threshold: float | None = None,
        use_document_regularizer_only: bool = False,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        show_progress_bar: bool = False,
        *,
        mask_duplicates: bool = False,
        path: LossPath = "auto",
        tile_size: int | None = None,
        memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
        keep_params_unsharded: bool = False,
        graph_memory_budget: int | str | None = None,
        mini_batch_memory_budget: int | str | None = None,
    ) -> None:
        """
        SPLADE's loss (a ranking loss plus FLOPS regularisers on the documents and the queries) with
        GradCache: the gradients of a batch of thousands with the memory of one encoder mini-batch, exactly
        those of sentence-transformers' ``SpladeLoss`` / ``CachedSpladeLoss``.

        With ``SparseMultipleNegativesRankingLoss`` as the base loss (the usual choice), the ranking loss and
        its gradient wrt every embedding are computed by the core in chunks sized from ``memory_budget`` (dot
        products of the vocabulary-sized rows, no ``B x C`` score matrix), gathered or by ring exchange across
        processes; the FLOPS regularisers come from the column sums of the cached embeddings, with their
        gradient in closed form. Any other base loss (or regulariser) with ``compute_loss_from_embeddings``
        runs on the whole batch through autograd, as in sentence-transformers.

        The constructor takes ``CachedSpladeLoss``'s arguments in its positional order, then our extras,
        keyword-only. The base loss's settings (``scale``, ``similarity_fct``, ``directions``,
        ``partition_mode``, ``hardness_mode``, ``hardness_strength``, ``gather_across_devices``) stay on the
        base loss, read at every step, and are also properties of this loss (reading or setting one
        reads or sets the base loss's, checked).

        Args:
            model: the SparseEncoder to train (e.g. ``MLMTransformer`` + ``SpladePooling``).
            loss: the base loss, with ``compute_loss_from_embeddings(embeddings, labels)``; usually
                ``SparseMultipleNegativesRankingLoss(model)``.
            document_regularizer_weight: weight of the documents' regulariser ("lambda_d"): on the positives
                and negatives (every column but the first), or on every column with
                ``use_document_regularizer_only``.
            query_regularizer_weight: weight of the queries' regulariser ("lambda_q"), on the first column;
                None: no query regulariser (inference-free models).
            document_regularizer / query_regularizer: regularisers instead of the default ``FlopsLoss``.
            document_regularizer_threshold / query_regularizer_threshold: the default FLOPS counts only rows
                with more than this many non-zero entries (FLOPS with l0 masking).
            use_document_regularizer_only: every column is a document (symmetric data): one regulariser
                over all of them, weighted by ``document_regularizer_weight``.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per encoder mini-batch instead.
            show_progress_bar: tqdm bars over the mini-batches.
            mask_duplicates: mask false negatives found by equal token ids (see ``CachedMNRLoss``); with the
                core's base loss only.
            path / tile_size / memory_budget: the core's algorithm (``"auto"``, ``"chunked"``, ``"tiled"``;
                across processes tiled is the ring exchange) and its block sizes.
            sort_by_length / reuse_last_graph / keep_params_unsharded / graph_memory_budget /
                mini_batch_memory_budget: engine options, never changing the result (see ``CachedMNRLoss``).

        References:
            - Formal et al., From Distillation to Hard Negative Sampling: Making Sparse Neural IR Models More
              Effective, 2022: https://huggingface.co/papers/2205.04733
            - Paria et al., Minimizing FLOPs to Learn Efficient Sparse Representations, 2020:
              https://huggingface.co/papers/2004.05665
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. A SparseEncoder whose inputs have a batch dimension.
            2. The inputs of the base loss: (anchor, positive[, negatives...]) for
               ``SparseMultipleNegativesRankingLoss``.

        Inputs:
            | Texts | Labels |
            |---|---|
            | (anchor, positive) pairs | none |
            | (anchor, positive, negative_1, ..., negative_n) | none |
            | what another base loss takes | its |

        Returns (forward):
            a dict of the loss's components, as sentence-transformers' ``SpladeLoss``: ``base_loss`` (or
            the base loss's own keys), ``document_regularizer_loss`` and, with a query weight,
            ``query_regularizer_loss``, the regularisers weighted. The trainer sums and logs them.

        Relations:
            - The same loss and gradients as ``SpladeLoss(model, loss, ...)`` and ``CachedSpladeLoss`` with the
              same arguments; on one process, and across processes with ``gather_across_devices`` on the
              base loss (then the regularisers are those of every process's rows together: the
              single-process loss of the whole batch).

        Example:
            ```python
            from datasets import Dataset
            from sentence_transformers.sparse_encoder import SparseEncoder, SparseEncoderTrainer, losses
            from st_cached_losses import CachedSparseLoss

            model = SparseEncoder("naver/splade-cocondenser-ensembledistil")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            loss = CachedSparseLoss(
                model,
                loss=losses.SparseMultipleNegativesRankingLoss(model),
                document_regularizer_weight=3e-5,
                query_regularizer_weight=5e-5,
                mini_batch_size=32,
            )
            trainer = SparseEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        if not hasattr(loss, "compute_loss_from_embeddings"):
            raise ValueError(
                f"CachedSparseLoss: the base loss {type(loss).__name__} has no compute_loss_from_embeddings"
                "(embeddings, labels) method; pass a sparse-encoder loss such as SparseMultipleNegativesRankingLoss."
            )
        super().__init__(
            model,
            scale=cast(Any, loss).scale if on_core(loss) else 1.0,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            mini_batch_memory_budget=mini_batch_memory_budget,
            show_progress_bar=show_progress_bar,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            keep_params_unsharded=keep_params_unsharded,
            graph_memory_budget=graph_memory_budget,
            path=path,
            tile_size=tile_size,
            memory_budget=memory_budget,
        )
        self.mask_duplicates = mask_duplicates
        self.loss = loss
        self._checked: tuple[Any, ...] | None = None
        self._document_regularizer_weight: float = weight_value(
            "document_regularizer_weight", document_regularizer_weight, optional=False
        )  # type: ignore[assignment]  # not None: not optional
        query_weight = weight_value("query_regularizer_weight", query_regularizer_weight, optional=True)
        self._use_document_regularizer_only = check_bool(
            "use_document_regularizer_only", use_document_regularizer_only
        )
        for name, threshold in [
            ("document_regularizer_threshold", document_regularizer_threshold),
            ("query_regularizer_threshold", query_regularizer_threshold),
        ]:
            weight_value(name, threshold, optional=True, example="100 (non-zero entries)")
        self.document_regularizer = (
            document_regularizer
            if document_regularizer is not None
            else FlopsLoss(cast(Any, model), threshold=document_regularizer_threshold)
        )
        # as sentence-transformers: no query regulariser when every column is a document, unless given
        self.query_regularizer: nn.Module | None = (
            query_regularizer
            if query_regularizer is not None
            else None
            if use_document_regularizer_only
            else FlopsLoss(cast(Any, model), threshold=query_regularizer_threshold)
        )
        if query_weight is None and not use_document_regularizer_only:
            logger.warning(
                "CachedSparseLoss: query_regularizer_weight is None, so the queries are not regularised: right for "
                "an inference-free model (queries not encoded by the model); otherwise set it, e.g. 5e-5."
            )
        if use_document_regularizer_only and query_weight is not None:
            logger.warning(
                "CachedSparseLoss: use_document_regularizer_only=True regularises every column as a document with "
                "document_regularizer_weight; query_regularizer_weight=%r is ignored (set to None).",
                query_weight,
            )
            query_weight = None
        self._query_regularizer_weight = query_weight
        if on_core(loss):
            self._core_options()
        # the engine's cache keeps the embeddings packed when that is exact and saves memory
        self.cache.form = CompactSparseRows(self._compact_allowed, across=self._compact_across)

    def _compact_allowed(self) -> bool:
        """Whether this step's embeddings may be kept packed ([`sparse_cache`][st_cached_losses.losses.sparse_cache]):
        the core computes the base loss with dot products, the regularisers are FLOPS, and the model is a
        SPLADE encoder whose exactly-zero entries have no gradient. Across processes (gathered or ring) too:
        the processes agree on the form (`_compact_across`)."""
        if not on_core(self.loss) or self._core_options()[1] != "dot":
            return False
        regularisers = [self.document_regularizer]
        if self.query_regularizer_weight is not None and self.query_regularizer is not None:
            regularisers.append(self.query_regularizer)
        return all(is_flops(r) for r in regularisers) and zero_gradient_at_zero(self.model)

    def _compact_across(self) -> bool:
        """Whether the loss stage reads every process's rows together (gathered or by ring): every process
        must then keep the same form, agreed on in one all-reduce."""
        return on_core(self.loss) and bool(self.gather_across_devices) and is_distributed()

    # ------------------------------------------------------------------ the loss stage

    def _loss_parts(
        self, embeddings: list[Tensor], labels: Tensor | None, keys: list[Tensor] | None, with_grad: bool
    ) -> tuple[dict[str, Tensor], list[Tensor] | None]:
        """The loss's components (0-d, detached; the regularisers weighted), in sentence-transformers'
        keys and order, and with ``with_grad`` the gradient of their sum wrt every column."""
        parts: dict[str, Tensor] = {}
        grads: list[Tensor] | None
        gather = False
        # packed rows (the engine's compact cache): (B, k, 2) indices and values of the non-zero entries
        dim = cast(CompactSparseRows, self.cache.form).dim if embeddings[0].dim() == 3 else None
        if on_core(self.loss):
            scale, _ = self._core_options()
            gather = self.gather_across_devices
            if gather and not is_distributed():
                warn_no_process_group_once(type(self).__name__)
            sizes = agree_on_sizes(embeddings, gather)  # also the finiteness check
            out = loss_and_grad(
                embeddings[0],
                embeddings[1:],
                sizes,
                ring=self.path == "tiled",
                with_grad=with_grad,
                scale=scale,
                **{
                    **self._core_kwargs(StepData(keys=keys), len(embeddings[0]), len(embeddings) - 1),
                    **({"similarity": SparseDot(dim)} if dim is not None else {}),
                },
            )
            parts["base_loss"] = out.loss
            grads = [out.grad_anchors, *out.grad_candidates] if with_grad else None  # type: ignore[list-item]
        else:
            base_loss: Any = self.loss
            base, grads = _autograd_loss_and_grad(
                lambda cols: base_loss.compute_loss_from_embeddings(cols, labels), embeddings, with_grad
            )
            parts.update(base if isinstance(base, dict) else {"base_loss": base})

        first = 0 if self.use_document_regularizer_only else 1
        regularisers = [
            ("document_regularizer_loss", self.document_regularizer, self.document_regularizer_weight, first)
        ]
        if self.query_regularizer_weight is not None and self.query_regularizer is not None:
            regularisers.append(
                ("query_regularizer_loss", self.query_regularizer, self.query_regularizer_weight, 0)
            )
        for key, regularizer, weight, start in regularisers:
            columns = embeddings[start:] if key == "document_regularizer_loss" else embeddings[:1]
            own = grads[start : start + len(columns)] if grads is not None else None
            if is_flops(regularizer):
                flops = flops_loss_and_grad(
                    columns,
                    regularizer.threshold,  # type: ignore[arg-type]
                    grad_output=weight,
                    with_grad=with_grad,
                    across_processes=gather,
                    accumulate=own,  # into the base loss's gradients, in place
                    dim=dim,
                )
                parts[key] = flops.loss
                continue
            value, reg_grads = _autograd_loss_and_grad(
                functools.partial(_weighted, regularizer, weight), columns, with_grad
            )
            assert isinstance(value, Tensor)
            parts[key] = value
            if own is not None and reg_grads is not None:
                for g, r in zip(own, reg_grads):
                    g.add_(r.to(g.dtype))
        if grads is not None and dim is not None:
            # packed gradients name their entries by the embeddings' indices (the engine scatters them)
            for g, e in zip(grads, embeddings):
                g[..., 0] = e[..., 0]
        return parts, grads

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: StepData | None = None,
    ) -> Tensor:
        """The total loss (base loss plus weighted regularisers) of already computed embeddings, in
        sentence-transformers' cached-loss interface (see [`CachedInfoNCEBase.calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss])."""
        embeddings = [torch.cat(r) if len(r) > 1 else r[0] for r in reps]
        autograd = not with_backward and torch.is_grad_enabled() and any(e.requires_grad for e in embeddings)
        keys = step.keys if step is not None else None
        parts, grads = self._loss_parts(embeddings, labels, keys, with_grad=with_backward or autograd)
        total = torch.stack([v.float() for v in parts.values()]).sum()
        if grads is None:
            return total
        if with_backward:
            for pieces, grad in zip(reps, grads):
                for piece, g in zip(pieces, grad.split([p.shape[0] for p in pieces])):
                    g = g.to(piece.dtype)
                    piece.grad = g if piece.grad is None else piece.grad + g
            return total
        # the value, with exactly the computed gradient wrt each embedding ((e - e) is exactly 0)
        return total + sum(((e - e.detach()) * g.to(e.dtype)).sum() for e, g in zip(embeddings, grads))

    def forward(  # type: ignore[override]  # a dict of components, as sentence-transformers' SpladeLoss
        self, sentence_features: Iterable[dict[str, Any]], labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        features = list(sentence_features)
        self._tag_model_card()
        core = on_core(self.loss)
        if core:
            try:
                check_columns(features, type(self).__name__)
            except ValueError as exc:  # the other processes are about to wait for this one: tell them
                self.cache.raise_on_every_process(self.model, exc)
        if self.mask_duplicates and not core:
            raise ValueError(
                f"CachedSparseLoss: mask_duplicates masks the negatives of SparseMultipleNegativesRankingLoss; the base "
                f"loss is a {type(self.loss).__name__}. Set mask_duplicates=False."
            )
        keys = [input_hashes(f) for f in features] if self.mask_duplicates else None
        if not torch.is_grad_enabled():
            # evaluation: the same loss, mini-batched, no caching and no graph
            embeddings = self.cache.embed(self.model, features)
            return self._loss_parts(embeddings, labels, keys, with_grad=False)[0]
        self._warn_if_caching_off(features)
        found: dict[str, Tensor] = {}

        def stage2(embeddings: list[Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
            parts, grads = self._loss_parts(embeddings, labels, keys, with_grad=True)
            assert grads is not None
            found.update(parts)
            return torch.stack([v.float() for v in parts.values()]).sum(), grads, [None]

        total = self.cache.step(self.model, features, stage2)
        # the trainer sums the components and back-propagates the sum: the first carries the graph (the
        # total minus the others), the others are values for its logs, as sentence-transformers does
        values = {k: v.detach().float().to(total.device) for k, v in found.items()}
        first = next(iter(values))
        others = sum((v for k, v in values.items() if k != first), start=torch.zeros_like(total))
        return {k: (total - others if k == first else v) for k, v in values.items()}
