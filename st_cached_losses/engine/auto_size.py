"""``mini_batch_size="auto"`` and ``mini_batch_num_tokens="auto"``: the largest mini-batch whose forward fits a
memory budget, from forwards measured at two sizes.

One forward's memory is a fixed cost (what it takes whatever its size: a library's workspace, masks and
buffers of the sequence length, the allocator's rounding) plus a cost per row (or per padded token). A
probe of one size cannot tell them apart: divided by its few rows, the fixed cost counts as a cost per row,
and the size chosen from it fills a fraction of the budget (on an H100, a BERT-base encoder: 164 rows and
9.4 GB of a 39 GB budget, from a probe of 4 rows). So the engine measures two forwards of the batch's
heaviest rows, a few rows and as many as the budget surely holds (``n1 * budget / m1``: never more than
the budget, the fixed cost being at least 0), fits the line through them
([`MemoryFit`][st_cached_losses.engine.auto_size.MemoryFit]), and takes the largest size the line keeps
within the budget: ``(budget - fixed) / per_row``.

What a forward takes is [`GraphMeter`][st_cached_losses.engine.graph_budget.GraphMeter]'s peak: on CUDA the
allocator's peak during the forward above what was allocated before it (after one unmeasured forward of one
row, so that what a step allocates once, such as autocast's cast weights and a library's workspace, is not
counted as a cost of every mini-batch); elsewhere the bytes of the tensors autograd saves, deterministically."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from st_cached_losses.engine.caller import user_stacklevel
from st_cached_losses.engine.features import (
    Features,
    batch_size_of,
    longest_first,
    mini_batch_length,
    model_device,
    row_lengths,
    row_weights,
    slice_features,
    unwrap_model,
)
from st_cached_losses.engine.graph_budget import GraphMeter
from st_cached_losses.engine.rng import RandState
from st_cached_losses.functional.distributed import all_reduce_min, is_distributed

logger = logging.getLogger(__name__)

__all__ = ["PROBE_ROWS", "MemoryFit", "fit_memory", "pick_mini_batch", "row_span"]

#: rows of the smaller probe forward (the batch's heaviest rows); the larger one is sized from its result
PROBE_ROWS = 4


@dataclass(frozen=True)
class MemoryFit:
    """A forward's memory as a line: ``fixed + per_unit * units`` bytes, units being rows (or padded tokens)."""

    fixed: float
    per_unit: float

    def bytes_for(self, units: float) -> float:
        """The bytes the line gives a forward of ``units``."""
        return self.fixed + self.per_unit * units

    def largest_within(self, budget: int) -> int:
        """The most units whose forward the line keeps within ``budget`` bytes, at least 1."""
        return max(int((budget - self.fixed) // self.per_unit), 1)


def _line(points: Sequence[tuple[float, float]]) -> MemoryFit:
    """The line through two ``(units, bytes)`` points. Where there is one size only, or measurement noise
    would make the line fall or pass below the origin, the line through the origin above both points
    instead (every byte a cost per unit, as a one-size probe counts it): it overestimates, never under."""
    (u1, m1), (u2, m2) = sorted(points)
    if u2 > u1:
        slope = (m2 - m1) / (u2 - u1)
        fixed = m1 - slope * u1
        if slope > 0 and fixed >= 0:
            return MemoryFit(fixed, slope)
    return MemoryFit(0.0, max(max(m, 1.0) / max(u, 1.0) for u, m in points))


def fit_memory(
    measure: Callable[[Tensor], float],
    order: Tensor,
    units: Callable[[Tensor], int],
    budget: int,
) -> MemoryFit:
    """Fit a forward's memory from two measured forwards of a column's rows, taken from the front of
    ``order`` (the rows to measure on, first first): [`PROBE_ROWS`][st_cached_losses.engine.auto_size.PROBE_ROWS] rows,
    then as many as the budget surely holds: the most whose units are within ``u1 * budget / m1`` (the first
    forward's units and bytes; a fixed cost is at least 0, so bytes grow no faster than units), at most the
    column's rows. Where that is no more than the first, one row instead (a fixed cost above the budget sizes
    to 1 either way). Always two forwards, whatever the rows (under a sharded wrapper each is a collective
    every process runs): with one row to measure, the line goes through the origin.

    ``measure(rows)``: bytes of a forward of ``rows``; ``units(rows)``: its rows, or its padded tokens (which
    grow with the rows taken: a mini-batch pads to its widest)."""
    b = len(order)
    n1 = min(PROBE_ROWS, b)
    first = order[:n1]
    m1 = measure(first)
    u1 = float(units(first))
    limit = u1 * budget / max(m1, 1.0)
    # the most rows within the limit (units grow with the rows taken): a bisection
    low, high = n1, b
    while low < high:
        mid = (low + high + 1) // 2
        if units(order[:mid]) <= limit:
            low = mid
        else:
            high = mid - 1
    second = order[: low if low > n1 else 1]
    return _line([(u1, m1), (float(units(second)), measure(second))])


def row_span(columns: Sequence[Features], trim_leading: bool, device: torch.device) -> tuple[int, int]:
    """The shortest and the longest row of any column, in tokens as a mini-batch pads them plus its vision
    patches ([`row_weights`][st_cached_losses.engine.features.row_weights]; 1 for columns without an attention
    mask), over every process: where they all size ``"auto"`` together,
    they must all decide alike whether to measure again."""
    lengths = [x for x in (row_weights(f, batch_size_of(f), trim_leading) for f in columns) if x is not None]
    shortest = min((int(x.min()) for x in lengths if len(x)), default=1)
    longest = max((int(x.max()) for x in lengths if len(x)), default=1)
    if is_distributed():
        # the maximum as the minimum of the negative: one small all-reduce for both
        span = all_reduce_min(torch.tensor([shortest, -longest], device=device), "all_reduce_auto")
        shortest, longest = int(span[0]), -int(span[1])
    return shortest, longest


def pick_mini_batch(
    model: nn.Module,
    columns: Sequence[Features],
    trim_leading: bool,
    budget: int,
    *,
    by_tokens: bool,
    encode: Callable[[nn.Module, Features], Tensor],
) -> int:
    """The largest mini-batch (rows, or with ``by_tokens`` a budget of padded tokens) whose forward fits in
    ``budget`` bytes, from forwards at two sizes ([`fit_memory`][st_cached_losses.engine.auto_size.fit_memory]),
    run with a graph and the RNG restored afterwards (a probe changes no dropout mask of the step). Every
    process takes the smallest of their choices.

    Rows: measured on the batch's heaviest rows (their text plus their vision patches,
    [`row_weights`][st_cached_losses.engine.features.row_weights]), padded as a mini-batch of them is; a
    mini-batch of shorter rows holds less. Tokens: a line per padded token on the heaviest rows and one on
    the lightest (a row's own costs, such as its pooled output, weigh more per token on a short row), and
    the smaller of their sizes, so that a mini-batch of any of the batch's lengths fits; the planner then
    packs ``"auto"`` token budgets by padded tokens (see ``MiniBatchPlanner.plan``)."""
    lengths = [row_lengths(f, batch_size_of(f), trim_leading) for f in columns]
    if by_tokens and any(x is None for x in lengths):
        raise ValueError(
            "mini_batch_num_tokens='auto' needs each row's token count, read from the inputs' attention_mask, "
            "and a column has none; use mini_batch_size='auto' instead."
        )
    device = model_device(model)
    # rows weighed by their text and their vision patches: a row of few words and a large image is heavy
    weights = [row_weights(f, batch_size_of(f), trim_leading) for f in columns]
    # the column holding the heaviest row, and its heaviest rows
    heaviest = [int(x.max()) if x is not None and len(x) else 0 for x in weights]
    k = max(range(len(columns)), key=lambda c: heaviest[c])
    probe = _Probe(model, trim_leading, encode, device)

    def units_of(c: int, rows: Tensor) -> int:
        return len(rows) * (mini_batch_length(columns[c], lengths[c], rows) if by_tokens else 1)

    def fit(c: int, order: Tensor) -> MemoryFit:
        def measure(rows: Tensor) -> float:
            return _probe(model, columns[c], rows, trim_leading, encode, device)

        probe.warm_up(columns[c], order[:1])
        return fit_memory(measure, order, lambda rows: units_of(c, rows), budget)

    heavy_order = longest_first(weights[k], batch_size_of(columns[k]))
    heavy = fit(k, heavy_order)
    chosen = heavy.largest_within(budget)
    fits = [heavy]
    if by_tokens:
        # the column holding the lightest row, and its lightest rows, lightest first
        lightest = [int(x.min()) if x is not None and len(x) else 1 << 62 for x in weights]
        s = min(range(len(columns)), key=lambda c: lightest[c])
        light = fit(s, longest_first(weights[s], batch_size_of(columns[s])).flip(0))
        chosen = min(chosen, light.largest_within(budget))
        fits.append(light)
    # the heaviest row alone: a mini-batch holds at least one row, whatever the budget
    one_row = heavy.bytes_for(units_of(k, heavy_order[:1]))
    if one_row > budget:
        _warn_one_row_over_budget(by_tokens, budget, one_row, heavy.fixed, chosen)
    logger.debug("'auto' memory fits (fixed bytes, bytes per unit): %s", fits)
    if is_distributed():
        chosen = int(all_reduce_min(torch.tensor([chosen], device=device), "all_reduce_auto")[0])
    return chosen


def _warn_one_row_over_budget(
    by_tokens: bool, budget: int, one_row: float, fixed: float, chosen: int
) -> None:
    """Say that ``"auto"`` sized to one row whose forward alone takes more than the budget: the mini-batches
    will hold more than the budget (by ``one_row / budget``), and how much budget one row needs."""
    setting = "mini_batch_num_tokens" if by_tokens else "mini_batch_size"
    sized = (
        f"{chosen} tokens (a row longer than that is a mini-batch alone)" if by_tokens else f"{chosen} row"
    )
    why = f", of which {fixed:,.0f} B is a forward's fixed cost" if fixed >= budget else ""
    warnings.warn(
        f"{setting}='auto': one row's forward needs {one_row:,.0f} B (this batch's heaviest row{why}), more than "
        f"mini_batch_memory_budget={budget:,} B; sized to {sized}, so a mini-batch takes up to "
        f"{one_row / budget:.1f}x the budget. Give mini_batch_memory_budget at least {math.ceil(one_row):,} B "
        "(or shorter rows: the model's max_seq_length).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


@dataclass
class _Probe:
    """The one unmeasured forward before the measured ones, where the meter is an allocator's (CUDA): what
    the first forward of a step allocates once (autocast's cast weights, a library's workspace) is then not
    counted as a cost of every forward. Elsewhere the meter counts the tensors a graph saves, and a cast
    weight is one of them in every forward: no warm-up."""

    model: nn.Module
    trim_leading: bool
    encode: Callable[[nn.Module, Features], Tensor]
    device: torch.device
    done: bool = False

    def warm_up(self, features: Features, rows: Tensor) -> None:
        if self.done or self.device.type != "cuda":
            return
        self.done = True
        part = slice_features(features, rows, batch_size_of(features), trim_leading=self.trim_leading)
        with RandState().replay(), torch.enable_grad():
            self.encode(unwrap_model(self.model), part)


def _probe(
    model: nn.Module,
    features: Features,
    rows: Tensor,
    trim_leading: bool,
    encode: Callable[[nn.Module, Features], Tensor],
    device: torch.device,
) -> float:
    """Bytes of one forward with a graph of ``rows`` of a column (a mini-batch of them): its peak."""
    probe = slice_features(features, rows, batch_size_of(features), trim_leading=trim_leading)
    meter = GraphMeter(unwrap_model(model))
    measured: list[int] = []
    # the bare module: a wrapper would expect this graph's backward (FSDP2's forward stays a collective,
    # which every process runs here at its first step); every device type's random state forked
    with RandState().replay(), torch.enable_grad(), meter.measure(device, measured, peak=True):
        out = encode(unwrap_model(model), probe)
        del out
    return float(max(measured[0], 1))
