"""fp16 autocast with loss scaling (``torch.amp.GradScaler``, the AMP recipe of GPUs without bf16),
on CPU: over several steps, one of them overflowing, the cached loss gives the scaled
gradients, the skipped steps and the scale schedule of sentence-transformers' non-cached
``MultipleNegativesRankingLoss`` on the same tiny model. An overflow must reach the parameter gradients
as inf / nan (the replay multiplies the cached gradients by the scaled ``grad_output`` and casts them to
the embeddings' dtype), or the scaler would apply the step."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

import st_cached_losses
from tests.support.tiny_model import make_tiny_model, random_texts

#: the loss weight per step: the fourth step's scaled gradients overflow fp16 (a spike of the scale)
WEIGHTS = [1.0, 1.0, 1.0, 2.0**40, 1.0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("fp16") / "bert")
    model[0].auto_model.pooler = None
    return model


def _with_dense_head(model):
    """The model with a linear head after pooling: under autocast its embeddings are fp16 (without it they
    are fp32, from a layer norm and a mean), so the replay's gradients are cast to fp16 too."""
    from sentence_transformers.sentence_transformer.modules import Dense

    torch.manual_seed(0)
    model = copy.deepcopy(model)
    model.append(Dense(32, 32, activation_function=torch.nn.Identity()))
    return model


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


class _Run:
    """One model, loss, SGD optimizer and GradScaler, stepped one batch at a time."""

    def __init__(self, base, cached: bool) -> None:
        self.model = copy.deepcopy(base)
        self.model.train()
        self.loss_fn = (
            st_cached_losses.CachedMNRLoss(self.model, mini_batch_size=3)
            if cached
            else MultipleNegativesRankingLoss(self.model)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        # growth every 2 good steps: the schedule grows and backs off within the run
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def backward(
        self, texts: list[list[str]], weight: float, fp16: bool = True
    ) -> tuple[float, torch.Tensor]:
        """The loss and the scaled parameter gradients of one batch (scaled by the current scale)."""
        feats = [self.model.preprocess(t) for t in texts]
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = self.loss_fn(feats, None)
        self.scaler.scale(loss * weight).backward()
        return loss.item(), _grads(self.model).clone()

    def step(self) -> bool:
        """The scaler's step and update; whether the parameters moved."""
        before = [p.detach().clone() for p in self.model.parameters()]
        self.scaler.step(self.opt)
        self.scaler.update()
        return any(not torch.equal(b, p) for b, p in zip(before, self.model.parameters()))


@pytest.mark.parametrize("head", ["pooling", "dense"])
def test_fp16_grad_scaler_as_the_non_cached_loss(base, head):
    model = _with_dense_head(base) if head == "dense" else base
    ours, theirs = _Run(model, cached=True), _Run(model, cached=False)
    scales, stepped = [], []
    for step, weight in enumerate(WEIGHTS):
        texts = [random_texts(8, seed=100 * step + k) for k in range(2)]
        loss_a, a = ours.backward(texts, weight)
        loss_b, b = theirs.backward(texts, weight)
        if weight != 1.0:
            # the overflow reached the parameter gradients of both (so that the scaler skips the step)
            assert not torch.isfinite(a).all() and not torch.isfinite(b).all()
        else:
            assert b.abs().max() > 0
            # the same scaled gradients to fp16's rounding: no further from the fp32 gradients (same
            # parameters, same scale) than the non-cached loss's fp16 ones, twice over (the project's
            # rule for low precision); the loss stages round differently (ours runs in fp32, theirs
            # multiplies fp16 embeddings)
            _, exact = theirs.backward(texts, weight, fp16=False)
            err_ours, err_theirs = (a - exact).abs().max(), (b - exact).abs().max()
            assert 0 < err_theirs < 0.05 * exact.abs().max()  # autocast rounded, and not wildly
            assert err_ours <= 2 * err_theirs, (step, err_ours, err_theirs)
            assert loss_a == pytest.approx(loss_b, rel=1e-2)  # theirs is an fp16 number
        stepped.append((ours.step(), theirs.step()))
        scales.append((ours.scaler.get_scale(), theirs.scaler.get_scale()))
        # the same parameters for the next step: what follows compares the scalers, not two trajectories
        # apart by fp16 rounding
        with torch.no_grad():
            for p, q in zip(ours.model.parameters(), theirs.model.parameters()):
                q.copy_(p)
    # the skipped step and the scale schedule: only the overflowing step is skipped, and it backs the
    # scale off
    assert stepped == [(w == 1.0, w == 1.0) for w in WEIGHTS]
    assert all(a == b for a, b in scales), scales
    schedule = [2.0**10] + [a for a, _ in scales]
    moves = [y - x for x, y in itertools.pairwise(schedule)]
    assert max(moves) > 0 > min(moves)
