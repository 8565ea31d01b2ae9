"""The caching engine (GradCache): embed without a graph, cache the loss's gradient wrt the embeddings,
replay the encoder mini-batch by mini-batch in backward. The mini-batch plans (``planning``), the RNG
snapshots of every device type (``rng``), graphs kept within a memory budget (``graph_budget``), ``"auto"``
mini-batch sizes from forwards at two sizes (``auto_size``), the
tokenizer features (``features``), a multimodal column's images and videos (``multimodal``) and, in one
module, the training wrappers: DDP / FSDP1 / FSDP2 / DeepSpeed (``wrappers``).

No loss math. May import the functional layer, torch and tqdm; never
the losses, the configuration or the demo."""

from st_cached_losses.engine.gradcache import GradCache, LossAndGrad
from st_cached_losses.engine.planning import MiniBatch, MiniBatchPlanner
from st_cached_losses.engine.rng import RandState

__all__ = ["GradCache", "LossAndGrad", "MiniBatch", "MiniBatchPlanner", "RandState"]
