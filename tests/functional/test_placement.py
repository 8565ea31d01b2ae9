"""Where the rows are, decided once for both families
([`placement`][st_cached_losses.functional.placement.placement]): its table, and each family's drivers following it."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.functional import sigmoid_loss_and_grad
from st_cached_losses.functional.placement import placement, ring_path
from st_cached_losses.functional.sigmoid import loss as sigmoid_module
from st_cached_losses.functional.softmax import parallel
from st_cached_losses.functional.softmax.terms import mnrl_terms


@pytest.mark.parametrize(
    ("sizes", "ring", "in_batch", "expected"),
    [
        (None, False, True, "local"),
        (None, True, True, "local"),  # one process: the ring needs others
        ([3, 2], False, True, "gathered"),
        ([3, 2], True, True, "ring"),
        ([3], False, True, "gathered"),  # sizes given: a group (of one) was agreed on
        (None, False, False, "own"),
        (None, True, False, "own"),
        ([3, 2], False, False, "own"),
        ([3, 2], True, False, "own"),  # each row's own candidates: nothing travels
    ],
)
def test_the_table(sizes, ring, in_batch, expected):
    assert placement(sizes, ring=ring, in_batch=in_batch) == expected


@pytest.mark.parametrize(("path", "ring"), [("tiled", True), ("chunked", False), ("auto", False)])
def test_the_ring_is_the_tiled_path(path, ring):
    assert ring_path(path) is ring


def test_both_families_take_their_driver_from_the_table(monkeypatch):
    """Each family asks the one table: the sigmoid loss's driver and InfoNCE's strategy follow its answer."""
    asked = []

    def spy(sizes, *, ring=False, in_batch=True):
        asked.append((sizes, ring, in_batch))
        return "local"

    monkeypatch.setattr(sigmoid_module, "placement", spy)
    monkeypatch.setattr(parallel, "placement", spy)
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    sigmoid_loss_and_grad(q, [d])
    parallel.loss_and_grad(q, [d], None, ring=True)
    parallel.loss_and_grad(
        q, [d], None, terms=mnrl_terms(("query_to_doc",), "joint", None, 0.0, 1, in_batch_negatives=False)
    )
    assert asked == [(None, False, True), (None, True, True), (None, False, False)]
