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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from sentence_transformers.sparse_encoder.losses import FlopsLoss
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.engine.multimodal import input_keys
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.functional.flops import flops_loss_and_grad
from st_cached_losses.functional.sparse import SparseDot
from st_cached_losses.losses._base import LossStageOptions, StageOutput, StepData
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
        **engine: Unpack[LossStageOptions],
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

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan (``path``,
        ``tile_size``, ``memory_budget``), keyword-only, each documented once on
        [`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]; none changes the result.

        Args:
            model: the SparseEncoder to train (e.g. ``MLMTransformer`` + ``SpladePooling``).
            loss: the base loss, with ``compute_loss_from_embeddings(embeddings, labels)``; usually
                ``SparseMultipleNegativesRankingLoss(model)``.
            document_regularizer_weight: weight of the documents' regulariser ("lambda_d"): on the positives
                and negatives (every column but the first), or on every column with
                ``use_document_regularizer_only``.
            query_regularizer_weight: weight of the queries' regulariser ("lambda_q"), on the first column;
                None: no query regulariser (inference-free models).
            document_regularizer: the documents' regulariser instead of the default ``FlopsLoss``.
            query_regularizer: the queries' regulariser instead of the default ``FlopsLoss``.
            document_regularizer_threshold: the default FLOPS of the documents counts only rows with more than
                this many non-zero entries (FLOPS with l0 masking).
            query_regularizer_threshold: the same for the queries' FLOPS.
            use_document_regularizer_only: every column is a document (symmetric data): one regulariser
                over all of them, weighted by ``document_regularizer_weight``.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per encoder mini-batch instead.
            show_progress_bar: tqdm bars over the mini-batches.
            mask_duplicates: mask false negatives found by equal inputs (see ``CachedMNRLoss``); with the
                core's base loss only.

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
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.mask_duplicates = mask_duplicates
        self.loss = loss
        self._checked: tuple[Any, ...] | None = None
        self.document_regularizer_weight = document_regularizer_weight
        query_weight = weight_value("query_regularizer_weight", query_regularizer_weight, optional=True)
        check_bool("use_document_regularizer_only", use_document_regularizer_only)
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
        self.use_document_regularizer_only = use_document_regularizer_only
        self.query_regularizer_weight = query_weight
        if on_core(loss):
            self._core_options()

    def _cache_form(self) -> CompactSparseRows:
        # the engine's cache keeps the embeddings packed when that is exact and saves memory (decided at
        # every step, from the settings then)
        return CompactSparseRows(self._compact_allowed, across=self._compact_across)

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

    def _check_columns(self, features: list[dict[str, Any]]) -> None:
        if on_core(self.loss):
            super()._check_columns(features)
        elif self.mask_duplicates:
            raise ValueError(
                f"CachedSparseLoss: mask_duplicates masks the negatives of SparseMultipleNegativesRankingLoss; the base "
                f"loss is a {type(self.loss).__name__}. Set mask_duplicates=False."
            )

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        # false negatives are recognised by their token ids (embeddings differ under dropout)
        return StepData(keys=[input_keys(f) for f in features] if self.mask_duplicates else None)

    def _loss_stage(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData, with_grad: bool
    ) -> StageOutput:
        """The loss's components (0-d, detached; the regularisers weighted), in sentence-transformers'
        keys and order, their sum, and with ``with_grad`` the gradient of the sum wrt every column."""
        parts: dict[str, Tensor] = {}
        grads: list[Tensor] | None
        gather = False
        # packed rows (the engine's compact cache): (B, k, 2) indices and values of the non-zero entries
        dim = cast(CompactSparseRows, self.cache.form).dim if embeddings[0].dim() == 3 else None
        if on_core(self.loss):
            gather = self.gather_across_devices
            sizes = self._agree(embeddings)  # also the finiteness check
            scale, _ = self._core_options()
            options = self._options(step, len(embeddings[0]), len(embeddings) - 1, scale)
            if dim is not None:
                options = replace(options, similarity=SparseDot(dim))
            out = self._ranking(embeddings, options, sizes, with_grad)
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
        total = torch.stack([v.float() for v in parts.values()]).sum()
        return StageOutput(total, grads, parts=parts)

    def _autograd_loss(self, embeddings: list[Tensor], labels: Tensor | None, step: StepData) -> Tensor:
        """The total loss with exactly the computed gradient wrt each embedding, as a graph."""
        with_grad = any(e.requires_grad for e in embeddings)
        out = self._loss_stage(embeddings, labels, step, with_grad=with_grad)
        step.parts = out.parts
        if out.grads is None:
            return out.loss
        # the value, with exactly the computed gradient wrt each embedding ((e - e) is exactly 0)
        return out.loss + sum(((e - e.detach()) * g.to(e.dtype)).sum() for e, g in zip(embeddings, out.grads))

    def _returned(self, loss: Tensor, step: StepData, *, training: bool) -> Tensor | dict[str, Tensor]:
        """A dict of components, as sentence-transformers' SpladeLoss."""
        assert step.parts is not None  # every loss stage of this loss leaves them
        if not training:
            return step.parts
        # the trainer sums the components and back-propagates the sum: the first carries the graph (the
        # total minus the others), the others are values for its logs, as sentence-transformers does
        values = {k: v.detach().float().to(loss.device) for k, v in step.parts.items()}
        first = next(iter(values))
        others = sum((v for k, v in values.items() if k != first), start=torch.zeros_like(loss))
        return {k: (loss - others if k == first else v) for k, v in values.items()}
