"""A compiled model (``torch_compile=True`` in the arguments: the trainer hands the loss a
``torch.compile``'d model), issue 32 finding 13, on CPU with dropout on.

* The replay redraws the compiled forward's dropout masks: the cached loss's gradients equal the
  non-cached loss's (sentence-transformers' ``MultipleNegativesRankingLoss`` on the embeddings of the same
  compiled forwards, drawn from the same random state), and another random state gives other gradients.
* Recompilations are counted and bounded over steps of varied lengths. The shapes are left to dynamo's
  automatic dynamic shapes (``dynamic=None``, what the trainer passes through accelerate): after one
  recompile the row and length dimensions become symbolic, so length-sorted mini-batches of any size share
  a graph; length buckets would pad every mini-batch (work the engine's trimming saves) and still compile
  a graph per bucket. What remains is a graph per grad mode (the first stage runs without a graph, the
  replay with one) and the first static one; the engine hands the model contiguous inputs, since trimmed
  slices are strided views and a compiled model guards on strides.

Backend ``aot_eager``: the same dynamo capture and AOTAutograd forward / backward split (dropout
decomposed, its randomness drawn from the global generator as compiled code draws it) as inductor, without
inductor's C++ compilation, which takes minutes per graph on a 2-core CI machine.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch._dynamo.utils import counters

import st_cached_losses
from st_cached_losses.engine.planning import unsort
from tests.support.tiny_model import make_tiny_model, random_texts

B = 10  # mini-batches of 4, 4 and 2 rows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("compiled") / "bert", dropout=0.1)
    model[0].auto_model.pooler = None
    model.train()
    return model


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _reference(model, compiled, loss, feats, seed: int) -> torch.Tensor:
    """The non-cached loss on the first stage's embeddings: the same mini-batches of the same compiled
    model, from the same random state, each forward keeping its graph."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    embeddings = []
    for k, f in enumerate(feats):
        plan = loss.cache.plan(k, f, trim_leading=False)
        outs = [loss.cache.encode(compiled, mb.features) for mb in plan]
        embeddings.append(unsort(outs, plan, B))
    MultipleNegativesRankingLoss(model).compute_loss_from_embeddings(embeddings, None).backward()
    return _grads(model).clone()


def test_compiled_model_dropout_replayed_and_recompiles_bounded(model):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    loss = st_cached_losses.CachedMNRLoss(compiled, mini_batch_size=4)
    compiles = []
    for step in range(3):
        # longer texts every step: new lengths, and mini-batches of new widths within each step
        texts = [random_texts(B, seed=100 * step + k, min_words=1, max_words=4 + 10 * step) for k in range(2)]
        feats = [model.preprocess(t) for t in texts]
        before = counters["frames"]["total"]
        model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss(feats, None).backward()
        ours = _grads(model).clone()
        compiles.append(counters["frames"]["total"] - before)
        theirs = _reference(model, compiled, loss, feats, seed=step)
        assert theirs.abs().max() > 0
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))
        if step == 0:
            # canary: other masks give other gradients, so equal gradients mean equal masks
            other = _reference(model, compiled, loss, feats, seed=99)
            assert (other - theirs).abs().max() > 1e-3 * theirs.abs().max()
    print(f"compiles per step: {compiles}, graphs: {counters['stats']['unique_graphs']}")
    # the first static graph, then dynamic ones per grad mode: and no compile at all for new lengths
    assert sum(compiles) <= 5, compiles
    assert compiles[-1] == 0, compiles
