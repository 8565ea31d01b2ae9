"""The GradCache engine: embed in mini-batches without a graph, cache the loss's gradient wrt every
embedding, and replay the encoder mini-batch by mini-batch when the loss is back-propagated.

No loss math lives here: a loss hands :meth:`GradCache.step` a callable that maps the embeddings of
every column to ``(loss, gradients wrt those embeddings, gradients wrt extra tensors)``.

What it does beyond GradCache (Gao et al., 2021):

* rows of each column are sorted by length before they are cut into mini-batches, and each
  mini-batch's padding is trimmed (leading padding only where positions are shift-invariant); the loss
  does not care in which order rows are embedded,
  so on text of varied length this removes most of the padding a plain batch carries;
* mini-batches by row count or, as sentence-transformers' ``mini_batch_num_tokens``, by a budget of
  real (non-padding) tokens, packed greedily (a row longer than the budget alone); sorted rows pack
  into fewer, less padded mini-batches than the batch's own order;
* the RNG state (CPU and every initialised accelerator) is snapshotted per mini-batch and restored at
  replay, so dropout masks are identical in both forwards; autocast settings are replayed too;
* the final mini-batch's graph from the first stage is kept and back-propagated directly (one fewer
  forward), columns whose encoder is frozen are not replayed, and a batch that fits in one
  mini-batch is not cached at all (the loss takes the plain autograd path);
* under DDP every replay but the last runs in ``no_sync()``: one gradient all-reduce per step, and none
  inside an outer ``no_sync`` (gradient accumulation); likewise FSDP2 (``set_requires_gradient_sync``:
  one reduce-scatter per step), FSDP1 (``no_sync()``) and DeepSpeed (its accumulation boundary);
* under a sharded wrapper (FSDP1, FSDP2, DeepSpeed), whose forwards and backwards are collectives,
  every process runs the same number of mini-batch forwards and replays in the same order, whatever
  its batch size or token budget: the processes agree once per step on the mini-batches per column
  (one small all-gather), rows are spread over that many, and a process with too few rows embeds one
  of them again in a mini-batch whose output is not used and whose gradient is exactly zero. An input
  this process refuses (a loss's column check, a column the plan cannot cut) is raised at that same
  all-gather on every process, naming the process and the cause, not left to a peer's hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from st_cached_losses.distributed import (
    STATS,
    agree_counts,
    all_gather_rows,
    exchange_shapes,
    is_distributed,
    world_size,
)
from st_cached_losses.features import (
    Features,
    batch_size_of,
    check_splittable,
    position_shift_invariant,
    row_lengths,
    slice_features,
    token_counts,
    unwrap_model,
)
from st_cached_losses.functional import check_positive_int
from st_cached_losses.sync import LocalBackward, grad_sync_on, is_ddp, is_sharded, is_wrapped, unsynced

#: ``embeddings per column -> (loss, grads per column, grads wrt the extra tensors)``
LossAndGrad = Callable[[list[Tensor]], tuple[Tensor, list[Tensor], list[Tensor | None]]]


class RandState:
    """The RNG state of the CPU and of every initialised CUDA device, replayable."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


@dataclass
class MiniBatch:
    column: int
    rows: Tensor  # (m,) indices into the column, in the order they are embedded
    source: Features  # the whole column's inputs
    batch_size: int  # rows of the whole column
    trim_leading: bool = True  # whether leading padding may be cut (see position_shift_invariant)
    rng: RandState | None = None
    kept: Tensor | None = None  # the output with its graph, when kept from stage 1
    # a stand-in forward that keeps collectives in step with other processes (see GradCache.plan):
    # its output is not an embedding and its gradient is zero
    filler: bool = False

    @property
    def features(self) -> Features:
        """This mini-batch's inputs, padding trimmed; sliced when needed, so that no copy of the
        whole batch's inputs stays alive between the two stages."""
        return slice_features(self.source, self.rows, self.batch_size, trim_leading=self.trim_leading)


@dataclass
class _Autocast:
    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def current(cls, device_type: str) -> _Autocast:
        if device_type not in ("cpu", "cuda", "xpu", "mps"):
            return cls(device_type, False, torch.float32)
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


@dataclass
class _Session:
    """Everything one forward needs for its backward; owned by the returned loss's graph node."""

    engine: GradCache
    model: nn.Module
    batches: list[MiniBatch]
    grads: list[Tensor]  # per column (B, d): dL/d embedding
    extra_grads: list[Tensor | None]
    frozen: set[int]
    autocast: _Autocast
    sync: bool  # whether this backward should trigger DDP's gradient all-reduce
    local: LocalBackward | None  # replays hidden from a hook-counting wrapper (built once, in step)
    done: bool = False

    def backward(self, grad_output: float) -> list[Tensor | None]:
        if self.done:
            raise RuntimeError(
                "this cached loss was already back-propagated; call the loss again for a new step."
            )
        self.done = True
        todo = [mb for mb in self.batches if mb.column not in self.frozen]
        kept = [mb for mb in todo if mb.kept is not None]
        replay = [mb for mb in todo if mb.kept is None]
        local = self.local
        # kept graphs go first (in one call, like a plain loss's backward), so their activations are
        # freed before any replay allocates its own
        if kept:
            outs = [mb.kept for mb in kept]
            grads = [self._grad_of(mb, grad_output, out) for mb, out in zip(kept, outs)]  # type: ignore[arg-type]
            for mb in kept:
                mb.kept = None
            if local is not None:
                local.backward(outs, grads)  # type: ignore[arg-type]
            else:
                torch.autograd.backward(outs, grads)  # type: ignore[arg-type]
        bar = tqdm(total=len(replay), desc="Replay", disable=not self.engine.show_progress_bar, leave=False)
        for i, mb in enumerate(replay):
            synced = self.sync and i == len(replay) - 1
            with mb.rng.replay() if mb.rng is not None else contextlib.nullcontext():
                if local is not None and not synced:
                    # static graph: the reducer must see only the final, synchronised replay
                    with self.autocast():
                        out = self.engine.encode(local.module, mb.features)
                    local.backward([out], [self._grad_of(mb, grad_output, out)])
                elif local is not None:
                    with self.autocast():
                        out = self.engine.encode(self.model, mb.features)
                    local.synced_backward(out, self._grad_of(mb, grad_output, out))
                else:
                    with unsynced(self.model) if not synced else contextlib.nullcontext():
                        with self.autocast():
                            out = self.engine.encode(self.model, mb.features)
                        torch.autograd.backward(out, self._grad_of(mb, grad_output, out))
            bar.update(1)
        bar.close()
        self.batches, self.grads = [], []
        return [g * grad_output if g is not None else None for g in self.extra_grads]

    def _grad_of(self, mb: MiniBatch, grad_output: float, out: Tensor) -> Tensor:
        if mb.filler:
            return torch.zeros_like(out)
        g = self.grads[mb.column].index_select(0, mb.rows.to(self.grads[mb.column].device))
        return (g * grad_output).to(out.dtype)


class _Replay(torch.autograd.Function):
    """Carries the loss value; its backward replays the encoder and returns the extra tensors' grads."""

    @staticmethod
    def forward(ctx: Any, session: _Session, loss: Tensor, *extra: Tensor) -> Tensor:
        ctx.session = session
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        session, ctx.session = ctx.session, None
        if session is None:
            raise RuntimeError(
                "this cached loss was already back-propagated; call the loss again for a new step."
            )
        with torch.enable_grad():  # autograd runs backward functions with grad mode off
            extra = session.backward(float(grad))
        return (None, None, *extra)


@dataclass
class GradCache:
    """Mini-batch planning, the cached first stage and the replayed second stage.

    Args:
        mini_batch_size: rows per encoder mini-batch; unused when ``mini_batch_num_tokens`` is set.
        mini_batch_num_tokens: budget of real (non-padding, from the attention mask) tokens per
            mini-batch, as sentence-transformers' ``mini_batch_num_tokens``: rows are packed greedily while
            their token sum stays within it, a row longer than the budget is a mini-batch of its own, and
            ``mini_batch_size`` is not used. None: ``mini_batch_size`` rows per mini-batch.
        sort_by_length: embed each column's rows from longest to shortest, so mini-batches pad little.
        reuse_last_graph: keep the graph of the last first-stage mini-batch instead of replaying it.
        show_progress_bar: tqdm bars over the mini-batches of both stages.
        agree_mini_batches: whether the processes agree on the mini-batches per column each step (one
            small all-gather) and all run that many (see :meth:`plan`). None: when the model's forwards
            are collectives (FSDP1, FSDP2, DeepSpeed); True: also under DDP, whose forwards are not.
    """

    mini_batch_size: int = 32
    mini_batch_num_tokens: int | None = None
    sort_by_length: bool = True
    reuse_last_graph: bool = True
    show_progress_bar: bool = False
    agree_mini_batches: bool | None = None

    def __post_init__(self) -> None:
        if self.mini_batch_size is None:
            raise ValueError("mini_batch_size must be a positive integer, got None; e.g. 32.")
        check_positive_int("mini_batch_size", self.mini_batch_size)
        check_positive_int("mini_batch_num_tokens", self.mini_batch_num_tokens)

    @staticmethod
    def encode(model: nn.Module, features: Features) -> Tensor:
        if is_ddp(model):
            # DDP broadcasts buffers at a forward that follows a synchronised one; ranks run different
            # numbers of mini-batch forwards (unequal batches, token budgets), so such a collective would
            # not line up across ranks and hang. Text encoders' buffers are constants (position ids).
            model.require_forward_param_sync = False  # type: ignore[assignment]
        # a fresh dict: SentenceTransformer modules write their outputs into the one they get
        return model(dict(features))["sentence_embedding"]

    def plan(
        self, column: int, features: Features, *, trim_leading: bool = True, count: int | None = None
    ) -> list[MiniBatch]:
        """Cut one column into mini-batches (longest rows first when sorting).

        With ``mini_batch_num_tokens`` the rows, in that order, are packed greedily by their real tokens
        (sentence-transformers' rule; sorted, neighbours have similar lengths, so little padding).

        ``count`` (at least the number this process would cut on its own, see :meth:`agreed_counts`)
        makes it exactly that many: the largest mini-batches are halved while rows allow (a token
        budget only gets easier), then filler mini-batches (one row, the shortest, embedded again;
        its output unused and its gradient zero) come first, so that the column's last forward, the
        one that keeps its graph, is a real one.
        """
        # an error raised here (e.g. no attention mask to count tokens by) is raised on every process by
        # agreed_counts under a sharded wrapper
        check_splittable(features)
        b = batch_size_of(features)
        lengths = row_lengths(features, b, trim_leading)
        if self.sort_by_length and lengths is not None:
            order = torch.argsort(lengths, descending=True, stable=True)
        else:
            order = torch.arange(b)
        if self.mini_batch_num_tokens is None:
            spans = [(i, min(i + self.mini_batch_size, b)) for i in range(0, b, self.mini_batch_size)]
        else:
            spans = _pack(self._token_counts(features, b)[order].tolist(), self.mini_batch_num_tokens)
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
        than one: one small all-gather. None when every process may plan on its own.

        ``error`` (what a caller found wrong with this process's inputs, see
        :meth:`raise_on_every_process`) or a column this process cannot cut (e.g. inputs without a batch
        dimension) is raised here on every process, not in a collective the others would wait in
        forever: this process raises a ``ValueError`` with the cause, every other one a ``RuntimeError``
        naming this process and the cause."""
        if not self.agrees(model):
            if error is not None:
                raise ValueError(error)
            return None
        counts: list[int] = []
        if error is None:
            try:
                counts = [len(self.plan(k, f, trim_leading=trim_leading)) for k, f in enumerate(columns)]
            except ValueError as exc:
                error = str(exc)
        first_param = next(unwrap_model(model).parameters(), None)
        device = first_param.device if first_param is not None else torch.device("cpu")
        barriers = STATS.calls.get("barrier", 0)
        try:
            return agree_counts(counts, device, error)
        except (ValueError, RuntimeError) as exc:
            # agree_counts meets once more (a barrier) only when the table shows a failed process: then
            # every process is here, and one more exchange tells each the others' causes
            if STATS.calls.get("barrier", 0) == barriers:
                raise
            try:
                causes = _exchange_errors(error, device)
            except RuntimeError:  # a failed process that left already: its cause stays with it
                causes = {}
            if error is not None or not causes:
                raise
            who = ", ".join(str(r) for r in causes)
            raise RuntimeError(
                f"{'rank' if len(causes) == 1 else 'ranks'} {who} of {world_size()} "
                "failed at the start of this step, before its encoder forwards; every rank stops here "
                "instead of waiting for them in a collective. "
                + " ".join(f"Rank {r}: {msg}" for r, msg in causes.items())
            ) from exc

    def agrees(self, model: nn.Module) -> bool:
        """Whether the processes agree on the mini-batches each step (see :meth:`agreed_counts`)."""
        wanted = is_sharded(model) if self.agree_mini_batches is None else self.agree_mini_batches
        return wanted and is_distributed() and is_wrapped(model)

    def raise_on_every_process(self, model: nn.Module, error: Exception) -> NoReturn:
        """Raise ``error`` (found before :meth:`step` / :meth:`embed`, e.g. by a loss's check of its
        columns) so that no other process is left waiting for this one: where the processes agree on
        the mini-batches, at that agreement (the step's first collective, which the others reach in
        :meth:`step` / :meth:`embed`), where each of them raises a ``RuntimeError`` naming this process and
        the cause; elsewhere at once. This process raises ``error`` itself."""
        if self.agrees(model):
            with contextlib.suppress(ValueError, RuntimeError):
                self.agreed_counts(model, [], False, str(error) or type(error).__name__)
        raise error

    def fits_in_one(
        self, columns: Sequence[Features], *, trim_leading: bool = True, counts: Sequence[int] | None = None
    ) -> bool:
        """Whether every column is a single mini-batch (then caching buys nothing); with agreed
        ``counts``, whether those are all one."""
        if counts is not None:
            return all(c == 1 for c in counts)
        budget = self.mini_batch_num_tokens
        for features in columns:
            b = batch_size_of(features)
            if budget is None:
                if b > self.mini_batch_size:
                    return False
            elif b > 1:
                tokens = token_counts(features, b)
                if tokens is None or int(tokens.sum()) > budget:
                    return False
        return True

    def _token_counts(self, features: Features, batch_size: int) -> Tensor:
        tokens = token_counts(features, batch_size)
        if tokens is None:
            raise ValueError(
                f"mini_batch_num_tokens={self.mini_batch_num_tokens} needs each row's token count, read from "
                f"the inputs' 2-D attention_mask, and this column has none (keys {sorted(features)}); set "
                "mini_batch_num_tokens=None and use mini_batch_size instead."
            )
        return tokens

    def embed(self, model: nn.Module, columns: Sequence[Features]) -> list[Tensor]:
        """Every column's embeddings, mini-batch by mini-batch, without a graph (evaluation)."""
        out = []
        trim = position_shift_invariant(model)
        # forwards of a sharded model are collectives, in evaluation too
        counts = self.agreed_counts(model, columns, trim)
        with torch.no_grad():
            for k, features in enumerate(columns):
                batches = self.plan(k, features, trim_leading=trim, count=counts[k] if counts else None)
                parts = []
                for mb in tqdm(batches, desc="Embed", disable=not self.show_progress_bar, leave=False):
                    out_mb = self.encode(model, mb.features).float()
                    if not mb.filler:
                        parts.append(out_mb)
                out.append(_unsort(parts, batches, batch_size_of(features)))
        return out

    def step(
        self,
        model: nn.Module,
        columns: Sequence[Features],
        loss_and_grad: LossAndGrad,
        extra: Sequence[Tensor] = (),
    ) -> Tensor:
        """Stage 1 (embed without a graph), stage 2 (loss and gradients wrt the embeddings); returns the
        loss as a tensor whose backward replays the encoder with the cached gradients (stage 3).

        ``extra`` are tensors the loss depends on besides the embeddings (e.g. a learnable scale); the
        third output of ``loss_and_grad`` gives their gradients.
        """
        sync = is_wrapped(model) and grad_sync_on(model)
        trim = position_shift_invariant(model)
        # under a sharded wrapper every process runs this many mini-batches per column (see plan)
        counts = self.agreed_counts(model, columns, trim)
        # a batch that fits in one mini-batch per column is not cached: every forward keeps its graph,
        # exactly like the non-cached loss. Not under gradient synchronisation, where the one
        # synchronised forward must be the last one before the backward (and ranks may differ in
        # batch size).
        keep_all = self.fits_in_one(columns, trim_leading=trim, counts=counts) and not sync
        batches: list[MiniBatch] = []
        embeddings: list[Tensor] = []
        frozen: set[int] = set()
        first_param = next(unwrap_model(model).parameters(), None)
        device_type = first_param.device.type if first_param is not None else "cpu"
        autocast = _Autocast.current(device_type)
        local = LocalBackward.of(model)
        # forwards whose graph may be back-propagated: hidden from a static-graph reducer (see LocalBackward)
        graph_model = local.module if local is not None else model
        plans = [
            self.plan(k, features, trim_leading=trim, count=counts[k] if counts else None)
            for k, features in enumerate(columns)
        ]
        total = sum(len(plan) for plan in plans)
        bar = tqdm(total=total, desc="Embed", disable=not self.show_progress_bar or keep_all, leave=False)
        for k, (features, plan) in enumerate(zip(columns, plans)):
            parts = []
            for j, mb in enumerate(plan):
                mb.rng = RandState()
                if keep_all:
                    out = self.encode(graph_model, mb.features)
                    mb.kept = out if out.requires_grad else None
                elif j == len(plan) - 1:
                    # with a graph: tells whether this column's encoder is frozen; the very last one is
                    # kept for the backward (not under DDP sync, where the synced forward must come last)
                    with unsynced(model):
                        out = self.encode(graph_model, mb.features)
                    if self.reuse_last_graph and k == len(columns) - 1 and not sync and out.requires_grad:
                        mb.kept = out
                else:
                    with torch.no_grad():
                        out = self.encode(model, mb.features)
                if j == len(plan) - 1 and not out.requires_grad:
                    # the same on every process (same model, same column): no agreement needed
                    frozen.add(k)
                if not mb.filler:
                    parts.append(out.detach().float())
                bar.update(1)
            batches.extend(plan)
            embeddings.append(_unsort(parts, plan, batch_size_of(features)))
        bar.close()
        loss, grads, extra_grads = loss_and_grad(embeddings)
        session = _Session(self, model, batches, grads, list(extra_grads), frozen, autocast, sync, local)
        if not extra or not any(t.requires_grad for t in extra):
            # autograd calls a Function's backward only when some input requires grad: without a tensor
            # that does (no learnable scale), this dummy leaf makes the loss's backward run the replay
            extra = (torch.zeros((), device=loss.device, requires_grad=True),)
            session.extra_grads = [None]
        return _Replay.apply(session, loss, *extra)


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


def _pack(tokens: list[int], budget: int) -> list[tuple[int, int]]:
    """sentence-transformers' packing: consecutive rows while their token sum stays within ``budget``,
    at least one row per span: ``(start, end)`` spans covering ``range(len(tokens))``."""
    spans = []
    start, total = 0, 0
    for i, n in enumerate(tokens):
        if i > start and total + n > budget:
            spans.append((start, i))
            start, total = i, 0
        total += n
    if tokens:
        spans.append((start, len(tokens)))
    return spans


def _exchange_errors(error: str | None, device: torch.device) -> dict[int, str]:
    """Every failed process's error message, by rank (only after every process learnt that some failed,
    in :meth:`GradCache.agreed_counts`): its length, then its bytes, then a last meeting, as in
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


def _unsort(parts: list[Tensor], batches: list[MiniBatch], batch_size: int) -> Tensor:
    """Put mini-batch outputs (embedded in plan order) back in the column's row order: ``(B, d)``;
    ``parts`` has one entry per mini-batch that is not a filler."""
    flat = torch.cat(parts, dim=0)
    rows = torch.cat([mb.rows for mb in batches if not mb.filler]).to(flat.device)
    out = torch.empty((batch_size, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    out[rows] = flat
    return out
