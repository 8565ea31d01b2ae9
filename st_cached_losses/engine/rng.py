"""Random state snapshots for the replay: what a mini-batch keeps so that its second forward draws the
same dropout masks as its first, on every device type the process uses.

The CPU generator is always kept. Of the accelerators (CUDA, Apple's MPS, Intel's XPU and whatever
``torch.accelerator`` names as the current one) each one that is available is kept, CUDA and XPU only
once initialised: reading a device's state must not initialise it (a CPU-only step would otherwise
create a CUDA context), and a device that was never initialised has drawn no mask yet. Where a module
has one generator per device (``get_rng_state_all``), every device's is kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["RandState", "device_rng_modules"]

#: the accelerators whose random state a replay restores, besides torch.accelerator's current one
ACCELERATORS = ("cuda", "mps", "xpu")


def device_rng_modules() -> dict[str, ModuleType]:
    """The device modules (``torch.cuda``, ``torch.mps``, ``torch.xpu``, ...) whose random state a
    forward may draw from now: available, and initialised where the module can tell."""
    names = list(ACCELERATORS)
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is not None and current.type not in names:
        names.append(current.type)
    out = {}
    for name in names:
        try:
            module = torch.get_device_module(name)
        except (RuntimeError, AttributeError):  # a backend this build of torch does not have
            continue
        available = getattr(module, "is_available", None)
        if available is None or not available():
            continue
        initialised = getattr(module, "is_initialized", None)
        if initialised is not None and not initialised():
            continue
        if not hasattr(module, "get_rng_state") or not hasattr(module, "set_rng_state"):
            continue
        out[name] = module
    return out


def _get(module: ModuleType) -> Tensor | list[Tensor]:
    """One device type's state: every device's where the module has one generator per device."""
    if hasattr(module, "get_rng_state_all") and hasattr(module, "set_rng_state_all"):
        return list(module.get_rng_state_all())
    return module.get_rng_state()


def _set(module: ModuleType, state: Tensor | list[Tensor]) -> None:
    if isinstance(state, list):
        module.set_rng_state_all(state)
    else:
        module.set_rng_state(state)


class RandState:
    """The random state of the CPU and of every available (and initialised) accelerator, replayable.

    ``RandState()`` snapshots now; [`replay`][st_cached_losses.engine.rng.RandState.replay] runs a block from the snapshot and afterwards puts
    back the state it found, so a replay neither reuses nor disturbs the training loop's random stream.
    ``RandState().replay()`` is therefore a fork of every device type's random state (a forward that
    must not shift the step's dropout masks, such as a measuring probe)."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.devices = {name: _get(module) for name, module in device_rng_modules().items()}

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from the snapshot's random state; restore the current state afterwards."""
        modules = {name: torch.get_device_module(name) for name in self.devices}
        before_cpu = torch.get_rng_state()
        before = {name: _get(module) for name, module in modules.items()}
        torch.set_rng_state(self.cpu)
        for name, module in modules.items():
            _set(module, self.devices[name])
        try:
            yield
        finally:
            torch.set_rng_state(before_cpu)
            for name, module in modules.items():
                _set(module, before[name])
