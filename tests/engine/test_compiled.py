"""A compiled model (``torch_compile=True`` in the arguments: the trainer hands the loss a
``torch.compile``'d model), on CPU with dropout on.

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
inductor's code generation and C++ compilation of every graph: on the shared 2-core machine this was
written on, ``aot_eager``'s capture alone took most of a minute, so inductor would push the test far past
its time.

Under DDP the trainer compiles the wrapped model (``OptimizedModule(DDP(model))``): the engine must still
recognise DDP through the compile wrapper (last test).
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
    # the first static graph, then a dynamic one per grad mode, all in the first step (its mini-batches
    # have several shapes already); no compile at all for the new lengths of later steps. On 7d62a70,
    # strided trimmed slices beside whole rows compiled [4, 1, 0]
    assert sum(compiles) <= 3, compiles
    assert compiles[1:] == [0, 0], compiles


@pytest.fixture
def one_process_group():
    """A gloo process group of one process, enough for DDP to wrap a model and reduce its gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_compiled_ddp_still_one_reduction_per_step(model, one_process_group):
    """``torch_compile=True`` under DDP: accelerate compiles the DDP-wrapped model, so the loss gets
    ``OptimizedModule(DDP(model))``. Recognised as DDP through the compile wrapper, every replay but the
    last runs in ``no_sync()``: one gradient reduction per step, as without compiling (on 7d62a70: one
    per replay, 6 here). The compiled module runs eagerly (``force_eager``): the wrapper is the point, and
    tracing DDP's forward takes a minute on a 2-core machine."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model.eval()  # no dropout: the compiled and the plain run compare as they are
    reductions = {"n": 0}

    def hook(state, bucket):
        reductions["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DDP(model)
    ddp.register_comm_hook(None, hook)
    feats = [model.preprocess(random_texts(6, seed=k)) for k in range(2)]
    out = {}
    for name, wrapped in (("plain", ddp), ("compiled", torch.compile(ddp, backend="eager"))):
        loss = st_cached_losses.CachedMNRLoss(wrapped, mini_batch_size=2)
        model.zero_grad(set_to_none=True)
        reductions["n"] = 0
        with torch.compiler.set_stance("force_eager"):
            loss(feats, None).backward()
        out[name] = (reductions["n"], _grads(model).clone())
    model.train()
    assert out["plain"][0] == out["compiled"][0] == 1, out
    assert out["plain"][1].abs().max() > 0
    torch.testing.assert_close(out["compiled"][1], out["plain"][1], rtol=0, atol=0)
