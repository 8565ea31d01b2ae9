"""Memory budgets as users write them: a float that is a whole number of bytes (``6e9``),
a number in a string (``"2.5e9"``), a size (``"2.5GB"``); a refusal shows the value as given."""

from __future__ import annotations

import pytest

from st_cached_losses.engine.checks import memory_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (6e9, 6 * 10**9),
        (6.0, 6),
        ("2.5e9", 2_500_000_000),
        ("6e9", 6 * 10**9),
        ("6000000000", 6 * 10**9),
        ("2.5GB", 2_500_000_000),
        ("2.5 GiB", int(2.5 * 2**30)),
        (".5MB", 500_000),
        ("1.1KiB", 1126),  # a size in a unit above bytes: rounded down to whole bytes
        (1024, 1024),
    ],
)
def test_budgets_accept_whole_bytes_in_any_spelling(value, expected):
    assert memory_bytes(value, "graph_memory_budget") == expected


@pytest.mark.parametrize(
    ("value", "shown", "why"),
    [
        ("0.1", "'0.1'", "not a whole number of bytes"),
        (0.1, "0.1", "not a whole number of bytes"),
        (1.5, "1.5", "not a whole number of bytes"),
        ("0.0001KB", "'0.0001KB'", "less than one byte"),
        (0, "0", "not positive"),
        (-6e9, "-6000000000.0", "not positive"),
        ("-1GB", "'-1GB'", "not positive"),
        (float("inf"), "inf", "not a finite number"),
        ("6 parsecs", "'6 parsecs'", ""),
        (True, "True", ""),
    ],
)
def test_budgets_refuse_with_the_value_as_given(value, shown, why):
    with pytest.raises(ValueError, match="graph_memory_budget must be") as err:
        memory_bytes(value, "graph_memory_budget")
    assert f"got {shown}" in str(err.value) and why in str(err.value)


def test_losses_and_arguments_take_float_budgets(tmp_path):
    from st_cached_losses import CachedLossTrainingArguments, CachedMNRLoss
    from tests.support.tiny_model import make_tiny_model

    loss = CachedMNRLoss(
        make_tiny_model(tmp_path / "m"),
        mini_batch_size="auto",  # a mini-batch budget sizes "auto" mini-batches only (issue 51's one rule)
        graph_memory_budget=6e9,
        mini_batch_memory_budget="2.5e9",
    )
    assert loss.graph_memory_budget == 6 * 10**9 and loss.mini_batch_memory_budget == 2_500_000_000
    loss.graph_memory_budget = "2.5GB"
    assert loss.graph_memory_budget == 2_500_000_000
    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path / "out"),
        graph_memory_budget=6e9,
        memory_budget="2.5e9",
        mini_batch_size=4,
        report_to="none",
    )
    assert memory_bytes(args.graph_memory_budget, "graph_memory_budget") == 6 * 10**9
    with pytest.raises(ValueError, match=r"got '0\.1'"):
        CachedLossTrainingArguments(
            output_dir=str(tmp_path / "out"), graph_memory_budget="0.1", mini_batch_size=4, report_to="none"
        )
