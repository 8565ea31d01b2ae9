from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.citations import CLIP_CITATION, GRADCACHE_CITATION, INFCL_CITATION


class CachedTiledLoss(CachedInfoNCEBase):
    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        symmetric: bool = False,
        tile_size: int | None = None,
        mini_batch_size: int = 32,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        *,
        similarity_fct: Callable[..., Tensor] | str = "cosine",
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        mini_batch_num_tokens: int | None = None,
        mask_duplicates: bool = False,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        """
        InfoNCE with GradCache and an Inf-CL-style tiled loss stage: no block of the logits larger than one
        ``tile_size x tile_size`` tile is ever held, so the loss stage needs ``O((B + C) d)`` memory whatever
        the batch; across processes the candidate blocks travel around a ring instead of being gathered.

        The log-sum-exp of each row (and, with ``symmetric=True``, of each positive's column) is accumulated
        with a running maximum over tiles in fp32; a second pass recomputes each tile and accumulates the
        gradients. Unlike Inf-CL: hard-negative columns, cosine or dot similarity, any scale (max-subtraction
        everywhere), a correct learnable-scale gradient, pure PyTorch on any device.

        Args:
            model: the SentenceTransformer to train.
            scale: ``1 / temperature`` (initial value when learnable).
            symmetric: also the positive -> anchors direction, averaged (the CLIP loss).
            tile_size: side of a logit tile (default: from ``memory_budget``, at most 2048).
            mini_batch_size: rows per encoder forward; sets the memory, not the result.
            gather_across_devices: score against the candidates of every process (ring exchange).
            show_progress_bar: tqdm bars over the mini-batches of both passes.
            similarity_fct: ``cos_sim`` / ``"cosine"`` (default) or ``dot_score`` / ``"dot"``.
            learnable_scale: learn the scale as ``logit_scale = log(scale)``, clamped at ``max_scale``.
            max_scale: the clamp of a learned scale.
            mini_batch_num_tokens: optional token budget per mini-batch (rows x padded length).
            mask_duplicates: mask false negatives found by equal inputs (token ids), on this process and
                across processes (which the NO_DUPLICATES sampler cannot see beyond one process's batch).
                Rows sharing their anchor or their positive are duplicates: a row's negatives lose the
                positives of its duplicates (and any candidate equal to its own positive); with
                ``symmetric``, a positive's negatives lose the anchors of its row's duplicates too, so
                both directions are masked alike. Off by default.
            sort_by_length: embed each column's rows longest first (less padding); never changes the result.
            reuse_last_graph: keep the last mini-batch's graph from the first pass instead of re-running it.
            memory_budget: bytes of logit tiles the loss stage may hold at once when ``tile_size`` is None.

        References:
            - Cheng et al., Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive Loss,
              2024: https://huggingface.co/papers/2410.17243
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (anchor, positive) pairs, optionally with hard-negative columns.
            2. A model whose inputs have a batch dimension (not StaticEmbedding).

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Relations:
            - Same loss as :class:`CachedMNRLoss` (``symmetric=False``) or :class:`CachedCLIPLoss`
              (``symmetric=True``); trades ~1.3x loss-stage flops for memory that does not grow with B x C.

        Example:
            ::

                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_cached_losses import CachedTiledLoss

                model = SentenceTransformer("all-MiniLM-L6-v2")
                loss = CachedTiledLoss(model, symmetric=True, tile_size=1024, mini_batch_size=32)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        super().__init__(
            model,
            scale=scale,
            similarity_fct=similarity_fct,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            symmetric=symmetric,
            learnable_scale=learnable_scale,
            max_scale=max_scale,
            path="tiled",
            tile_size=tile_size,
            memory_budget=memory_budget,
            gather_across_devices=gather_across_devices,
            mask_duplicates=mask_duplicates,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            show_progress_bar=show_progress_bar,
        )

    @property
    def citation(self) -> str:  # type: ignore[override]
        return GRADCACHE_CITATION + INFCL_CITATION + (CLIP_CITATION if self.symmetric else "")

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        config["symmetric"] = self.symmetric
        return config
