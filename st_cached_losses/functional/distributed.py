"""Collectives for losses across processes: rank and world size, a gather whose gradient is summed
over ranks, and a ring exchange of blocks. Every helper is a no-op without a process group (and with
an initialised group of size 1).

Every collective of this package is counted in [`STATS`][st_cached_losses.functional.distributed.STATS], so tests and benchmarks can see exactly
how many calls and bytes one step costs."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "STATS",
    "CollectiveStats",
    "PeersFailed",
    "agree_counts",
    "all_gather_rows",
    "all_reduce_min",
    "all_reduce_sum",
    "exchange_shapes",
    "exchange_tagged_shapes",
    "gather_with_grad",
    "is_distributed",
    "own_rows",
    "rank",
    "ring_exchange",
    "warn_no_process_group_once",
    "world_size",
]


@dataclass
class CollectiveStats:
    """Calls and bytes (sent by this process, payload only) per collective kind."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


STATS = CollectiveStats()


def is_distributed() -> bool:
    """Whether a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


_warned: set[str] = set()


def warn_no_process_group_once(owner: str) -> None:
    if owner not in _warned:
        _warned.add(owner)
        warnings.warn(
            f"{owner}: gather_across_devices=True but no process group with more than one process is initialised; "
            "running as a single process. Launch with `accelerate launch` / `torchrun` to use every device's batch.",
            stacklevel=3,
        )


def exchange_shapes(
    n: int, values: list[int], device: torch.device, what: str, flag: Tensor | None = None
) -> tuple[list[int], list[int]]:
    """Every rank's row count and ``flag`` (a 0-d integer tensor, e.g. which columns hold NaN, agreed on
    without a collective of its own), in rank order, and a check that ``values`` (e.g. column count and
    embedding dim) agree, in one small all-gather; on disagreement every rank raises the same
    ``ValueError`` (no hang)."""
    sizes, flags, _ = exchange_tagged_shapes(n, values, device, what, flag)
    return sizes, flags


def exchange_tagged_shapes(
    n: int, values: list[int], device: torch.device, what: str, flag: Tensor | None = None, tag: int = 0
) -> tuple[list[int], list[int], int]:
    """[`exchange_shapes`][st_cached_losses.functional.distributed.exchange_shapes], and every rank's ``tag`` (a
    small non-negative integer of bits, e.g. what kind of batch this rank has) OR-ed over ranks, in the same
    all-gather."""
    mine_flag = flag if flag is not None else torch.zeros((), dtype=torch.long, device=device)
    if not is_distributed():
        return [n], [int(mine_flag)], tag
    sent = torch.tensor([n, *values, tag], dtype=torch.long, device=device)
    mine = torch.cat([sent, mine_flag.to(device=device, dtype=torch.long).reshape(1)])
    table = _gather_table(mine, "all_gather_shapes")
    shapes = [row[1:-2] for row in table]
    if any(row != shapes[0] for row in shapes):
        raise ValueError(
            f"processes disagree on {what}: {shapes} (by rank). Every process must feed the loss "
            "the same columns from the same model; check that each rank's dataset has the same columns."
        )
    tags = 0
    for row in table:
        tags |= row[-2]
    return [row[0] for row in table], [row[-1] for row in table], tags


def _gather_table(mine: Tensor, kind: str) -> list[list[int]]:
    """Every rank's small integer vector ``mine`` (the same length on every rank), as lists in rank order."""
    out = [torch.empty_like(mine) for _ in range(world_size())]
    STATS.add(kind, mine.nbytes)
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


class PeersFailed(RuntimeError):
    """[`agree_counts`][st_cached_losses.functional.distributed.agree_counts] found failed processes (this one among them when ``error`` is set); every
    process raises it at the same collective, so that they may exchange their causes next."""

    def __init__(self, failed: list[int], error: str | None) -> None:
        self.failed, self.error = failed, error
        super().__init__(
            error
            if error is not None
            else f"rank(s) {failed} failed before this step's encoder forwards (see their error); "
            "every rank stops here instead of waiting for them in a collective."
        )


def agree_counts(counts: list[int], device: torch.device, error: str | None = None) -> list[int]:
    """The largest of every rank's ``counts`` (e.g. mini-batches per column), in one small all-gather;
    ranks must pass as many counts (the same columns), else every rank raises the same ``ValueError``.

    ``error``: what went wrong on this rank before the collective (e.g. an input that cannot be cut into
    mini-batches); every rank then raises [`PeersFailed`][st_cached_losses.functional.distributed.PeersFailed] here (naming the failed ranks, carrying
    this rank's ``error``) instead of waiting forever in a collective a failed rank will never join."""
    if len(counts) > _MAX_AGREED_COUNTS and error is None:
        error = f"at most {_MAX_AGREED_COUNTS} columns can be planned together, got {len(counts)}."
    if not is_distributed():
        if error is not None:
            raise ValueError(error)
        return list(counts)
    counts = list(counts)[:_MAX_AGREED_COUNTS]
    mine = torch.tensor([int(error is not None), len(counts), *counts], dtype=torch.long, device=device)
    # a fixed-size message, so that ranks with different column counts still meet in one collective
    # (and are told so) instead of failing on mismatched buffer sizes
    fixed = 2 + _MAX_AGREED_COUNTS
    table = _gather_table(torch.cat([mine, mine.new_zeros(fixed - mine.numel())]), "all_gather_counts")
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        # a rank whose part of the all-gather is done may leave (and exit) while another still receives:
        # meet once more, so that every rank has read the table before any raises
        try:
            STATS.add("barrier", 0)
            dist.barrier()
        except RuntimeError:  # a failed rank that already left closes its connections
            pass
        raise PeersFailed(failed, error)
    widths = {row[1] for row in table}
    if len(widths) != 1:
        raise ValueError(
            f"processes disagree on the number of columns: {[row[1] for row in table]} (by rank). Every "
            "process must feed the loss the same columns; check that each rank's dataset has the same columns."
        )
    n = table[0][1]
    return [max(row[2 + k] for row in table) for k in range(n)]


#: columns [`agree_counts`][st_cached_losses.functional.distributed.agree_counts] can agree on in its fixed-size message
_MAX_AGREED_COUNTS = 62


def all_gather_rows(x: Tensor, sizes: list[int]) -> Tensor:
    """Concatenate every rank's ``(n_r, d)`` rows in rank order: ``(sum(sizes), d)``; no autograd.

    Unequal sizes are padded to the largest for the collective and cut back afterwards."""
    if len(sizes) == 1:
        return x
    longest = max(sizes)
    send = x if x.shape[0] == longest else torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
    send = send.contiguous()
    out = [torch.empty_like(send) for _ in sizes]
    STATS.add("all_gather", send.nbytes)
    dist.all_gather(out, send)
    return torch.cat([t[:n] for t, n in zip(out, sizes)])


def all_reduce_min(x: Tensor, kind: str = "all_reduce_min") -> Tensor:
    """The element-wise minimum of ``x`` over ranks, in place (returns it)."""
    if is_distributed():
        STATS.add(kind, x.nbytes)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x


def all_reduce_sum(x: Tensor, kind: str = "all_reduce") -> Tensor:
    """Sum ``x`` over ranks, in place (returns it)."""
    if is_distributed():
        STATS.add(kind, x.nbytes)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def own_rows(x: Tensor, sizes: list[int]) -> Tensor:
    """This rank's rows of a ``(sum(sizes), d)`` tensor laid out in rank order."""
    r = rank()
    start = sum(sizes[:r])
    return x[start : start + sizes[r]]


class _GatherWithSummedGrad(torch.autograd.Function):
    """``all_gather_rows`` whose backward sums the gradient over ranks and keeps this rank's slice
    (the gradient of a loss that each rank computes on its rows against everyone's)."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int]) -> Tensor:
        ctx.sizes = sizes
        return all_gather_rows(x, sizes)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = all_reduce_sum(grad.contiguous().clone(), "all_reduce_grad")
        return own_rows(grad, ctx.sizes), None


def gather_with_grad(x: Tensor, sizes: list[int]) -> Tensor:
    """Autograd-aware gather: forward concatenates every rank's rows, backward sums over ranks."""
    if len(sizes) == 1:
        return x
    return _GatherWithSummedGrad.apply(x, sizes)


def _pass_on(
    blocks: list[Tensor], rows_in: list[int], nxt: int, prv: int, reqs: list[dist.Work]
) -> list[Tensor]:
    """Start sending ``blocks`` to the next rank and receiving the previous rank's (``rows_in[i]`` rows for
    block ``i``) into new buffers; the requests are appended to ``reqs``."""
    received = [b.new_empty((n, *b.shape[1:])) for b, n in zip(blocks, rows_in)]
    for b, r in zip(blocks, received):
        b = b.contiguous()
        STATS.add("ring_send", b.nbytes)
        for work in (dist.isend(b, nxt), dist.irecv(r, prv)):
            if work is not None:  # None only when this rank is not in the group
                reqs.append(work)
    return received


def _block_rows(
    blocks: list[Tensor], given: Sequence[list[int] | None] | None, sizes: list[int]
) -> list[list[int]]:
    """Every rank's rows of each block: ``given[i]`` where given and not None, else ``sizes``."""
    given = given or []
    return [(given[i] or sizes) if i < len(given) else sizes for i in range(len(blocks))]


def ring_exchange(
    static: list[Tensor],
    carried: list[Tensor],
    sizes: list[int],
    visit: Callable[[int, list[Tensor], list[Tensor]], None],
    static_sizes: Sequence[list[int] | None] | None = None,
    carried_sizes: Sequence[list[int] | None] | None = None,
) -> list[Tensor]:
    """Pass every rank's blocks around the ring so that each rank visits every rank's blocks once.

    ``static`` blocks (e.g. candidate embeddings, ``(n_r, ...)``) are read-only: the next ones are
    already in flight (async send to the next rank, receive from the previous) while ``visit`` works on
    the current ones, so transfer overlaps compute. ``carried`` blocks (e.g. a gradient or column
    statistics accumulated by every rank) may be updated in place by ``visit`` and move on after it;
    after a full circle they are back with their owner, who gets them as the return value.

    ``visit(owner_rank, static_blocks, carried_blocks)`` is called ``W`` times, first with this rank's
    own blocks, then its predecessor's, and so on. Memory: own blocks plus one set in flight.

    Every block has ``sizes[r]`` rows on rank ``r``, unless ``static_sizes`` / ``carried_sizes`` give a block
    (by its index; None or past their end: ``sizes``) every rank's rows of its own."""
    w = len(sizes)
    if w == 1:
        visit(0, static, carried)
        return carried
    me = rank()
    nxt, prv = (me + 1) % w, (me - 1) % w
    owner = me
    static_rows = _block_rows(static, static_sizes, sizes)
    carried_rows = _block_rows(carried, carried_sizes, sizes)
    for step in range(w):
        incoming = (owner - 1) % w
        reqs: list[dist.Work] = []
        # the static blocks need W - 1 hops: the next set is in flight while this one is visited
        recv_static = (
            _pass_on(static, [n[incoming] for n in static_rows], nxt, prv, reqs) if step < w - 1 else []
        )
        visit(owner, static, carried)
        # the accumulators move on after this rank's contribution; after the W-th hop they are home
        recv_carried = _pass_on(carried, [n[incoming] for n in carried_rows], nxt, prv, reqs)
        for req in reqs:
            req.wait()
        static, carried, owner = recv_static, recv_carried, incoming
    return carried
