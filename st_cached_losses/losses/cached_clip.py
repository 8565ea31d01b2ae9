from __future__ import annotations

from collections.abc import Callable, Sequence

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.citations import CLIP_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.options import TWO_DIRECTIONS


class CachedCLIPLoss(CachedInfoNCEBase):
    _citations = (GRADCACHE_CITATION, CLIP_CITATION)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] = TWO_DIRECTIONS,
        partition_mode: str = "per_direction",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        mask_duplicates: bool = False,
        sort_by_length: bool = True,
        reuse_last_graph: bool = True,
        keep_params_unsharded: bool = False,
        graph_memory_budget: int | str | None = None,
        mini_batch_memory_budget: int | str | None = None,
        path: LossPath = "auto",
        memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        """
        Symmetric (CLIP-style) InfoNCE with GradCache: the mean of anchor -> candidates and positive -> anchors,
        optionally with a learnable temperature, exact at any batch size with the memory of one mini-batch.

        Each anchor picks its positive among all positives and hard negatives of the batch, and each positive
        picks its anchor among all anchors; the two cross-entropies are averaged. With ``learnable_scale=True``
        the log of the scale is an ``nn.Parameter`` (``logit_scale``, CLIP's parametrisation) clamped at
        ``max_scale``: the stock ``SentenceTransformerTrainer`` optimises it, saves it in checkpoints and
        restores it on ``resume_from_checkpoint``.

        Args:
            model: the SentenceTransformer to train.
            scale: multiplies the similarities (``1 / temperature``); 20 suits cosine similarity. The initial value when learnable (CLIP starts at 1/0.07 = 14.3).
            similarity_fct: ``sentence_transformers.util.cos_sim`` / ``"cosine"`` (default) or
                ``dot_score`` / ``"dot"``. Other callables are refused: the full matrix is never built.
            mini_batch_size: rows per encoder forward; sets the memory, not the result.
            mini_batch_num_tokens: optional budget of real (non-padding) tokens per encoder mini-batch, as in
                sentence-transformers: rows are packed while their token count stays within it (a longer row
                alone), longest rows first, and ``mini_batch_size`` is not used. For data of very uneven length.
            gather_across_devices: score each process's anchors against the candidates of every process (anchors too, for the symmetric direction).
            directions: the similarity terms of each row, as sentence-transformers' ``MultipleNegativesRankingLoss``:
                ``"query_to_doc"`` (required: every candidate column), ``"query_to_query"`` (the other anchors),
                ``"doc_to_query"`` (the positive against every anchor), ``"doc_to_doc"`` (the positive against every
                other row's documents). The default is the symmetric loss.
            partition_mode: ``"joint"`` (one softmax over every selected term; GTE with all four directions) or
                ``"per_direction"`` (one per direction, averaged; not with ``query_to_query`` / ``doc_to_doc``).
            show_progress_bar: tqdm bars over the mini-batches of both passes.
            hardness_mode: ``None``, ``"in_batch_negatives"`` (Lan et al. 2025), ``"hard_negatives"`` (EmbeddingGemma)
                or ``"all_negatives"``: adds ``hardness_strength * stop_grad(similarity)`` (not scaled) to those
                negatives' logits, as sentence-transformers does.
            hardness_strength: the penalty's ``alpha``, non-negative; unused while ``hardness_mode`` is None.
            learnable_scale: learn the scale (as ``logit_scale = log(scale)``); give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it with checkpoints.
            max_scale: the clamp of a learned scale (CLIP: 100).
            mask_duplicates: mask false negatives found by equal inputs (token ids), on this process and
                across processes (which the NO_DUPLICATES sampler cannot see beyond one process's batch).
                Rows sharing their anchor or their positive are duplicates, masked in both directions: a
                row's negatives lose the positives of its duplicates (and any candidate equal to its own
                positive), and a positive's negatives lose the anchors of its row's duplicates. Off by
                default.
            sort_by_length: embed each column's rows longest first (less padding); never changes the result.
            reuse_last_graph: keep the last mini-batch's graph from the first pass instead of re-running it.
            keep_params_unsharded: under FSDP2, gather every parameter group once per step and keep it until the
                last replay (one all-gather and one reduce-scatter per group per step, against one all-gather per
                mini-batch forward and replay); every process then holds the full parameters for the step. Off.
            path: the loss-stage algorithm, ``"auto"``, ``"chunked"`` or ``"tiled"``.
                mini_batch_memory_budget: with ``mini_batch_size="auto"`` (or ``mini_batch_num_tokens="auto"``),
                    the activation memory one encoder mini-batch may take (bytes or e.g. ``"2GB"``; on CUDA, by default
                    half the free memory): the largest mini-batch that fits is measured at the first step and logged.
                graph_memory_budget: bytes (or a size such as ``"6GB"``) of first-pass autograd graphs to keep
                instead of replaying their mini-batches: measured on the first mini-batch, the longest ones kept
                first while they fit; the same gradients, fewer forwards. None (default): replay all but the last.
            memory_budget: bytes of logit blocks the loss stage may hold at once.

        References:
            - Radford et al., Learning Transferable Visual Models From Natural Language Supervision, 2021:
              https://huggingface.co/papers/2103.00020
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (anchor, positive) pairs, optionally with hard-negative columns (used in the anchor direction).
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
            - Same loss as ``sentence_transformers.sentence_transformer.losses.MultipleNegativesSymmetricRankingLoss`` /
              ``MultipleNegativesRankingLoss(directions=("query_to_doc", "doc_to_query"),
              partition_mode="per_direction")``, cached, with an optional learnable temperature.
            - :class:`CachedTiledLoss` (``symmetric=True``) computes the same loss without a chunk x C block.

        Example:
            ::

                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_cached_losses import CachedCLIPLoss, LossStateCallback

                model = SentenceTransformer("all-MiniLM-L6-v2")
                loss = CachedCLIPLoss(model, scale=1 / 0.07, learnable_scale=True, mini_batch_size=32)
                trainer = SentenceTransformerTrainer(
                    model=model, train_dataset=train_dataset, loss=loss,
                    callbacks=[LossStateCallback(loss)],  # the scale saved / restored with checkpoints
                )
                trainer.train()
        """
        super().__init__(
            model,
            scale,
            similarity_fct,
            mini_batch_size,
            mini_batch_num_tokens,
            gather_across_devices,
            directions,
            partition_mode,
            show_progress_bar,
            hardness_mode,
            hardness_strength,
            learnable_scale=learnable_scale,
            max_scale=max_scale,
            path=path,
            memory_budget=memory_budget,
            mask_duplicates=mask_duplicates,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            keep_params_unsharded=keep_params_unsharded,
            graph_memory_budget=graph_memory_budget,
            mini_batch_memory_budget=mini_batch_memory_budget,
        )
