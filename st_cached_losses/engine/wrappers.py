"""Gradient synchronisation of the wrappers a model may be trained in (DDP, FSDP1, FSDP2, DeepSpeed):
recognising them, turning their gradient reduction off for the replays but the last, and, where the
wrapper counts gradient hooks (DDP's static graph, DeepSpeed ZeRO 1/2), back-propagating replays without
those hooks; under DeepSpeed ZeRO-3, whose parameters are partitioned, through DeepSpeed's own coalesced
reduction instead; under FSDP2, keeping the parameters unsharded for a step. Every private attribute of a
wrapper the engine needs is read here and nowhere else. No loss math and no mini-batch planning here: the
engine (``gradcache``) decides when."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "CoalescedBackward",
    "LocalBackward",
    "Unsharded",
    "accumulate_locally",
    "bare",
    "fsdp2_modules",
    "grad_sync_on",
    "is_ddp",
    "is_deepspeed",
    "is_fsdp1",
    "is_sharded",
    "is_static_graph",
    "is_wrapped",
    "is_zero3",
    "skip_forward_buffer_sync",
    "unsynced",
]


def bare(model: nn.Module) -> nn.Module:
    """``model`` without ``torch.compile``'s wrapper (an ``OptimizedModule``, what the trainer hands the
    loss with ``torch_compile=True``, around the DDP / FSDP1 / DeepSpeed wrapper when there is one): the
    wrapper's type and flags belong to the module inside, and attributes set on the compile wrapper
    would not reach it. Forwards still go through the compiled module."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was compiled in this process (and importing dynamo is slow)
        return model
    while isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def is_ddp(model: nn.Module) -> bool:
    return isinstance(bare(model), nn.parallel.DistributedDataParallel)


def is_static_graph(model: nn.Module) -> bool:
    return is_ddp(model) and bool(getattr(bare(model), "static_graph", False))


def is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(bare(model), FullyShardedDataParallel)


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` sharded by FSDP2's ``fully_shard`` (the root first when it is one)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_deepspeed(model: nn.Module) -> bool:
    # by name: deepspeed is not a dependency, and importing it to check would be slow
    return any(c.__name__ == "DeepSpeedEngine" for c in type(bare(model)).__mro__)


def is_zero3(model: nn.Module) -> bool:
    """A DeepSpeed engine with ZeRO stage 3: its parameters are partitioned (an empty tensor on each
    process outside the forward and backward of their module) and it owns their gradients."""
    return is_deepspeed(model) and int(bare(model).zero_optimization_stage()) == 3  # type: ignore[operator]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s forwards are collectives (FSDP1, FSDP2, DeepSpeed): every process must then
    run the same sequence of mini-batch forwards and backwards."""
    return is_fsdp1(model) or is_deepspeed(model) or bool(fsdp2_modules(model))


def is_wrapped(model: nn.Module) -> bool:
    return is_ddp(model) or is_sharded(model)


def _fsdp2_sync_on(modules: Sequence[nn.Module]) -> bool:
    # FSDP2 has a public setter but no getter: read the flag set_requires_gradient_sync writes (as
    # accelerate's no_sync does for FSDP2), so that an outer accumulation step is respected
    for m in modules:
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)  # type: ignore[operator]
        if group is not None and not group.reduce_grads:
            return False
    return True


def grad_sync_on(model: nn.Module) -> bool:
    """Whether a backward now would reduce gradients across processes (False inside an outer
    ``no_sync`` / ``set_requires_gradient_sync(False)`` / off DeepSpeed's accumulation boundary, and
    for a model in no wrapper).

    Always True under DeepSpeed ZeRO-3: it reduce-scatters the gradients of every backward, on the
    accumulation boundary or off it (it keeps no full gradients between backwards; the boundary only
    decides the optimizer step), and [`CoalescedBackward`][st_cached_losses.engine.wrappers.CoalescedBackward] needs the engine's synchronised last
    replay to flush its one reduction of the step."""
    model = bare(model)
    if is_ddp(model):
        return bool(getattr(model, "require_backward_grad_sync", True))
    if is_fsdp1(model):
        # FSDP1 has no public getter either; no_sync() sets this flag
        return bool(getattr(model, "_sync_gradients", True))
    if is_zero3(model):
        return True
    if is_deepspeed(model):
        return bool(model.is_gradient_accumulation_boundary())  # type: ignore[operator]
    modules = fsdp2_modules(model)
    return bool(modules) and _fsdp2_sync_on(modules)


@contextlib.contextmanager
def unsynced(model: nn.Module) -> Iterator[None]:
    """Gradient reduction off for forward *and* backward inside: DDP's and FSDP1's ``no_sync()``,
    FSDP2's ``set_requires_gradient_sync(False)``, DeepSpeed's accumulation boundary off; restored on
    exit (an outer setting that had it off already stays off). Nothing for a model in no wrapper."""
    model = bare(model)
    if is_ddp(model) or is_fsdp1(model):
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    if is_deepspeed(model):
        before = bool(model.is_gradient_accumulation_boundary())  # type: ignore[operator]
        model.set_gradient_accumulation_boundary(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_gradient_accumulation_boundary(before)  # type: ignore[operator]
        return
    modules = fsdp2_modules(model)
    if not modules or not _fsdp2_sync_on(modules):
        yield
        return
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def accumulate_locally(outs: Sequence[Tensor], grads: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """Back-propagate ``outs`` into the parameters' ``.grad`` without firing their AccumulateGrad hooks.

    DDP with ``static_graph=True`` counts, in its first iteration, every gradient hook of every backward
    until the step's all-reduce (``no_sync`` does not stop the count), and from then on waits for that
    many hooks per parameter before it reduces: replays seen by the reducer would make every later
    step skip its all-reduce. ``torch.autograd.grad`` does not run the hooks, so the reducer sees only
    the final, synchronised replay; the sum below is what ``no_sync`` would have accumulated."""
    computed = torch.autograd.grad(list(outs), list(params), list(grads), allow_unused=True)
    with torch.no_grad():
        for p, g in zip(params, computed):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


@dataclass
class LocalBackward:
    """Forwards and backwards hidden from a DDP ``static_graph`` reducer (see [`accumulate_locally`][st_cached_losses.engine.wrappers.accumulate_locally]):
    the wrapped module is called directly and gradients are summed into ``.grad`` by hand.

    DeepSpeed ZeRO 1/2 goes the same way: its gradient hooks refuse a parameter whose gradient arrives
    twice in one step ("Gradient computed twice for this partition"), so only the final replay (plus
    the zero terms of [`synced_backward`][st_cached_losses.engine.wrappers.LocalBackward.synced_backward]) reaches them, with the sum of every replay in ``.grad``.
    ZeRO-3 cannot (its parameters are partitioned, [`is_zero3`][st_cached_losses.engine.wrappers.is_zero3]: a full-size ``.grad`` cannot be set
    on them by hand): [`of`][st_cached_losses.engine.wrappers.LocalBackward.of] returns a [`CoalescedBackward`][st_cached_losses.engine.wrappers.CoalescedBackward] for it."""

    module: nn.Module
    params: list[Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> LocalBackward | None:
        # the module inside the wrapper is called directly: under torch.compile, uncompiled
        model = bare(model)
        if not (is_static_graph(model) or is_deepspeed(model)):
            return None
        inner = model.module
        assert isinstance(inner, nn.Module)
        params: list[Tensor] = [p for p in inner.parameters() if p.requires_grad]
        if is_zero3(model):
            if not hasattr(model, "coalesce_grad_reduction"):
                raise NotImplementedError(
                    "cached losses under DeepSpeed ZeRO-3 need DeepSpeedEngine.coalesce_grad_reduction() "
                    "(DeepSpeed 0.19.8 has it; the installed DeepSpeed has not): upgrade DeepSpeed, or use "
                    "ZeRO stage 1 or 2."
                )
            return CoalescedBackward(inner, params, model)
        return cls(inner, params)

    def backward(self, outs: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        accumulate_locally(outs, grads, self.params)

    def synced_backward(self, out: Tensor, grad: Tensor) -> None:
        """The final replay's backward, which the reducer sees: it must reach every parameter that has a
        gradient in this step, or a parameter reached only by earlier replays (a Router's other route)
        would count as unused in the first static-graph iteration and keep its local gradient. A zero
        term on each such parameter makes its hook fire exactly once (AccumulateGrad runs once per
        backward, whatever number of paths lead to it)."""
        touched = [p for p in self.params if p.grad is not None]
        if not touched:
            torch.autograd.backward(out, grad)
            return
        zero = torch.stack([p.reshape(-1)[0].float() for p in touched]).sum() * 0.0
        torch.autograd.backward([out, zero], [grad, torch.ones_like(zero)])


@dataclass
class CoalescedBackward(LocalBackward):
    """The replays under DeepSpeed ZeRO-3, one gradient reduction per step: every replay's backward runs
    inside the engine's public ``coalesce_grad_reduction()`` (in DeepSpeed 0.19.8), opened at the first
    replay and closed after the final, synchronised one ([`synced_backward`][st_cached_losses.engine.wrappers.CoalescedBackward.synced_backward]).

    Inside it ZeRO-3 gathers each module's parameters for its forward and backward as always, and its
    gradient hooks still fire, but they leave the gradient in the parameter's ``.grad`` (full size;
    autograd adds each replay's into it, the parameter being gathered whenever a replay's backward
    reaches it) instead of reduce-scattering it; on exit the engine reduces every parameter with a
    gradient once, bucketed as in a plain backward, into its gradient partitions, as after one
    backward. So a parameter reached only by earlier replays is reduced too, with no zero terms.

    Why not the alternatives: ``.grad`` cannot be set by hand (ZeRO 1/2's way, [`accumulate_locally`][st_cached_losses.engine.wrappers.accumulate_locally])
    on a partitioned parameter; DeepSpeed's accumulation boundary changes nothing under ZeRO-3, which
    reduce-scatters every backward; and a plain backward per replay fails (ZeRO-3's bucket gets a
    parameter's gradient twice before it is reduced: ``assert len(set(p.ds_id ...)) == len(...)`` in
    stage3.py), and would, reduced, replace rather than add the earlier replays' partitions within one
    micro-step (ZeRO-3 adds from the micro-step after, counted at the engine's forward).

    The cost: between the first replay and the flush each process holds the full-size gradient of every
    parameter the replays reached (as DDP would), not only its partition.

    The contract with the engine: gradients of [`backward`][st_cached_losses.engine.wrappers.CoalescedBackward.backward] are reduced at the next
    [`synced_backward`][st_cached_losses.engine.wrappers.CoalescedBackward.synced_backward], which the engine always calls last ([`grad_sync_on`][st_cached_losses.engine.wrappers.grad_sync_on] is True under
    ZeRO-3). ``engine.step()`` refuses to run while the reduction is still open."""

    engine: nn.Module
    _open: contextlib.ExitStack | None = field(default=None, repr=False)

    def _coalesce(self) -> None:
        if self._open is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.engine.coalesce_grad_reduction())  # type: ignore[operator]
            self._open = stack

    def backward(self, outs: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        self._coalesce()
        torch.autograd.backward(list(outs), list(grads))

    def synced_backward(self, out: Tensor, grad: Tensor) -> None:
        self._coalesce()
        try:
            torch.autograd.backward(out, grad)
        finally:
            stack, self._open = self._open, None
            assert stack is not None
            stack.close()  # the step's one reduction of every gradient accumulated above


def skip_forward_buffer_sync(model: nn.Module) -> None:
    """No DDP buffer broadcast at the next forwards (nothing for other wrappers).

    DDP broadcasts buffers at a forward that follows a synchronised one; ranks run different numbers of
    mini-batch forwards (unequal batches, token budgets), so such a collective would not line up across
    ranks and hang. Text encoders' buffers are constants (position ids)."""
    model = bare(model)
    if is_ddp(model):
        model.require_forward_param_sync = False  # type: ignore[assignment]


# ---------------------------------------------------------------------- FSDP2: parameters kept unsharded


@dataclass
class _Settings:
    """An FSDP2 state's resharding settings as they were before the first step that holds it, and how
    many steps hold it now (a step is released after its replay; two losses' steps may overlap)."""

    state: Any  # torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState
    auto: bool | None
    groups: list[tuple[Any, Any, bool]]  # (param group, post_forward_mesh_info, reshard_after_backward)
    holders: int = 0


#: FSDP2 states whose parameters some step keeps unsharded, by ``id``
_HELD: dict[int, _Settings] = {}


@dataclass
class Unsharded:
    """FSDP2 modules' parameters kept unsharded for one step (the engine's knob, [`GradCache`][st_cached_losses.engine.gradcache.GradCache]).

    ``set_reshard_after_forward(False)`` and ``set_reshard_after_backward(False)`` (FSDP2's public
    setters) on every FSDP2 module of the model: each group's first forward of the step all-gathers its
    parameters, and no forward, replay or gradient reduce-scatter frees them; [`release`][st_cached_losses.engine.wrappers.Unsharded.release] puts the
    settings back and reshards (a local free, no collective). FSDP2 has setters but no getters: the
    settings are read from its state (as [`grad_sync_on`][st_cached_losses.engine.wrappers.grad_sync_on] reads ``set_requires_gradient_sync``'s flag)."""

    modules: list[FSDPModule]
    states: list[Any] = field(default_factory=list)
    released: bool = False

    @classmethod
    def hold(cls, model: nn.Module) -> Unsharded | None:
        """Keep ``model``'s FSDP2 parameters unsharded from their first forward until [`release`][st_cached_losses.engine.wrappers.Unsharded.release]; None
        for a model without FSDP2 modules."""
        modules = cast("list[FSDPModule]", fsdp2_modules(model))
        if not modules:
            return None
        held = cls(modules)
        for m in modules:
            state = m._get_fsdp_state()
            if any(s is state for s in held.states):
                continue  # fully_shard([a, b]): one state for several modules
            held.states.append(state)
            settings = _HELD.get(id(state))
            if settings is None:
                groups = [
                    (g, g.post_forward_mesh_info, g.reshard_after_backward) for g in state._fsdp_param_groups
                ]
                settings = _HELD[id(state)] = _Settings(state, state._auto_reshard_after_forward, groups)
            settings.holders += 1
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        return held

    def release(self) -> None:
        """The settings back (when no other step holds them) and the parameters resharded; once."""
        if self.released:
            return
        self.released = True
        freed = []
        for state in self.states:
            settings = _HELD[id(state)]
            settings.holders -= 1
            if settings.holders > 0:
                continue
            del _HELD[id(state)]
            state._auto_reshard_after_forward = settings.auto
            for group, mesh_info, after_backward in settings.groups:
                # a root first run inside the step: what FSDP2's lazy init does to a root left at its default
                root_default = settings.auto and state._is_root
                group.post_forward_mesh_info = None if root_default else mesh_info
                group.reshard_after_backward = after_backward
            freed.append(state)
        for m in self.modules:
            if any(s is m._get_fsdp_state() for s in freed):
                m.reshard()
