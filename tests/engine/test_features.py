"""The engine's one reader of which positions are real tokens (:func:`real_tokens`): attended positions and
ColBERT query-expansion positions (attention mask 0, scored), as every trim, length and token count sees
them."""

from __future__ import annotations

import torch

from st_cached_losses.engine.features import real_tokens, row_lengths, slice_features, token_counts


def _expanded_queries() -> dict:
    """Three right-padded queries expanded to 8 positions with attend=False: attention mask on the words,
    ``query_expansion_positions`` on the rest (row 2 has no expansion: it fills the width)."""
    words = torch.tensor([2, 5, 8])
    pos = torch.arange(8)
    mask = (pos[None, :] < words[:, None]).long()
    return {
        "input_ids": torch.arange(24).view(3, 8),
        "attention_mask": mask,
        "query_expansion_positions": mask.eq(0),
        "task": "query",
    }


def test_expansion_positions_are_real_tokens() -> None:
    feats = _expanded_queries()
    assert real_tokens(feats, 3).all()
    torch.testing.assert_close(row_lengths(feats, 3), torch.tensor([8, 8, 8]))
    torch.testing.assert_close(token_counts(feats, 3), torch.tensor([8, 8, 8]))
    # a mini-batch of the shorter rows keeps every expansion position (the model scores them)
    part = slice_features(feats, torch.tensor([1, 0]), 3)
    assert part["input_ids"].shape == (2, 8) and part["query_expansion_positions"].shape == (2, 8)
    torch.testing.assert_close(part["input_ids"], feats["input_ids"][[1, 0]])
    assert part["task"] == "query"


def test_without_expansion_padding_is_trimmed() -> None:
    feats = _expanded_queries()
    del feats["query_expansion_positions"]
    torch.testing.assert_close(row_lengths(feats, 3), torch.tensor([2, 5, 8]))
    torch.testing.assert_close(token_counts(feats, 3), torch.tensor([2, 5, 8]))
    assert slice_features(feats, torch.tensor([1, 0]), 3)["input_ids"].shape == (2, 5)
    assert real_tokens({"inputs_embeds": torch.zeros(3, 4, 2)}, 3) is None
