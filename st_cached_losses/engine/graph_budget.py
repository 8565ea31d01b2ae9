"""Graphs kept within a memory budget (the engine's ``graph_memory_budget``): how much memory a forward's
autograd graph holds, measured rather than guessed, and which mini-batches of a step keep theirs.

GradCache replays every mini-batch it did not keep: one extra forward each. When the activations of
several mini-batches fit in memory, keeping their graphs from the first stage saves those forwards and
changes nothing else (the same forward, the same RNG state, the same gradients). The engine measures the
step's first mini-batch, estimates the others from their sizes, keeps the largest ones first (they
save the most work) while the estimate fits, and measures every graph it keeps: one that would push
the total past the budget is dropped (replayed, as without a budget). A later column's first mini-batch
with longer rows than any measured is measured too (its graph kept if chosen), and the estimates start
again from it: the growth with the length is then measured rather than bounded.

``graph_memory_budget="auto"`` ([`AutoGraphBudget`][st_cached_losses.engine.graph_budget.AutoGraphBudget]): on
CUDA, the memory the device has free at the start of the step (what no process holds, plus what torch's
allocator holds unused) after the step's own needs: a margin of a tenth of the device, the parameters'
gradients not yet allocated, the cached embeddings and their gradients, and room for the largest mini-batch
that is not kept (a replay, or the step's last forward, holds one beside the kept graphs). ``"auto:20GB"``
caps it. Elsewhere (CPU, MPS, XPU) it keeps no graph: the host's memory has no allocator count to read,
and other programs share it.

The meter: on CUDA the caching allocator's count of bytes still allocated after the forward (what the
graph holds), or its peak during the forward; elsewhere the bytes of the tensors autograd saves for
backward (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, the model's own
parameters and buffers not counted: deterministic, on any device."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from st_cached_losses.engine.checks import auto_graph_cap
from st_cached_losses.engine.features import (
    Features,
    batch_size_of,
    mini_batch_length,
    model_device,
    row_lengths,
    unwrap_model,
)
from st_cached_losses.engine.planning import MiniBatch
from st_cached_losses.functional.distributed import all_reduce_min

__all__ = [
    "AUTO_MARGIN",
    "AutoGraphBudget",
    "GraphKeeper",
    "GraphMeter",
    "choose_kept",
    "device_memory",
    "work_of",
]

#: the share of a CUDA device's memory ``graph_memory_budget="auto"`` leaves free (the allocator's
#: fragmentation, the loss stage's blocks, what other libraries allocate outside torch's allocator)
AUTO_MARGIN = 0.1


def work_of(rows: int, length: int) -> int:
    """A mini-batch's size for the estimates: rows times its padded length (its activations grow with
    both; attention's grow faster with the length, see [`GraphMeter.estimate`][st_cached_losses.engine.graph_budget.GraphMeter.estimate])."""
    return max(rows, 1) * max(length, 1)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(available, total)`` bytes of a CUDA device: what no process holds plus what torch's caching
    allocator holds unused (freed blocks it keeps for reuse), and the device's size. None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(cached, 0), total


@dataclass
class GraphMeter:
    """Bytes held by the graphs of forwards run inside [`measure`][st_cached_losses.engine.graph_budget.GraphMeter.measure], and the estimate for a mini-batch
    of another size from the latest calibration (``bytes_per_unit`` at ``reference_length``)."""

    model: nn.Module
    bytes_per_unit: float | None = None
    reference_length: int = 1

    def __post_init__(self) -> None:
        self._own = {_storage_ptr(t) for t in (*self.model.parameters(), *self.model.buffers())}

    @contextlib.contextmanager
    def measure(self, device: torch.device, out: list[int], *, peak: bool = False) -> Iterator[None]:
        """Appends to ``out`` the bytes the graph of the forward inside holds; with ``peak``, on CUDA, the
        allocator's peak during it above what was allocated before (its graph, its output and what it
        freed on the way: ``torch.cuda.reset_peak_memory_stats`` is called). Elsewhere ``peak`` changes
        nothing: the bytes autograd saves."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            if peak:
                torch.cuda.reset_peak_memory_stats(device)
            yield
            torch.cuda.synchronize(device)
            after = torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
            out.append(max(after - before, 0))
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
        """A measurement of the step: bytes per unit of [`work_of`][st_cached_losses.engine.graph_budget.work_of]."""
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


def choose_kept(
    sizes: Sequence[tuple[int, int]],
    meter: GraphMeter,
    budget: float,
    *,
    room: float | None = None,
    exempt: int | None = None,
) -> set[int]:
    """Indices (into ``sizes``: ``(rows, padded length)`` per mini-batch) of the mini-batches whose
    graphs to keep: the largest first, while their estimated bytes fit in ``budget``.

    With ``room`` (``graph_memory_budget="auto"``): also while the kept graphs and the largest graph that
    is not kept (one replay, or the step's last graph, ``exempt``, which is kept anyway and not counted)
    fit in ``room`` together; the largest first, each one is chosen only if the next largest could still
    be replayed beside it."""
    order = sorted(range(len(sizes)), key=lambda i: work_of(*sizes[i]), reverse=True)
    need = [meter.estimate(*s) for s in sizes]
    kept: set[int] = set()
    used = 0.0
    # the largest graph held beside the kept ones: the step's last, or one passed over
    beside = need[exempt] if exempt is not None else 0.0
    for pos, i in enumerate(order):
        if i == exempt:
            continue
        fits = used + need[i] <= budget
        if fits and room is not None:
            after = next((need[j] for j in order[pos + 1 :] if j != exempt), 0.0)
            fits = used + need[i] + max(beside, after) <= room
        if fits:
            kept.add(i)
            used += need[i]
        else:
            beside = max(beside, need[i])
    return kept


@dataclass(frozen=True)
class AutoGraphBudget:
    """What ``graph_memory_budget="auto"`` has to go by at the start of a step (see the module's text):
    bytes ``available`` on the device, its ``total``, the parameters' gradients the backward will allocate
    (``grads``) and the user's ``cap``. [`room`][st_cached_losses.engine.graph_budget.AutoGraphBudget.room]
    turns it into the bytes every graph of the step may hold together."""

    available: int
    total: int
    grads: int
    cap: int | None = None

    @classmethod
    def at_step_start(cls, model: nn.Module, cap: int | None) -> AutoGraphBudget | None:
        """Read from ``model``'s device (None off CUDA: nothing is kept)."""
        memory = device_memory(model_device(model))
        if memory is None:
            return None
        grads = sum(
            _local(p).numel() * p.element_size()
            for p in model.parameters()
            if p.requires_grad and p.grad is None
        )
        return cls(memory[0], memory[1], grads, cap)

    def room(self, cached_bytes: float) -> float:
        """Bytes for every graph of the step (the kept ones and the largest one beside them), after the
        margin, the gradients and ``cached_bytes`` (the embeddings and their gradients)."""
        return max(self.available - AUTO_MARGIN * self.total - self.grads - cached_bytes, 0.0)


def _local(p: Tensor) -> Tensor:
    """A parameter's own part (a sharded DTensor's local shard)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class GraphKeeper:
    """One step's decisions: which first-stage mini-batches keep their graphs under ``budget`` bytes.

    The first forward with a graph calibrates the meter (under a sharded wrapper, where every replay is a
    collective, the processes then agree on the kept set: each keeps a mini-batch only if all do, one
    small all-reduce, and no process drops one later); [`forward`][st_cached_losses.engine.graph_budget.GraphKeeper.forward] runs and measures the others.
    ``budget`` None: keeps nothing (the engine's plain rules apply); ``"auto"`` (or ``"auto:<bytes>"``):
    what the device has free ([`AutoGraphBudget`][st_cached_losses.engine.graph_budget.AutoGraphBudget]),
    resolved when the first forward is measured (read back as ``budget``), nothing off CUDA.
    ``last_kept``: the step's last forward keeps its graph anyway (``reuse_last_graph``)."""

    def __init__(
        self,
        model: nn.Module,
        plans: Sequence[Sequence[MiniBatch]],
        columns: Sequence[Features],
        trim_leading: bool,
        budget: int | str | None,
        *,
        agree: bool,
        encode: Callable[[nn.Module, Features], Tensor],
        last_kept: bool = False,
    ) -> None:
        self.agree, self.encode = agree, encode
        self.kept_ids: set[int] | None = None
        self.used = 0
        self.auto: AutoGraphBudget | None = None
        self.budget: float | None
        is_auto, cap = auto_graph_cap(budget)
        if is_auto:
            self.auto = AutoGraphBudget.at_step_start(unwrap_model(model), cap)
            self.budget = None if self.auto is None else math.inf  # resolved at the first measurement
        else:
            self.budget = None if budget is None else float(budget)
        if self.budget is None:
            return
        self.meter = GraphMeter(unwrap_model(model))
        self.flat = [mb for plan in plans for mb in plan]
        self.index = {id(mb): i for i, mb in enumerate(self.flat)}
        self.rows = sum(batch_size_of(f) for f in columns)
        lengths = [row_lengths(f, batch_size_of(f), trim_leading) for f in columns]
        self.sizes = [
            (len(mb.rows), mini_batch_length(columns[mb.column], lengths[mb.column], mb.rows))
            for mb in self.flat
        ]
        self.exempt = len(self.flat) - 1 if last_kept and self.flat else None
        # each later column's first mini-batch (its longest rows), measured when longer than any before
        firsts: dict[int, int] = {}
        for i, mb in enumerate(self.flat):
            if not mb.filler:
                firsts.setdefault(mb.column, i)
        self.firsts = sorted(firsts.values())
        self.remeasure: set[int] = set()
        self.room = 0.0

    @property
    def resolved_budget(self) -> int | None:
        """The budget in bytes (what ``"auto"`` resolved to), None where nothing could be kept."""
        if self.budget is None or math.isinf(self.budget):
            return None
        return int(self.budget)

    @property
    def kept(self) -> int:
        """How many graphs this step keeps within the budget (the step's last, kept anyway, not counted)."""
        if self.budget is None:
            return 0
        return sum(1 for mb in self.flat if mb.kept is not None) - (
            1 if self.exempt is not None and self.flat[self.exempt].kept is not None else 0
        )

    def wants(self, mb: MiniBatch) -> bool:
        """Whether ``mb``'s first-stage forward runs with a graph through [`forward`][st_cached_losses.engine.graph_budget.GraphKeeper.forward]."""
        if self.budget is None:
            return False
        if self.kept_ids is None:
            return True  # not calibrated yet: this forward measures
        i = self.index[id(mb)]
        return not mb.filler and (i in self.kept_ids or i in self.remeasure)

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
        if self.kept_ids is None or i in self.remeasure:
            first = self.kept_ids is None
            self.meter.calibrate(nbytes, *self.sizes[i])
            if first and self.auto is not None:
                # the cached embeddings (kept in fp32) and their gradients, every column's rows
                self.room = self.auto.room(2 * 4 * self.rows * out[0].numel())
            self._choose(i)
            if self.agree and first:
                assert self.kept_ids is not None
                self.kept_ids = _agreed(self.kept_ids, len(self.flat), device)
        assert self.kept_ids is not None
        if exempt:
            mb.kept = out
        elif i in self.kept_ids and not mb.filler and (self.agree or self.used + nbytes <= self.budget):
            mb.kept = out
            self.used += nbytes
        return out

    def _choose(self, i: int) -> None:
        """(Re)choose the graphs to keep among the mini-batches from ``i`` on, the meter just calibrated on
        ``i``: those kept before stay kept; the budget left is what the kept ones have not used."""
        candidates = [j for j in range(i, len(self.flat)) if not self.flat[j].filler]
        sizes = [self.sizes[j] for j in candidates]
        exempt = candidates.index(self.exempt) if self.exempt in candidates else None
        if self.auto is None:
            assert self.budget is not None
            chosen = choose_kept(sizes, self.meter, self.budget - self.used)
        else:
            cap = math.inf if self.auto.cap is None else self.auto.cap - self.used
            room = self.room - self.used
            chosen = choose_kept(sizes, self.meter, cap, room=room, exempt=exempt)
            # the kept graphs may take the room less the largest graph beside them
            beside = max(
                (self.meter.estimate(*sizes[c]) for c in range(len(sizes)) if c not in chosen), default=0.0
            )
            self.budget = min(self.used + max(room - beside, 0.0), self.used + cap)
        before = {j for j in self.kept_ids or () if j < i}
        self.kept_ids = before | {candidates[c] for c in chosen}
        # under a sharded wrapper the processes agree once: no process measures again on its own
        self.remeasure = (
            set()
            if self.agree
            else {f for f in self.firsts if f > i and self.sizes[f][1] > self.meter.reference_length}
        )


def _agreed(kept: set[int], n: int, device: torch.device) -> set[int]:
    """The mini-batches every process keeps (plans of the same shape on every process)."""
    flags = torch.zeros(n, dtype=torch.long, device=device)
    if kept:
        flags[list(kept)] = 1
    all_reduce_min(flags, "all_reduce_kept")
    return {int(i) for i in flags.nonzero().flatten().tolist()}
