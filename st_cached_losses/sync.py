"""Gradient synchronisation of the wrappers a model may be trained in (DDP, FSDP1, FSDP2, DeepSpeed):
recognising them, turning their gradient reduction off for the replays but the last, and, where the
wrapper counts gradient hooks (DDP's static graph, DeepSpeed), back-propagating replays without those
hooks. No loss math and no mini-batch planning here: the engine (``gradcache``) decides when."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "LocalBackward",
    "accumulate_locally",
    "grad_sync_on",
    "is_ddp",
    "is_deepspeed",
    "is_fsdp1",
    "is_sharded",
    "is_static_graph",
    "is_wrapped",
    "unsynced",
]


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def is_static_graph(model: nn.Module) -> bool:
    return is_ddp(model) and bool(getattr(model, "static_graph", False))


def is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` sharded by FSDP2's ``fully_shard`` (the root first when it is one)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_deepspeed(model: nn.Module) -> bool:
    # by name: deepspeed is not a dependency, and importing it to check would be slow
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


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
    for a model in no wrapper)."""
    if is_ddp(model):
        return bool(getattr(model, "require_backward_grad_sync", True))
    if is_fsdp1(model):
        # FSDP1 has no public getter either; no_sync() sets this flag
        return bool(getattr(model, "_sync_gradients", True))
    if is_deepspeed(model):
        return bool(model.is_gradient_accumulation_boundary())  # type: ignore[operator]
    modules = fsdp2_modules(model)
    return bool(modules) and _fsdp2_sync_on(modules)


@contextlib.contextmanager
def unsynced(model: nn.Module) -> Iterator[None]:
    """Gradient reduction off for forward *and* backward inside: DDP's and FSDP1's ``no_sync()``,
    FSDP2's ``set_requires_gradient_sync(False)``, DeepSpeed's accumulation boundary off; restored on
    exit (an outer setting that had it off already stays off). Nothing for a model in no wrapper."""
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
    the final, synchronised replay; the sum below is what ``no_sync`` would have accumulated.
    """
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
    """Forwards and backwards hidden from a DDP ``static_graph`` reducer (see :func:`accumulate_locally`):
    the wrapped module is called directly and gradients are summed into ``.grad`` by hand.

    DeepSpeed ZeRO 1/2 goes the same way: its gradient hooks refuse a parameter whose gradient arrives
    twice in one step ("Gradient computed twice for this partition"), so only the final replay (plus
    the zero terms of :meth:`synced_backward`) reaches them, with the sum of every replay in ``.grad``.
    """

    module: nn.Module
    params: list[Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> LocalBackward | None:
        if not (is_static_graph(model) or is_deepspeed(model)):
            return None
        inner = model.module
        assert isinstance(inner, nn.Module)
        return cls(inner, [p for p in inner.parameters() if p.requires_grad])

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
