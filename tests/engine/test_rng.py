"""The replay restores the random state of every device type, proven on CPU with
stand-ins for Apple's MPS and Intel's XPU: device modules whose generators record what is saved and
restored, and a model whose dropout draws from the stand-in MPS generator. Without the restore, the
replayed forward draws new masks and the gradients are not those of the first forward."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from st_cached_losses.engine import GradCache, RandState
from st_cached_losses.engine.planning import unsort
from tests.support.reference import reference_infonce


class FakeGenerator:
    """One device's generator: its state is a counter, each draw takes the next value."""

    def __init__(self, seed: int) -> None:
        self.state = seed
        self.restored: list[int] = []

    def get(self) -> Tensor:
        return torch.tensor([self.state], dtype=torch.int64)

    def set(self, state: Tensor) -> None:
        self.state = int(state[0])
        self.restored.append(self.state)

    def draw(self) -> int:
        self.state += 1
        return self.state


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[FakeGenerator]]:
    """MPS (one generator, ``get_rng_state``) and XPU (two devices, ``get_rng_state_all``), available and
    initialised."""
    mps = [FakeGenerator(100)]
    xpu = [FakeGenerator(200), FakeGenerator(300)]
    monkeypatch.setattr(torch.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": mps[0].get())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": mps[0].set(state))
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.xpu, "get_rng_state_all", lambda: [g.get() for g in xpu])

    def set_all(states: list[Tensor]) -> None:
        for g, s in zip(xpu, states):
            g.set(s)

    monkeypatch.setattr(torch.xpu, "set_rng_state_all", set_all)
    return {"mps": mps, "xpu": xpu}


def test_snapshot_and_replay_of_every_device_type(fake_devices):
    mps, xpu = fake_devices["mps"][0], fake_devices["xpu"]
    state = RandState()
    cpu_draw = torch.rand(3)
    for g in (mps, *xpu):
        g.draw()
        g.draw()
    after = (mps.state, xpu[0].state, xpu[1].state)
    with state.replay():
        # the snapshot's state, on every device type
        assert (mps.state, xpu[0].state, xpu[1].state) == (100, 200, 300)
        torch.testing.assert_close(torch.rand(3), cpu_draw, rtol=0, atol=0)
        mps.draw()
    # and the state found before the replay afterwards: the training loop's stream goes on undisturbed
    assert (mps.state, xpu[0].state, xpu[1].state) == after
    assert mps.restored == [100, after[0]]
    assert xpu[1].restored == [300, after[2]]


def test_an_uninitialised_device_is_neither_read_nor_initialised(fake_devices, monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)

    def refuse() -> list[Tensor]:
        raise AssertionError("read the random state of a device that was never initialised")

    monkeypatch.setattr(torch.xpu, "get_rng_state_all", refuse)
    with RandState().replay():
        pass
    assert fake_devices["mps"][0].restored  # MPS still is


class MpsDropoutModel(nn.Module):
    """Mean of token embeddings, then dropout whose mask comes from the stand-in MPS generator (as a model
    on an Apple GPU draws it): nothing here uses the CPU generator, which the replay always restored."""

    def __init__(self, generator: FakeGenerator) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 8)
        self.proj = nn.Linear(8, 8)
        self.generator = generator

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = features["attention_mask"].unsqueeze(-1).float()
        x = (self.embed(features["input_ids"]) * mask).sum(1) / mask.sum(1)
        g = torch.Generator().manual_seed(self.generator.draw())
        keep = (torch.rand(x.shape, generator=g) > 0.3).float()
        return {"sentence_embedding": self.proj(x * keep / 0.7)}


def _columns(b: int = 7, t: int = 5) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(1, 40, (b, t), generator=g)
        mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask})
    return out


def _loss_and_grad(embeddings: list[Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
    leaves = [e.detach().requires_grad_() for e in embeddings]
    loss = reference_infonce(leaves[0], leaves[1:])
    return loss.detach(), list(torch.autograd.grad(loss, leaves)), []


def _grads(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _reference(model: MpsDropoutModel, cache: GradCache, columns, seed: int) -> Tensor:
    """The non-cached loss with the first stage's masks: the same mini-batches, in the same order, from
    the same MPS state, each forward with its graph."""
    model.generator.state = seed
    model.zero_grad(set_to_none=True)
    embs = []
    for k, features in enumerate(columns):
        plan = cache.plan(k, features, trim_leading=False)
        outs = [model(dict(mb.features))["sentence_embedding"] for mb in plan]
        embs.append(unsort(outs, plan, features["input_ids"].shape[0]))
    reference_infonce(embs[0], embs[1:]).backward()
    return _grads(model)


def test_replay_redraws_mps_dropout_masks(fake_devices):
    model = MpsDropoutModel(fake_devices["mps"][0])
    columns = _columns()
    cache = GradCache(mini_batch_size=2)
    model.generator.state = 5
    model.zero_grad(set_to_none=True)
    cache.step(model, columns, _loss_and_grad).backward()
    cached = _grads(model)
    reference = _reference(model, cache, columns, seed=5)
    other_masks = _reference(model, cache, columns, seed=6)
    assert reference.abs().max() > 0
    # canary: the masks matter, so equal gradients mean equal masks
    assert (other_masks - reference).abs().max() > 1e-3 * reference.abs().max()
    torch.testing.assert_close(cached, reference, rtol=1e-5, atol=1e-6)
