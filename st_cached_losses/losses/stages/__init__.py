"""The loss stages the cached losses compose (see [`Stage`][st_cached_losses.losses.base.Stage]): each computes
a loss of the cached rows and its gradients with respect to them, without a graph to the encoder.

* [`InfoNCE`][st_cached_losses.losses.stages.infonce.InfoNCE]: the package's InfoNCE core over a loss's logit
  terms, with duplicate masks, a guide's masks (GIST), a negative bank, and each row's own candidates only
  (``in_batch_negatives=False``); one process, gathered or by ring across processes;
* [`Distillation`][st_cached_losses.losses.stages.distill.Distillation]: the KL divergence or the MSE of the
  margins against a teacher's scores, in row chunks;
* [`EmbedDistill`][st_cached_losses.losses.stages.embed_distill.EmbedDistill]: a teacher's embeddings against
  the student's, pointwise (through a projection) and listwise (the teacher's softmax over the whole batch);
* [`WeightedSum`][st_cached_losses.losses.stages.weighted.WeightedSum]: stages added with weights
  (distillation plus InfoNCE);
* [`Splade`][st_cached_losses.losses.stages.sparse.Splade]: a sparse encoder's base loss plus its FLOPS
  regularisers;
* [`PairScores`][st_cached_losses.losses.stages.reranker.PairScores]: a reranker's cross-entropy over each
  query's pair scores.
"""

from st_cached_losses.losses.stages.distill import Distillation
from st_cached_losses.losses.stages.embed_distill import EmbedDistill
from st_cached_losses.losses.stages.infonce import GuideModel, InfoNCE
from st_cached_losses.losses.stages.reranker import PairScores
from st_cached_losses.losses.stages.sparse import Splade
from st_cached_losses.losses.stages.weighted import WeightedSum

__all__ = ["Distillation", "EmbedDistill", "GuideModel", "InfoNCE", "PairScores", "Splade", "WeightedSum"]
