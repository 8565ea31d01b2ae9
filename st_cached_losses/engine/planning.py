"""Mini-batch planning of the GradCache engine ([`st_cached_losses.engine.gradcache`][st_cached_losses.engine.gradcache]): which rows of a
column each encoder mini-batch embeds, in which order, and how many mini-batches every process runs.

* rows are sorted by length (longest first) before they are cut, and each mini-batch's padding is
  trimmed when it is sliced (leading padding only where positions are shift-invariant); a flattened
  (padding-free) column is cut the same way, per sequence (see [`features`][st_cached_losses.engine.features]),
  and a multimodal column's images and videos go with their rows
  ([`multimodal`][st_cached_losses.engine.multimodal]);
* mini-batches by row count or, as sentence-transformers' ``mini_batch_num_tokens``, by a budget of
  real (non-padding) tokens, packed greedily (a row longer than the budget alone); a row's vision
  patches (Qwen-VL's flattened images and videos) count as tokens;
* under a sharded wrapper (FSDP1, FSDP2, DeepSpeed), whose forwards are collectives, the processes
  agree once per step on the mini-batches per column (one small all-gather); a process with fewer cuts
  its largest mini-batches in two and then adds filler mini-batches (one row embedded again, output
  unused, gradient zero). An input this process refuses (a loss's column check, a column the plan
  cannot cut) is raised at that same all-gather on every process, naming the process and the cause;
* [`unsort`][st_cached_losses.engine.planning.unsort] puts the mini-batches' outputs back in the column's row order.

[`RandState`][st_cached_losses.engine.planning.RandState] (from [`st_cached_losses.engine.rng`][st_cached_losses.engine.rng], re-exported here) is what a mini-batch keeps to
replay its forward with the same dropout masks.

No forward, backward or loss here: [`MiniBatchPlanner`][st_cached_losses.engine.planning.MiniBatchPlanner] is the planning half of
[`GradCache`][st_cached_losses.engine.gradcache.GradCache], which runs the plans."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import Tensor, nn

from st_cached_losses.engine.checks import no_token_counts, rows_fit_in_one
from st_cached_losses.engine.features import (
    Features,
    batch_size_of,
    check_splittable,
    longest_first,
    media_tokens,
    model_device,
    row_lengths,
    slice_features,
    token_counts,
)
from st_cached_losses.engine.multimodal import media_axes
from st_cached_losses.engine.rng import RandState
from st_cached_losses.engine.wrappers import is_sharded, is_wrapped
from st_cached_losses.functional.distributed import (
    PeersFailed,
    agree_counts,
    all_gather_rows,
    exchange_shapes,
    is_distributed,
    world_size,
)

__all__ = ["AutoSize", "MiniBatch", "MiniBatchPlanner", "RandState", "unsort"]


@dataclass
class MiniBatch:
    """One encoder mini-batch of one column: its rows, in the order they are embedded, and what the
    engine keeps for its replay (the RNG state, or the output with its graph)."""

    column: int
    rows: Tensor  # (m,) indices into the column, in the order they are embedded
    source: Features  # the whole column's inputs
    batch_size: int  # rows of the whole column
    trim_leading: bool = True  # whether leading padding may be cut (see position_shift_invariant)
    rng: RandState | None = None
    kept: Tensor | None = None  # the output with its graph, when kept from stage 1
    # a stand-in forward that keeps collectives in step with other processes (see MiniBatchPlanner.plan):
    # its output is not an embedding and its gradient is zero
    filler: bool = False

    @property
    def features(self) -> Features:
        """This mini-batch's inputs, padding trimmed; sliced when needed, so that no copy of the
        whole batch's inputs stays alive between the two stages."""
        return slice_features(self.source, self.rows, self.batch_size, trim_leading=self.trim_leading)


@dataclass
class AutoSize:
    """The engine's run state: what ``"auto"`` mini-batch sizes resolved to, updated by the engine
    (``GradCache.resolve_auto``: at the first step, and again for rows
    outside the lengths measured) and forgotten when a size setting changes."""

    #: the resolved size (rows, or tokens for ``mini_batch_num_tokens="auto"``); None: not sized yet
    size: int | None = None
    #: the shortest and longest rows (padded lengths, in tokens) ``size`` holds for: rows outside re-size
    span: tuple[int, int] = (0, 0)
    #: bytes the last step's graphs could be kept within (``graph_memory_budget``, what ``"auto"`` resolved
    #: to); None: none kept
    graph_budget: int | None = None
    #: mini-batch graphs the last step kept within it (the step's last graph, kept anyway, not counted)
    graphs_kept: int = 0

    def forget(self) -> None:
        """Size again at the next step (a size setting changed)."""
        self.size, self.span = None, (0, 0)

    def resolved(self, name: str, value: int | str | None) -> int | None:
        """The size setting ``name``'s ``value``, or what ``"auto"`` resolved to."""
        if value == "auto":
            if self.size is None:
                raise RuntimeError(f"{name}='auto' is resolved at the first step, from its batch.")
            return self.size
        return None if value is None else int(value)


class MiniBatchPlanner:
    """The planning half of [`GradCache`][st_cached_losses.engine.gradcache.GradCache] (which declares the
    settings as its dataclass fields and gives the planner their sizes, resolved): cut columns into
    mini-batches and agree across processes on how many. The planner reads the sizes only, never the
    row-count setting itself: the settings go from the loss to the engine and stop there."""

    mini_batch_num_tokens: int | str | None
    sort_by_length: bool
    agree_mini_batches: bool | None
    #: what ``"auto"`` sizes resolved to (the engine's run state)
    auto: AutoSize

    @property
    def rows_per_mini_batch(self) -> int:
        """Rows per mini-batch: the engine's row count, or what ``"auto"`` resolved to."""
        raise NotImplementedError

    @property
    def tokens_per_mini_batch(self) -> int | None:
        """``mini_batch_num_tokens``, or what ``"auto"`` resolved to."""
        return self.auto.resolved("mini_batch_num_tokens", self.mini_batch_num_tokens)

    @property
    def sized(self) -> bool:
        """Whether the sizes are known (False while an ``"auto"`` size waits for its first step)."""
        raise NotImplementedError

    def plan(
        self, column: int, features: Features, *, trim_leading: bool = True, count: int | None = None
    ) -> list[MiniBatch]:
        """Cut one column into mini-batches (longest rows first when sorting).

        With ``mini_batch_num_tokens`` the rows, in that order, are packed greedily by their real tokens
        (sentence-transformers' rule; sorted, neighbours have similar lengths, so little padding).

        ``count`` (at least the number this process would cut on its own, see [`agreed_counts`][st_cached_losses.engine.planning.MiniBatchPlanner.agreed_counts])
        makes it exactly that many: the largest mini-batches are halved while rows allow (a token
        budget only gets easier), then filler mini-batches (one row, the shortest, embedded again;
        its output unused and its gradient zero) come first, so that the column's last forward, the
        one that keeps its graph, is a real one."""
        # an error raised here (e.g. no attention mask to count tokens by) is raised on every process by
        # agreed_counts under a sharded wrapper
        check_splittable(features)
        b = batch_size_of(features)
        # images or videos that cannot be assigned to rows are refused here, before any forward
        media_axes(features, b)
        lengths = row_lengths(features, b, trim_leading)
        order = longest_first(lengths if self.sort_by_length else None, b)
        tokens = self.tokens_per_mini_batch
        if tokens is None:
            size = self.rows_per_mini_batch
            spans = [(i, min(i + size, b)) for i in range(0, b, size)]
        else:
            counts = token_counts(features, b)
            if counts is None:
                raise no_token_counts(self.mini_batch_num_tokens, features)
            # an "auto" budget is one of memory, measured per padded token: counted as the mini-batch pads
            widths = extras = None
            if self.mini_batch_num_tokens == "auto" and lengths is not None:
                widths = lengths[order].tolist()
                # its vision patches: a row's own, not padded to the widest
                patches = media_tokens(features, b)
                extras = patches[order].tolist() if patches is not None else None
            spans = _pack(counts[order].tolist(), tokens, widths, extras)
        fillers: list[MiniBatch] = []
        if count is not None and count > len(spans):
            spans = _spread(spans, count)
            shortest = order[b - 1 : b]
            fillers = [
                MiniBatch(column, shortest, features, b, trim_leading, filler=True)
                for _ in range(count - len(spans))
            ]
        return fillers + [MiniBatch(column, order[s:e], features, b, trim_leading) for s, e in spans]

    def agreed_counts(
        self, model: nn.Module, columns: Sequence[Features], trim_leading: bool, error: str | None = None
    ) -> list[int] | None:
        """Mini-batches per column, the largest over processes, when ``model``'s forwards are collectives
        (FSDP1, FSDP2, DeepSpeed; DDP too with ``agree_mini_batches=True``) in a process group of more
        than one: one small all-gather. None when every process may plan on its own (under DDP the
        processes still meet in that all-gather, for the errors below; see [`meets`][st_cached_losses.engine.planning.MiniBatchPlanner.meets]).

        ``error`` (what a caller found wrong with this process's inputs, see
        [`raise_on_every_process`][st_cached_losses.engine.planning.MiniBatchPlanner.raise_on_every_process]) or a column this process cannot cut (e.g. inputs without a batch
        dimension) is raised here on every process, not in a collective the others would wait in
        forever: this process raises a ``ValueError`` with the cause, every other one a ``RuntimeError``
        naming this process and the cause."""
        if not self.meets(model):
            if error is not None:
                raise ValueError(error)
            return None
        # past meets(): whether the processes also agree on the mini-batches (not under DDP by default)
        agree = is_sharded(model) if self.agree_mini_batches is None else self.agree_mini_batches
        counts: list[int] = []
        if error is None and agree:
            try:
                counts = [len(self.plan(k, f, trim_leading=trim_leading)) for k, f in enumerate(columns)]
            except ValueError as exc:
                error = str(exc)
        device = model_device(model)
        try:
            agreed = agree_counts(counts, device, error)
            return agreed if agree else None
        except PeersFailed as exc:
            # every process is here: one more exchange tells each the others' causes
            try:
                causes = _exchange_errors(error, device)
            except RuntimeError:  # a failed process that left already: its cause stays with it
                causes = {}
            if error is not None:
                raise ValueError(error) from None
            if not causes:
                raise
            who = ", ".join(str(r) for r in causes)
            raise RuntimeError(
                f"{'rank' if len(causes) == 1 else 'ranks'} {who} of {world_size()} "
                "failed at the start of this step, before its encoder forwards; every rank stops here "
                "instead of waiting for them in a collective. "
                + " ".join(f"Rank {r}: {msg}" for r, msg in causes.items())
            ) from exc

    @staticmethod
    def meets(model: nn.Module) -> bool:
        """Whether the processes meet at the start of each step ([`agreed_counts`][st_cached_losses.engine.planning.MiniBatchPlanner.agreed_counts]'s one small
        all-gather): under every wrapper (DDP too) in a group of more than one process, so that an input
        one process refuses (e.g. an empty batch) is raised on every process there, not left to a peer
        waiting in the gradient reduction. Under DDP the mini-batch counts are not exchanged."""
        return is_distributed() and is_wrapped(model)

    def raise_on_every_process(self, model: nn.Module, error: Exception) -> NoReturn:
        """Raise ``error`` (found before `step` / `embed`, e.g. by a loss's check of its
        columns) so that no other process is left waiting for this one: where the processes agree on
        the mini-batches, at that agreement (the step's first collective, which the others reach in
        `step` / `embed`), where each of them raises a ``RuntimeError`` naming this process and
        the cause; elsewhere at once. This process raises ``error`` itself."""
        if self.meets(model):
            with contextlib.suppress(ValueError, RuntimeError):
                self.agreed_counts(model, [], False, str(error) or type(error).__name__)
        raise error

    def fits_in_one(self, columns: Sequence[Features], *, counts: Sequence[int] | None = None) -> bool:
        """Whether the whole batch, every column's rows together, fits in one mini-batch: then holding every
        column's graph at once (the non-cached loss's memory) holds no more than one mini-batch, and caching
        saves nothing. A batch whose columns each fit but not together is cached (one column's graph at a
        time), as sentence-transformers' cached losses do.

        With a row count: the columns' rows summed, within the rows per mini-batch. With a token budget: the
        columns' real tokens summed (an ``"auto"`` budget: each column's padded tokens, its rows as wide as
        its widest, plus its vision patches), within the budget; a lone column of one row is one
        mini-batch whatever its length.

        With agreed ``counts`` (a sharded wrapper, where every process must decide alike, since the
        decision sets how many forwards, which are collectives, each runs): a single column that every
        process embeds in one mini-batch. With more columns the summed rule would be each process's own
        (their batches may differ in size), so such a batch is cached."""
        if counts is not None:
            return len(counts) == 1 and counts[0] == 1
        if not self.sized:
            return False  # "auto", not sized yet
        sizes = [batch_size_of(features) for features in columns]
        budget = self.tokens_per_mini_batch
        if budget is None:
            return rows_fit_in_one(sizes, self.rows_per_mini_batch)
        if len(columns) == 1 and sizes[0] <= 1:
            return True  # one row is one mini-batch (a row longer than the budget is one of its own)
        total = 0
        for features, b in zip(columns, sizes):
            if b == 0:
                continue
            tokens = token_counts(features, b)
            if tokens is None:
                return False
            if self.mini_batch_num_tokens == "auto":
                # an "auto" budget counts padded tokens (see plan): every row as wide as the widest, at
                # most as wide as untrimmed
                ends = row_lengths(features, b, trim_leading=False)
                if ends is None:
                    return False
                patches = media_tokens(features, b)
                total += b * int(ends.max()) + (0 if patches is None else int(patches.sum()))
            else:
                total += int(tokens.sum())
            if total > budget:
                return False
        return True


def _spread(spans: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Halve the largest spans until there are ``count`` of them or every span is one row."""
    spans = list(spans)
    while len(spans) < count:
        i = max(range(len(spans)), key=lambda k: spans[k][1] - spans[k][0])
        start, end = spans[i]
        if end - start < 2:
            break
        mid = start + (end - start + 1) // 2
        spans[i : i + 1] = [(start, mid), (mid, end)]
    return spans


def _pack(
    tokens: list[int], budget: int, widths: list[int] | None = None, extras: list[int] | None = None
) -> list[tuple[int, int]]:
    """sentence-transformers' packing: consecutive rows while their token sum stays within ``budget``,
    at least one row per span: ``(start, end)`` spans covering ``range(len(tokens))``. With ``widths``
    (each row's padded length) a span counts its padded tokens instead: rows times its widest row, plus
    the sum of its rows' ``extras`` (their vision patches, which are not padded)."""
    spans = []
    start, total, widest, added = 0, 0, 0, 0
    for i, n in enumerate(tokens):
        wide = max(widest, widths[i]) if widths is not None else 0
        own = extras[i] if extras is not None else 0
        need = (i - start + 1) * wide + added + own if widths is not None else total + n
        if i > start and need > budget:
            spans.append((start, i))
            start, total, added = i, 0, 0
            wide = widths[i] if widths is not None else 0
        total += n
        added += own
        widest = wide
    if tokens:
        spans.append((start, len(tokens)))
    return spans


def _exchange_errors(error: str | None, device: torch.device) -> dict[int, str]:
    """Every failed process's error message, by rank (only after every process learnt that some failed,
    in [`MiniBatchPlanner.agreed_counts`][st_cached_losses.engine.planning.MiniBatchPlanner.agreed_counts]): its length, then its bytes, then a last meeting, as in
    ``agree_counts``, so that no process leaves while another still receives from it."""
    data = (error or "").encode()[:_MAX_ERROR_BYTES]
    sizes, _ = exchange_shapes(len(data), [], device, "error messages")
    out: dict[int, str] = {}
    if max(sizes) > 0:
        rows = torch.tensor(list(data), dtype=torch.uint8, device=device).reshape(-1, 1)
        table = all_gather_rows(rows, sizes).flatten().tolist()
        start = 0
        for r, n in enumerate(sizes):
            if n:
                out[r] = bytes(table[start : start + n]).decode(errors="replace")
            start += n
    # a failed process that already left closes its connections
    with contextlib.suppress(RuntimeError):
        exchange_shapes(0, [], device, "error messages")
    return out


#: the longest error message passed to the other processes
_MAX_ERROR_BYTES = 4000


def unsort(parts: list[Tensor], batches: list[MiniBatch], batch_size: int) -> Tensor:
    """Put mini-batch outputs (embedded in plan order) back in the column's row order: ``(B, d)``;
    ``parts`` has one entry per mini-batch that is not a filler, all of one shape but the rows (the cache
    form's ``finish`` pads packed rows to one width)."""
    flat = torch.cat(parts, dim=0)
    rows = torch.cat([mb.rows for mb in batches if not mb.filler]).to(flat.device)
    out = torch.empty((batch_size, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    out[rows] = flat
    return out
