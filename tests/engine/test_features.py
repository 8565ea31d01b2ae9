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


def test_a_column_made_on_demand_is_no_dict_and_refuses_a_copy() -> None:
    """A column whose inputs are made per mini-batch (``InputsOnDemand``, the reranker's pairs) is read by
    the planning as a mapping (its attention mask) and cut by ``slice_features`` into what it makes; it is
    no ``dict`` (it was one, recognised by ``isinstance``), so a plain copy, which would keep the mask alone
    and silently lose the inputs, is refused with a message saying so."""
    import dataclasses

    import pytest

    from st_cached_losses.engine.features import InputsOnDemand, batch_size_of
    from st_cached_losses.engine.gradcache import GradCache

    whole = _expanded_queries()
    made: list[list[int]] = []

    def make(rows: torch.Tensor, trim_leading: bool) -> dict:
        made.append(rows.tolist())
        return slice_features(whole, rows, 3, trim_leading=trim_leading)

    column = InputsOnDemand(whole["attention_mask"], make)
    assert not isinstance(column, dict)
    for copy in (lambda c: dict(c), lambda c: {**c}, lambda c: {}.update(c)):
        with pytest.raises(TypeError, match=r"would hold its attention_mask alone and lose the inputs"):
            copy(column)
    # what the engine reads of it: the mask, the rows, their lengths; a mini-batch is made when sliced
    assert batch_size_of(column) == 3 and "attention_mask" in column and sorted(column) == ["attention_mask"]
    torch.testing.assert_close(token_counts(column, 3), torch.tensor([2, 5, 8]))
    rows = torch.tensor([2, 0])
    got = slice_features(column, rows, 3)
    assert made == [[2, 0]] and torch.equal(got["input_ids"], slice_features(whole, rows, 3)["input_ids"])
    plans = GradCache(mini_batch_size=2).plan(0, column)
    assert [mb.rows.tolist() for mb in plans] == [[2, 1], [0]]
    assert dataclasses.is_dataclass(GradCache)


def test_the_engine_configuration_is_frozen() -> None:
    """GradCache's configuration is read-only once built (a change is a new engine, as a loss's setting
    makes it); its run state, what ``"auto"`` resolved to, is its ``AutoSize``, which a replaced engine keeps."""
    import dataclasses

    import pytest

    from st_cached_losses.engine.gradcache import GradCache

    cache = GradCache(mini_batch_size=4, graph_memory_budget="1KB")
    assert cache.graph_memory_budget == 1000
    for name, value in [("mini_batch_size", 8), ("sort_by_length", False), ("form", None)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cache, name, value)
    cache.auto.size = 5  # the run state changes as the engine runs
    again = dataclasses.replace(cache, mini_batch_size=8)
    assert (again.mini_batch_size, cache.mini_batch_size, again.graph_memory_budget) == (8, 4, 1000)
    assert again.auto is cache.auto
