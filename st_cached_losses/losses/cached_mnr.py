from __future__ import annotations

from collections.abc import Callable, Sequence

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.functional import DEFAULT_MEMORY_BUDGET, LossPath
from st_cached_losses.losses._base import CachedInfoNCEBase
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.options import ONE_DIRECTION
from st_cached_losses.losses.signatures import arguments, shared_docs


class CachedMNRLoss(CachedInfoNCEBase):
    _citations = (GRADCACHE_CITATION, MNRL_CITATION)

    @shared_docs
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
            {doc:similarity}
            {doc:mini_batches}
            gather_across_devices: score each process's anchors against the candidates of every process.
            directions: the similarity terms of each row, as sentence-transformers' ``MultipleNegativesRankingLoss``:
                {doc:directions}
            {doc:partition_mode}
            {doc:hardness}
            {doc:mask_duplicates}
            {doc:engine}
            {spec:path memory_budget}

        References:
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983
            - Henderson et al., Efficient Natural Language Response Suggestion for Smart Reply, 2017:
              https://huggingface.co/papers/1705.00652

        {doc:inputs}

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
        super().__init__(**arguments(locals()))
