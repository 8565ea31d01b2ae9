"""The GradCache engine: embed in mini-batches without a graph, cache the loss's gradient wrt every
embedding, and replay the encoder mini-batch by mini-batch when the loss is back-propagated.

No loss math lives here: a loss hands [`GradCache.step`][st_cached_losses.engine.gradcache.GradCache.step] a callable that maps the embeddings of
every column to ``(loss, gradients wrt those embeddings, gradients wrt extra tensors)``. No planning
either: which rows each mini-batch embeds, and how many mini-batches every process runs, is
[`MiniBatchPlanner`][st_cached_losses.engine.planning.MiniBatchPlanner]'s (GradCache's base).

What it does beyond GradCache (Gao et al., 2021):

* the plans of [`st_cached_losses.engine.planning`][st_cached_losses.engine.planning] (rows sorted by length, padding trimmed, token
  budgets, the same mini-batches on every process under a sharded wrapper);
* the RNG state (CPU and every available accelerator: CUDA, MPS, XPU, [`rng`][st_cached_losses.engine.rng])
  is snapshotted per mini-batch and restored at replay, so dropout masks are identical in both forwards;
  autocast settings are replayed too, and the forwards without a graph leave nothing in autocast's cache
  of cast weights ([`no_grad_forward`][st_cached_losses.engine.gradcache.no_grad_forward]);
* the final mini-batch's graph from the first stage is kept and back-propagated directly (one fewer
  forward), columns whose encoder is frozen are not replayed, and a batch that fits in one
  mini-batch, every column's rows together, is not cached at all (the loss takes the plain autograd
  path); a batch whose columns only fit one by one (e.g. a distillation batch of many hard-negative
  columns) is cached, one column's graph at a time;
* under DDP every replay but the last runs in ``no_sync()``: one gradient all-reduce per step, and none
  inside an outer ``no_sync`` (gradient accumulation); likewise FSDP2 (``set_requires_gradient_sync``:
  one reduce-scatter per step), FSDP1 (``no_sync()``) and DeepSpeed (its accumulation boundary);
* with ``keep_params_unsharded`` an FSDP2 model's parameters are all-gathered once per step instead of
  once per mini-batch forward and per replay (see [`GradCache`][st_cached_losses.engine.gradcache.GradCache]'s arguments).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from st_cached_losses.engine.auto_size import pick_mini_batch, row_span
from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.engine.checks import (
    auto_needs_budget,
    check_mini_batch_num_tokens,
    check_mini_batch_size,
    graph_budget,
    is_auto,
    memory_bytes,
)
from st_cached_losses.engine.features import (
    Features,
    batch_size_of,
    model_device,
    position_shift_invariant,
)
from st_cached_losses.engine.graph_budget import GraphKeeper, device_memory
from st_cached_losses.engine.planning import AutoSize, MiniBatch, MiniBatchPlanner, unsort
from st_cached_losses.engine.rng import RandState
from st_cached_losses.engine.wrappers import (
    LocalBackward,
    Unsharded,
    grad_sync_on,
    is_wrapped,
    skip_forward_buffer_sync,
    unsynced,
)

logger = logging.getLogger(__name__)

__all__ = ["GradCache", "LossAndGrad", "MiniBatch", "MiniBatchPlanner", "RandState", "no_grad_forward"]

#: ``embeddings per column -> (loss, grads per column, grads wrt the extra tensors)``
LossAndGrad = Callable[[list[Tensor]], tuple[Tensor, list[Tensor], list[Tensor | None]]]


@functools.cache
def _autocast_reuses_graphless_casts() -> bool:
    """Whether this torch has the fault [`no_grad_forward`][st_cached_losses.engine.gradcache.no_grad_forward] works around: inside an autocast region, a
    weight cast made under ``no_grad`` is cached and reused by a later forward *with* a graph, whose output
    then has no gradient path to the weight (torch before 2.11, pytorch/pytorch#158232). Asked of torch
    once, on the CPU with a 1 x 1 weight, in an autocast region of its own with the cache on."""
    weight = torch.ones(1, 1, requires_grad=True)
    x = torch.ones(1, 1)
    # grad mode on: probed first inside an evaluation's no_grad, the answer would be the fault's
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        with torch.no_grad():
            torch.nn.functional.linear(x, weight)
        return not torch.nn.functional.linear(x, weight).requires_grad


@contextlib.contextmanager
def no_grad_forward() -> Iterator[None]:
    """``torch.no_grad()`` for an encoder forward that may run inside the caller's autocast region.

    Inside an autocast region torch keeps the low-precision copy of each fp32 parameter it casts, for the
    region's later forwards. Before torch 2.11 it kept a copy cast under ``no_grad`` too, without a graph
    to the parameter, and a later forward with a graph in the same region reused it: the column's last
    forward of stage 1 (whose graph may be kept for the backward) and replays of a backward called inside
    the region then had no gradient path to the encoder's weights, and the cached loss's gradients were
    wrong (under bf16 autocast, 3e-2 off the fp32 gradients where sentence-transformers' own losses are
    3e-4 off; or missing). On such a torch this turns the cache off for the forward (each forward casts
    afresh, to the same values); on a torch without the fault (where a cast cached under ``no_grad`` keeps
    its graph) it is plain ``torch.no_grad()``, so the cache still saves the casts.
    """
    if not _autocast_reuses_graphless_casts():
        with torch.no_grad():
            yield
        return
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


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
    # the FSDP2 parameters kept unsharded for this step, released after the replay (keep_params_unsharded)
    held: Unsharded | None = None
    together: bool = False  # every mini-batch's graph kept (one per column): one backward call

    def __post_init__(self) -> None:
        # a loss that is dropped without a backward still releases the parameters it kept unsharded
        self._release = weakref.finalize(self, self.held.release) if self.held is not None else None
        if self._release is not None:
            self._release.atexit = False  # not at interpreter exit, with FSDP2 half torn down

    def backward(self, grad_output: float) -> list[Tensor | None]:
        """Once (`_Replay` refuses a second backward): the replays, then the extra tensors' grads."""
        try:
            self._replay(grad_output)
        finally:
            if self._release is not None:
                self._release()
        self.batches, self.grads = [], []
        return [g * grad_output if g is not None else None for g in self.extra_grads]

    def _replay(self, grad_output: float) -> None:
        todo = [mb for mb in self.batches if mb.column not in self.frozen]
        local = self.local
        if self.together:
            # a batch of one mini-batch per column: every graph kept, back-propagated in one call like a
            # plain loss's backward
            outs = [mb.kept for mb in todo if mb.kept is not None]
            grads = [self._grad_of(mb, grad_output, mb.kept) for mb in todo if mb.kept is not None]
            for mb in todo:
                mb.kept = None
            if local is not None:
                local.backward(outs, grads)
            else:
                torch.autograd.backward(outs, grads)
            return
        # the order of a step that replays everything but its last graph (kept first, then the batch
        # order), whether a mini-batch's graph was kept or is replayed now: .grad sums in the same
        # order, so graphs kept within graph_memory_budget give the same gradients bit for bit
        order = sorted(todo, key=lambda mb: mb is not self.batches[-1] or mb.kept is None)
        replays = [mb for mb in order if mb.kept is None]
        if self.sync and order:
            # the step's one gradient reduction comes from a synchronised replay, the last forward and
            # backward of the step (with every graph kept, the last one is replayed instead)
            final = replays[-1] if replays else order[-1]
            final.kept = None
            order = [mb for mb in order if mb is not final] + [final]
            replays = [mb for mb in order if mb.kept is None]
        bar = tqdm(total=len(replays), desc="Replay", disable=not self.engine.show_progress_bar, leave=False)
        for mb in order:
            if mb.kept is not None:
                out, mb.kept = mb.kept, None
                self._backward_kept(out, self._grad_of(mb, grad_output, out))
                continue
            self._replay_one(mb, grad_output, synced=self.sync and mb is order[-1])
            bar.update(1)
        bar.close()

    def _backward_kept(self, out: Tensor, grad: Tensor) -> None:
        """A first-stage graph's backward (its forward ran unsynchronised)."""
        if self.local is not None:
            self.local.backward([out], [grad])
            return
        # FSDP2 reads its gradient-sync flag at backward time
        with unsynced(self.model) if self.sync else contextlib.nullcontext():
            torch.autograd.backward(out, grad)

    def _replay_one(self, mb: MiniBatch, grad_output: float, *, synced: bool) -> None:
        """Re-run ``mb``'s forward with its RNG state and autocast, and back-propagate its gradient."""
        local = self.local
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

    def _grad_of(self, mb: MiniBatch, grad_output: float, out: Tensor) -> Tensor:
        if mb.filler:
            return torch.zeros_like(out)
        g = self.grads[mb.column].index_select(0, mb.rows.to(self.grads[mb.column].device))
        g = self.engine.form.expand(g, out)
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


@dataclass(frozen=True)
class GradCache(MiniBatchPlanner):
    """The cached first stage and the replayed second stage; the mini-batch plans are
    [`MiniBatchPlanner`][st_cached_losses.engine.gradcache.MiniBatchPlanner]'s.

    Its configuration (the fields below) is frozen when it is built: a changed setting is a new engine
    (``dataclasses.replace(cache, name=value)``, which is how a loss's setting changes it), and the run
    state that changes as it runs (what ``"auto"`` sizes resolved to) is kept in its
    [`AutoSize`][st_cached_losses.engine.planning.AutoSize], ``auto``, which a replaced engine keeps.

    Args:
        mini_batch_size: rows per encoder mini-batch; unused when ``mini_batch_num_tokens`` is set.
        mini_batch_num_tokens: budget of real tokens per mini-batch (attended, or ColBERT expansion
            positions: [`real_tokens`][st_cached_losses.engine.features.real_tokens]; a flattened column's
            sequence lengths), as sentence-transformers' ``mini_batch_num_tokens``: rows are packed
            greedily while their token sum stays within it, a row longer than the budget is a mini-batch
            of its own, and
            ``mini_batch_size`` is not used. None: ``mini_batch_size`` rows per mini-batch.
        sort_by_length: embed each column's rows from longest to shortest, so mini-batches pad little.
        reuse_last_graph: keep the graph of the last first-stage mini-batch instead of replaying it.
        show_progress_bar: tqdm bars over the mini-batches of both stages.
        agree_mini_batches: whether the processes agree on the mini-batches per column each step (one
            small all-gather) and all run that many (see [`plan`][st_cached_losses.engine.planning.MiniBatchPlanner.plan]). None: when the model's forwards
            are collectives (FSDP1, FSDP2, DeepSpeed); True: also under DDP, whose forwards are not.
        keep_params_unsharded: under FSDP2, keep every parameter group all-gathered from its first
            forward of a step (or evaluation pass) to the end of the step, then reshard and restore the
            modules' ``reshard_after_forward`` / ``reshard_after_backward``: one all-gather per group per
            step instead of one per mini-batch forward and per replay, the same gradients. Costs the
            memory of the whole unsharded model (as ZeRO-2) for the step; off by default, for models
            whose full parameters do not fit at once. Nothing for other wrappers.
        graph_memory_budget: bytes (or a size such as ``"6GB"``) of first-stage graphs to keep instead
            of replaying their mini-batches ([`st_cached_losses.engine.graph_budget`][st_cached_losses.engine.graph_budget]): the largest
            mini-batches first, measured, within the budget; the same gradients. ``"auto"``: on CUDA,
            what the device has free at the step's start after the step's own needs (a margin of a tenth
            of the device, the gradients, the cached embeddings, one mini-batch beside the kept graphs;
            [`AutoGraphBudget`][st_cached_losses.engine.graph_budget.AutoGraphBudget]), ``"auto:20GB"`` at
            most 20 GB; elsewhere none. None: keep only the last mini-batch's graph
            (``reuse_last_graph``). Under gradient synchronisation the last mini-batch is still replayed
            (the step's one reduction).
        output: the key of the model's output that a mini-batch's forward yields (with the default form):
            ``"sentence_embedding"``, a SentenceTransformer's ``(m, d)`` rows; ``"scores"``, a CrossEncoder's
            ``(m, 1)`` score of each (query, document) pair, where the rows are pairs and the cached
            quantity is one score per row.
        form: what a mini-batch's forward yields and how the cached rows and their gradients are kept
            ([`CacheForm`][st_cached_losses.engine.cache_form.CacheForm]: as the model outputs them;
            [`TokenRows`][st_cached_losses.engine.cache_form.TokenRows]: a multi-vector model's token rows,
            packed; the sparse loss's: only the non-zero entries of vocabulary-sized rows).
    """

    mini_batch_size: int | str = 32
    mini_batch_num_tokens: int | str | None = None
    sort_by_length: bool = True
    reuse_last_graph: bool = True
    show_progress_bar: bool = False
    agree_mini_batches: bool | None = None
    keep_params_unsharded: bool = False
    graph_memory_budget: int | str | None = None
    mini_batch_memory_budget: int | None = None
    output: str = "sentence_embedding"
    form: CacheForm = field(default_factory=CacheForm, repr=False)
    #: the run state: what "auto" sizes resolved to (updated by ``resolve_auto``)
    auto: AutoSize = field(default_factory=AutoSize, repr=False)

    @property
    def rows_per_mini_batch(self) -> int:
        """``mini_batch_size``, or what ``"auto"`` resolved to (the planner's row count)."""
        return cast(int, self.auto.resolved("mini_batch_size", self.mini_batch_size))

    @property
    def sized(self) -> bool:
        """Whether the sizes are known (False while an ``"auto"`` size waits for its first step)."""
        return self.auto.size is not None or not is_auto(self.mini_batch_size, self.mini_batch_num_tokens)

    @property
    def auto_size(self) -> int | None:
        """What ``"auto"`` resolved to (rows, or tokens), or None: not sized yet."""
        return self.auto.size

    def __post_init__(self) -> None:
        check_mini_batch_size(self.mini_batch_size)
        check_mini_batch_num_tokens(self.mini_batch_num_tokens)
        # frozen: the budgets in bytes are written once, here
        object.__setattr__(self, "graph_memory_budget", graph_budget(self.graph_memory_budget))
        object.__setattr__(
            self,
            "mini_batch_memory_budget",
            memory_bytes(self.mini_batch_memory_budget, "mini_batch_memory_budget"),
        )

    def resolve_auto(self, model: nn.Module, columns: Sequence[Features], trim_leading: bool) -> None:
        """Size ``"auto"`` mini-batches: the largest whose forward fits in ``mini_batch_memory_budget`` (on
        CUDA, by default half the device's free memory: what no process holds plus what torch's allocator
        holds unused), from forwards at two sizes of the batch's heaviest rows (and, for a token budget,
        of its lightest; [`auto_size`][st_cached_losses.engine.auto_size]); logged.

        Sized at the first step, and measured again at every step whose rows (over every process) reach
        outside the lengths measured so far: longer rows for either setting (a graph grows with its
        rows' length, so a size measured on short rows would let a later batch of long ones hold many
        times the budget), shorter ones for a token budget (a row's own costs weigh more per token). A
        new size never exceeds the old one (it holds for every length seen), so a mini-batch stays
        within the budget whatever the order of the batches. The result of training does not depend
        on it."""
        by_tokens = self.mini_batch_num_tokens == "auto"
        if not is_auto(self.mini_batch_size, self.mini_batch_num_tokens):
            return
        device = model_device(model)
        shortest, longest = row_span(columns, trim_leading, device)
        if self.auto.size is not None:
            low, high = self.auto.span
            if longest <= high and (shortest >= low or not by_tokens):
                return
            shortest, longest = min(shortest, low), max(longest, high)
        budget = self.mini_batch_memory_budget
        if budget is None:
            memory = device_memory(device)
            if memory is None:
                raise auto_needs_budget(device.type)
            budget = memory[0] // 2
        size = pick_mini_batch(model, columns, trim_leading, budget, by_tokens=by_tokens, encode=self.encode)
        what = "mini_batch_num_tokens" if by_tokens else "mini_batch_size"
        if self.auto.size is None:
            logger.info(
                "%s='auto': %d for a budget of %.3g GB of activations (measured at two sizes on this "
                "batch's rows of %d to %d tokens).",
                what,
                size,
                budget / 1e9,
                shortest,
                longest,
            )
        else:
            size = min(size, self.auto.size)
            logger.info(
                "%s='auto': re-sized from %d to %d for a budget of %.3g GB of activations: this batch's "
                "rows reach outside the %d to %d tokens measured before (now %d to %d).",
                what,
                self.auto.size,
                size,
                budget / 1e9,
                *self.auto.span,
                shortest,
                longest,
            )
        self.auto.size, self.auto.span = size, (shortest, longest)

    def encode(self, model: nn.Module, features: Features) -> Tensor:
        """One mini-batch's rows as the form yields them: the model's ``output`` (``(m, d)`` embeddings, or
        pair scores ``(m, 1)``), or token rows packed as ``(m, t, d + 1)``
        ([`TokenRows`][st_cached_losses.engine.cache_form.TokenRows])."""
        # ranks run different numbers of mini-batch forwards: no buffer broadcast may wait inside them
        skip_forward_buffer_sync(model)
        # a column may wait on the CPU (a reranker's pairs, tokenized per mini-batch): only the mini-batch
        # that runs goes to the model's device. Inputs already on an accelerator stay where they are (a
        # model whose parameters are offloaded to the CPU still computes there). A fresh dict:
        # SentenceTransformer modules write their outputs into the one they get. Contiguous: a trimmed
        # slice is a strided view of the batch, a compiled model guards on its inputs' strides, and views
        # of some widths and whole rows of others would each compile a graph of their own
        device = model_device(model)
        moved = device.type != "cpu"
        features = {
            k: (v.to(device) if moved and v.device.type == "cpu" else v).contiguous()
            if isinstance(v, Tensor)
            else v
            for k, v in features.items()
        }
        return self.form.encode(model, features, self.output)

    def _keep(self, out: Tensor) -> Tensor:
        """A mini-batch's output as the cache keeps it."""
        kept = out.detach().float()
        return self.form.pack(kept)

    def _columns(
        self, parts: list[list[Tensor]], plans: list[list[MiniBatch]], columns: Sequence[Features]
    ) -> list[Tensor]:
        """Every column's kept parts (in the form's final form) in the columns' row order; ``parts`` is
        emptied column by column (the parts and the ordered columns are never all held at once)."""
        parts[:] = self.form.finish(parts)
        out = []
        for k, (plan, features) in enumerate(zip(plans, columns)):
            out.append(unsort(parts[k], plan, batch_size_of(features)))
            parts[k] = []
        return out

    def _hold(self, model: nn.Module) -> Unsharded | None:
        return Unsharded.hold(model) if self.keep_params_unsharded else None

    def embed(self, model: nn.Module, columns: Sequence[Features]) -> list[Tensor]:
        """Every column's embeddings, mini-batch by mini-batch, without a graph (evaluation)."""
        kept: list[list[Tensor]] = []
        plans: list[list[MiniBatch]] = []
        trim = position_shift_invariant(model)
        self.resolve_auto(model, columns, trim)
        # forwards of a sharded model are collectives, in evaluation too
        counts = self.agreed_counts(model, columns, trim)
        held = self._hold(model)
        try:
            with no_grad_forward():
                for k, features in enumerate(columns):
                    batches = self.plan(k, features, trim_leading=trim, count=counts[k] if counts else None)
                    parts = []
                    for mb in tqdm(batches, desc="Embed", disable=not self.show_progress_bar, leave=False):
                        out_mb = self.encode(model, mb.features)
                        if not mb.filler:
                            parts.append(self._keep(out_mb))
                    kept.append(parts)
                    plans.append(batches)
        finally:
            if held is not None:
                held.release()
        return self._columns(kept, plans, columns)

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
        self.resolve_auto(model, columns, trim)
        # under a sharded wrapper every process runs this many mini-batches per column (see plan)
        counts = self.agreed_counts(model, columns, trim)
        # a batch that fits in one mini-batch, every column's rows together, is not cached: every forward
        # keeps its graph, exactly like the non-cached loss, and they hold no more than one mini-batch.
        # Columns that only fit one by one are cached (holding them all would be the non-cached loss's
        # memory, many mini-batches'). Not under gradient synchronisation, where the one synchronised
        # forward must be the last one before the backward (and ranks may differ in batch size).
        keep_all = self.fits_in_one(columns, counts=counts) and not sync
        # released by the session after its replay, or here if stages 1 and 2 fail
        held = self._hold(model)
        try:
            batches: list[MiniBatch] = []
            kept: list[list[Tensor]] = []
            frozen: set[int] = set()
            device = model_device(model)
            autocast = _Autocast.current(device.type)
            local = LocalBackward.of(model)
            # forwards whose graph may be back-propagated: hidden from a static-graph reducer
            # (see LocalBackward)
            graph_model = local.module if local is not None else model
            plans = [
                self.plan(k, features, trim_leading=trim, count=counts[k] if counts else None)
                for k, features in enumerate(columns)
            ]
            total = sum(len(plan) for plan in plans)
            budget = None if keep_all else self.graph_memory_budget
            keeper = GraphKeeper(
                model,
                plans,
                columns,
                trim,
                budget,
                agree=counts is not None,
                encode=self.encode,
                last_kept=self.reuse_last_graph and not sync,
            )
            bar = tqdm(total=total, desc="Embed", disable=not self.show_progress_bar or keep_all, leave=False)
            for k, plan in enumerate(plans):
                parts = []
                for j, mb in enumerate(plan):
                    mb.rng = RandState()
                    # the step's very last forward keeps its graph for the backward (not under DDP sync,
                    # where the synced forward must come last)
                    reuse = (
                        self.reuse_last_graph and k == len(columns) - 1 and j == len(plan) - 1 and not sync
                    )
                    if keep_all:
                        out = self.encode(graph_model, mb.features)
                        mb.kept = out if out.requires_grad else None
                    elif keeper.wants(mb):
                        # a graph the budget may keep (measured), or the column's last forward
                        with unsynced(model):
                            out = keeper.forward(graph_model, mb, device, exempt=reuse)
                    elif j == len(plan) - 1:
                        # with a graph: tells whether this column's encoder is frozen
                        with unsynced(model):
                            out = self.encode(graph_model, mb.features)
                        if reuse and out.requires_grad:
                            mb.kept = out
                    else:
                        with no_grad_forward():
                            out = self.encode(model, mb.features)
                    if j == len(plan) - 1 and not out.requires_grad:
                        # the same on every process (same model, same column): no agreement needed
                        frozen.add(k)
                    if not mb.filler:
                        parts.append(self._keep(out))
                    bar.update(1)
                batches.extend(plan)
                kept.append(parts)
            bar.close()
            self.auto.graph_budget = keeper.resolved_budget
            self.auto.graphs_kept = keeper.kept
            embeddings = self._columns(kept, plans, columns)
            loss, grads, extra_grads = loss_and_grad(embeddings)
            session = _Session(
                self, model, batches, grads, list(extra_grads), frozen, autocast, sync, local, held, keep_all
            )
            if not extra or not any(t.requires_grad for t in extra):
                # autograd calls a Function's backward only when some input requires grad: without a tensor
                # that does (no learnable scale), this dummy leaf makes the loss's backward run the replay
                extra = (torch.zeros((), device=loss.device, requires_grad=True),)
                session.extra_grads = [None]
            return _Replay.apply(session, loss, *extra)
        except BaseException:
            if held is not None:
                held.release()
            raise
