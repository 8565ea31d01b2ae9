from __future__ import annotations

from collections.abc import Callable, Sequence

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.options import ONE_DIRECTION


class CachedMNRLoss(CachedInfoNCEBase):
    _citations = (GRADCACHE_CITATION, MNRL_CITATION)

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] = ONE_DIRECTION,
        partition_mode: str = "joint",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
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
        Multiple-negatives ranking loss (InfoNCE with in-batch negatives) with GradCache: the gradients of a
        batch of thousands with the memory of one encoder mini-batch, exactly.

        Each anchor is scored against its positive, every hard negative, and every other row's positive and
        negatives; the loss is the cross-entropy of picking the positive. The batch is embedded in mini-batches
        without a graph, the loss and its gradient wrt every embedding are computed in chunks sized from a
        memory budget (normalised once, one pass, no ``B x C`` matrix), and the encoder is replayed mini-batch
        by mini-batch in backward with the cached gradients. Rows are embedded longest first so mini-batches
        carry little padding, the last mini-batch's graph is kept instead of re-run, and a batch that fits in
        one mini-batch is not cached at all.

        Args:
            model: the SentenceTransformer to train.
            scale: multiplies the similarities (``1 / temperature``); 20 suits cosine similarity.
            similarity_fct: ``sentence_transformers.util.cos_sim`` / ``"cosine"`` (default) or
                ``dot_score`` / ``"dot"``. Other callables are refused: the full matrix is never built.
            mini_batch_size: rows per encoder forward; sets the memory, not the result.
            mini_batch_num_tokens: optional budget of real (non-padding) tokens per encoder mini-batch, as in
                sentence-transformers: rows are packed while their token count stays within it (a longer row
                alone), longest rows first, and ``mini_batch_size`` is not used. For data of very uneven length.
            gather_across_devices: score each process's anchors against the candidates of every process.
            directions: the similarity terms of each row, as sentence-transformers' ``MultipleNegativesRankingLoss``:
                ``"query_to_doc"`` (required: every candidate column), ``"query_to_query"`` (the other anchors),
                ``"doc_to_query"`` (the positive against every anchor), ``"doc_to_doc"`` (the positive against every
                other row's documents).
            partition_mode: ``"joint"`` (one softmax over every selected term; GTE with all four directions) or
                ``"per_direction"`` (one per direction, averaged; not with ``query_to_query`` / ``doc_to_doc``).
            show_progress_bar: tqdm bars over the mini-batches of both passes.
            hardness_mode: ``None``, ``"in_batch_negatives"`` (Lan et al. 2025), ``"hard_negatives"`` (EmbeddingGemma)
                or ``"all_negatives"``: adds ``hardness_strength * stop_grad(similarity)`` (not scaled) to those
                negatives' logits, as sentence-transformers does.
            hardness_strength: the penalty's ``alpha``, non-negative; unused while ``hardness_mode`` is None.
            mask_duplicates: mask false negatives found by equal inputs (token ids), on this process and
                across processes (which the NO_DUPLICATES sampler cannot see beyond one process's batch).
                Rows sharing their anchor or their positive are duplicates: a row's negatives lose the
                positives of its duplicates, and any candidate (hard negatives included) equal to its own
                positive. Off by default.
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
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983
            - Henderson et al., Efficient Natural Language Response Suggestion for Smart Reply, 2017:
              https://huggingface.co/papers/1705.00652

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
            2. A model whose inputs have a batch dimension (not StaticEmbedding).

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Recommendations:
            - ``batch_sampler=BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.

        Relations:
            - Same loss and gradients as ``sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss``; same role
              as its ``CachedMultipleNegativesRankingLoss``, with a loss stage that is several times faster.
            - :class:`CachedCLIPLoss` adds the positive -> anchor direction; :class:`CachedTiledLoss` never holds
              more than one logit tile.

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_cached_losses import CachedMNRLoss

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = CachedMNRLoss(model, mini_batch_size=32)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
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
            path=path,
            memory_budget=memory_budget,
            mask_duplicates=mask_duplicates,
            sort_by_length=sort_by_length,
            reuse_last_graph=reuse_last_graph,
            keep_params_unsharded=keep_params_unsharded,
            graph_memory_budget=graph_memory_budget,
            mini_batch_memory_budget=mini_batch_memory_budget,
        )
