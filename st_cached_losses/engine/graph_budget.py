"""Graphs kept within a memory budget (the engine's ``graph_memory_budget``): how much memory a forward's
autograd graph holds, measured rather than guessed, and which mini-batches of a step keep theirs.

GradCache replays every mini-batch it did not keep: one extra forward each. When the activations of
several mini-batches fit in memory, keeping their graphs from the first stage saves those forwards and
changes nothing else (the same forward, the same RNG state, the same gradients). The engine measures the
step's first mini-batch, estimates the others from their sizes, keeps the largest ones first (they
save the most work) while the estimate fits, and measures every graph it keeps: one that would push
the total past the budget is dropped (replayed, as without a budget).

The meter: on CUDA the caching allocator's count of bytes still allocated after the forward (what the
graph holds); elsewhere the bytes of the tensors autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, the model's own parameters
and buffers not counted: deterministic, on any device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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
from st_cached_losses.engine.planning import MiniBatch
from st_cached_losses.engine.rng import RandState
from st_cached_losses.functional.distributed import all_reduce_min, is_distributed

__all__ = [
    "PROBE_ROWS",
    "GraphKeeper",
    "GraphMeter",
    "choose_kept",
    "pick_mini_batch",
    "row_span",
    "work_of",
]


def work_of(rows: int, length: int) -> int:
    """A mini-batch's size for the estimates: rows times its padded length (its activations grow with
    both; attention's grow faster with the length, see [`GraphMeter.estimate`][st_cached_losses.engine.graph_budget.GraphMeter.estimate])."""
    return max(rows, 1) * max(length, 1)


@dataclass
class GraphMeter:
    """Bytes held by the graphs of forwards run inside [`measure`][st_cached_losses.engine.graph_budget.GraphMeter.measure], and the estimate for a mini-batch
    of another size from the first measurement (``bytes_per_unit`` at ``reference_length``)."""

    model: nn.Module
    bytes_per_unit: float | None = None
    reference_length: int = 1

    def __post_init__(self) -> None:
        self._own = {_storage_ptr(t) for t in (*self.model.parameters(), *self.model.buffers())}

    @contextlib.contextmanager
    def measure(self, device: torch.device, out: list[int]) -> Iterator[None]:
        """Appends to ``out`` the bytes the graph of the forward inside holds."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            yield
            out.append(max(torch.cuda.memory_allocated(device) - before, 0))
            return
        seen: set[int] = set()
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            # parameters (also the unsharded ones FSDP2 gathers for the forward) are not activations
            if t.is_leaf and t.requires_grad:
                return t
            ptr = _storage_ptr(t)
            if ptr not in seen and ptr not in self._own and ptr != 0:
                seen.add(ptr)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        out.append(total[0])

    def calibrate(self, nbytes: int, rows: int, length: int) -> None:
        """The first measurement of the step: bytes per unit of [`work_of`][st_cached_losses.engine.graph_budget.work_of]."""
        self.bytes_per_unit = nbytes / work_of(rows, length)
        self.reference_length = max(length, 1)

    def estimate(self, rows: int, length: int) -> float:
        """Bytes a mini-batch's graph will hold: linear in rows and length from the calibration, and
        for rows longer than the calibration's, as if every byte grew with the length squared (an
        upper bound for attention's scores)."""
        assert self.bytes_per_unit is not None
        stretch = max(length / self.reference_length, 1.0)
        return self.bytes_per_unit * work_of(rows, length) * stretch


def _storage_ptr(t: Tensor) -> int:
    """Where ``t``'s storage is, or 0 for a tensor without one of its own (e.g. a sharded DTensor)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def choose_kept(sizes: Sequence[tuple[int, int]], meter: GraphMeter, budget: int) -> set[int]:
    """Indices (into ``sizes``: ``(rows, padded length)`` per mini-batch) of the mini-batches whose
    graphs to keep: the largest first, while their estimated bytes fit in ``budget``."""
    order = sorted(range(len(sizes)), key=lambda i: work_of(*sizes[i]), reverse=True)
    kept, used = set(), 0.0
    for i in order:
        need = meter.estimate(*sizes[i])
        if used + need <= budget:
            kept.add(i)
            used += need
    return kept


class GraphKeeper:
    """One step's decisions: which first-stage mini-batches keep their graphs under ``budget`` bytes.

    The first forward with a graph calibrates the meter (under a sharded wrapper, where every replay is a
    collective, the processes then agree on the kept set: each keeps a mini-batch only if all do, one
    small all-reduce, and no process drops one later); [`forward`][st_cached_losses.engine.graph_budget.GraphKeeper.forward] runs and measures the others.
    ``budget`` None: keeps nothing (the engine's plain rules apply)."""

    def __init__(
        self,
        model: nn.Module,
        plans: Sequence[Sequence[MiniBatch]],
        columns: Sequence[Features],
        trim_leading: bool,
        budget: int | None,
        *,
        agree: bool,
        encode: Callable[[nn.Module, Features], Tensor],
    ) -> None:
        self.budget, self.agree, self.encode = budget, agree, encode
        self.kept_ids: set[int] | None = None
        self.used = 0
        if budget is None:
            return
        self.meter = GraphMeter(unwrap_model(model))
        self.flat = [mb for plan in plans for mb in plan]
        self.index = {id(mb): i for i, mb in enumerate(self.flat)}
        lengths = [row_lengths(f, batch_size_of(f), trim_leading) for f in columns]
        self.sizes = [
            (len(mb.rows), mini_batch_length(columns[mb.column], lengths[mb.column], mb.rows))
            for mb in self.flat
        ]

    def wants(self, mb: MiniBatch) -> bool:
        """Whether ``mb``'s first-stage forward runs with a graph through [`forward`][st_cached_losses.engine.graph_budget.GraphKeeper.forward]."""
        if self.budget is None:
            return False
        if self.kept_ids is None:
            return True  # not calibrated yet: this forward measures
        return not mb.filler and self.index[id(mb)] in self.kept_ids

    def forward(self, model: nn.Module, mb: MiniBatch, device: torch.device, *, exempt: bool) -> Tensor:
        """Run ``mb`` with a graph, measured; keep the graph when chosen and within the budget.
        ``exempt``: the step's last forward, kept anyway (``reuse_last_graph``; the replay would hold
        its activations too), not counted."""
        assert self.budget is not None
        measured: list[int] = []
        with self.meter.measure(device, measured):
            out = self.encode(model, mb.features)
        if not out.requires_grad:  # a frozen column: no graph to keep
            return out
        i, nbytes = self.index[id(mb)], measured[0]
        if self.kept_ids is None:
            self.meter.calibrate(nbytes, *self.sizes[i])
            candidates = [j for j in range(i, len(self.flat)) if not self.flat[j].filler]
            chosen = choose_kept([self.sizes[j] for j in candidates], self.meter, self.budget)
            self.kept_ids = {candidates[c] for c in chosen}
            if self.agree:
                self.kept_ids = _agreed(self.kept_ids, len(self.flat), device)
        if exempt:
            mb.kept = out
        elif i in self.kept_ids and not mb.filler and (self.agree or self.used + nbytes <= self.budget):
            mb.kept = out
            self.used += nbytes
        return out


def _agreed(kept: set[int], n: int, device: torch.device) -> set[int]:
    """The mini-batches every process keeps (plans of the same shape on every process)."""
    flags = torch.zeros(n, dtype=torch.long, device=device)
    if kept:
        flags[list(kept)] = 1
    all_reduce_min(flags, "all_reduce_kept")
    return {int(i) for i in flags.nonzero().flatten().tolist()}


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


#: rows of the probe forward that sizes ``mini_batch_size="auto"`` (the longest rows of the batch)
PROBE_ROWS = 4


def pick_mini_batch(
    model: nn.Module,
    columns: Sequence[Features],
    trim_leading: bool,
    budget: int,
    *,
    by_tokens: bool,
    encode: Callable[[nn.Module, Features], Tensor],
) -> int:
    """The largest mini-batch (rows, or with ``by_tokens`` a budget of tokens) whose forward's graph fits
    in ``budget`` bytes, from measured forwards with a graph and the RNG restored afterwards (a probe
    changes no dropout mask of the step). Every process takes the smallest of their choices.

    Rows: one forward of the batch's longest rows (at most [`PROBE_ROWS`][st_cached_losses.engine.graph_budget.PROBE_ROWS]; their text plus their
    vision patches, [`row_weights`][st_cached_losses.engine.features.row_weights]), padded as a mini-batch of them
    is; a mini-batch of shorter rows holds less. Tokens: the bytes per padded token, the larger
    of the longest rows' and the shortest rows' (a row's own costs, such as its pooled output, weigh
    more on a short row), so that a mini-batch of any of the batch's lengths fits; the planner then
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
    longest = [int(x.max()) if x is not None and len(x) else 0 for x in weights]
    k = max(range(len(columns)), key=lambda c: longest[c])
    b = batch_size_of(columns[k])
    rows = longest_first(weights[k], b)[: min(PROBE_ROWS, b)]
    per_row = _probe(model, columns[k], rows, trim_leading, encode, device)
    if by_tokens:
        per_token = per_row / max(mini_batch_length(columns[k], lengths[k], rows), 1)
        # the column holding the lightest row, and its lightest rows
        shortest = [int(x.min()) if x is not None and len(x) else 1 << 62 for x in weights]
        s = min(range(len(columns)), key=lambda c: shortest[c])
        b = batch_size_of(columns[s])
        rows = longest_first(weights[s], b)[-min(PROBE_ROWS, b) :]
        per_short_row = _probe(model, columns[s], rows, trim_leading, encode, device)
        per_token = max(per_token, per_short_row / max(mini_batch_length(columns[s], lengths[s], rows), 1))
        chosen = max(int(budget // per_token), 1)
    else:
        chosen = max(int(budget // per_row), 1)
    if is_distributed():
        chosen = int(all_reduce_min(torch.tensor([chosen], device=device), "all_reduce_auto")[0])
    return chosen


def _probe(
    model: nn.Module,
    features: Features,
    rows: Tensor,
    trim_leading: bool,
    encode: Callable[[nn.Module, Features], Tensor],
    device: torch.device,
) -> float:
    """Bytes per row of the graph of one forward of ``rows`` of a column (a mini-batch of them)."""
    probe = slice_features(features, rows, batch_size_of(features), trim_leading=trim_leading)
    meter = GraphMeter(unwrap_model(model))
    measured: list[int] = []
    # the bare module: a wrapper would expect this graph's backward (FSDP2's forward stays a collective,
    # which every process runs here at its first step); every device type's random state forked
    with RandState().replay(), torch.enable_grad(), meter.measure(device, measured):
        out = encode(unwrap_model(model), probe)
    del out
    return max(measured[0], 1) / len(rows)
