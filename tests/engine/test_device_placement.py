"""Where a mini-batch's inputs go before its forward (``GradCache.encode``): a column that waits on the CPU
(a reranker's pairs, tokenized per mini-batch) goes to the model's device one mini-batch at a time; inputs
already off the CPU stay where they are. The GPU path proved on the CPU: the "accelerator" is PyTorch's
``meta`` device (no data, every tensor keeps its device), the model a recorder of what its forward gets."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from st_cached_losses.engine.gradcache import GradCache


class Recorder(nn.Module):
    """A model whose one parameter lives on ``device``; its forward records its inputs and scores each row."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, device=device))
        self.seen: dict[str, Tensor] = {}

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        self.seen = dict(features)
        rows = features["input_ids"].shape[0]
        return {"scores": torch.zeros(rows, 1, device=self.weight.device)}


def features_on_the_cpu() -> dict[str, object]:
    ids = torch.arange(24).reshape(4, 6)
    return {
        "input_ids": ids[:, :5],  # a trimmed slice: a strided view
        "attention_mask": torch.ones(4, 5, dtype=torch.long),
        "task": "document",
    }


def test_a_mini_batch_waiting_on_the_cpu_goes_to_the_models_device():
    model = Recorder("meta")
    scores = GradCache(output="scores").encode(model, features_on_the_cpu())
    assert scores.shape == (4, 1)
    assert {k: v.device.type for k, v in model.seen.items() if isinstance(v, Tensor)} == {
        "input_ids": "meta",
        "attention_mask": "meta",
    }
    assert all(v.is_contiguous() for v in model.seen.values() if isinstance(v, Tensor))
    assert model.seen["task"] == "document"  # what is not a tensor is passed as it is


def test_a_model_on_the_cpu_leaves_the_inputs_where_they_are():
    model = Recorder("cpu")
    features = features_on_the_cpu()
    features["input_ids"] = features["input_ids"].to("meta")  # already on an "accelerator"
    GradCache(output="scores").encode(model, features)
    assert model.seen["input_ids"].device.type == "meta"
    assert model.seen["attention_mask"].device.type == "cpu"
    assert model.seen["input_ids"].is_contiguous()
