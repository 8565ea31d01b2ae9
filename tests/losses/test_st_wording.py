"""The sentences sentence-transformers' own tests match in an error are in ours: their tests
``pytest.raises(ValueError, match=...)`` pass with our class bound in, whatever we add after the sentence."""

from __future__ import annotations

import re

import pytest
import torch

from st_cached_losses import CachedCLIPLoss, CachedLossTrainingArguments, CachedMNRLoss, CachedTiledLoss
from tests.support.tiny_model import make_tiny_model

SCALE = re.escape("Scale must be a positive value.")
TOKENS = re.escape("mini_batch_num_tokens must be a positive integer or None.")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


@pytest.mark.parametrize("cls", [CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss])
@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "20", True, torch.ones(2)])
def test_a_bad_scale_says_their_sentence(model, cls, scale):
    with pytest.raises(ValueError, match=SCALE):
        cls(model, scale=scale)
    loss = cls(model)
    with pytest.raises(ValueError, match=SCALE):
        loss.scale = scale


@pytest.mark.parametrize("tokens", [0, -5, True, 1.5])
def test_a_bad_token_budget_says_their_sentence(model, tokens):
    with pytest.raises(ValueError, match=TOKENS):
        CachedMNRLoss(model, mini_batch_num_tokens=tokens)


def test_the_arguments_say_the_same_sentences(tmp_path):
    with pytest.raises(ValueError, match=SCALE):
        CachedLossTrainingArguments(output_dir=str(tmp_path), scale=-1.0)
    with pytest.raises(ValueError, match=TOKENS):
        CachedLossTrainingArguments(output_dir=str(tmp_path), mini_batch_num_tokens=0)


def test_a_misspelt_hardness_mode_names_the_closest_and_lists_the_modes(model):
    with pytest.raises(ValueError) as info:
        CachedMNRLoss(model, hardness_mode="in_batch_negative")
    message = str(info.value)
    assert message.startswith("hardness_mode must be one of"), message  # their tests match this prefix
    assert "Did you mean 'in_batch_negatives'?" in message
    assert "'in_batch_negatives', 'hard_negatives', 'all_negatives'" in message  # one order, every run
    assert "None" not in message and "{" not in message
