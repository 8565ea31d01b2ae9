"""The loss stage's one dtype rule: similarities, log-sum-exp statistics and gradients in fp32 whatever
the caller's autocast says (the autocast state is the caller's, for its encoder; the loss stage decides
its own), gradients returned in each input's dtype.

Under ``torch.autocast`` a matrix product of fp32 operands runs in bf16 / fp16: a logit tile would lose
its low bits (at scale 50 a near-converged batch's loss turns negative) and mixing such a tile into an
fp32 buffer fails outright. Every entry point of the loss stage, and the backward of its autograd
functions (autograd may run them inside the caller's autocast region), runs with autocast off."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

import torch
from torch import Tensor

__all__ = ["accumulation_dtype", "autocast_off", "fp32_loss_stage"]

#: device types autocast may be enabled for (an unknown one is skipped)
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")

F = TypeVar("F", bound=Callable[..., object])


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """The dtype the loss stage computes ``x`` in: fp32, or fp64 for fp64 inputs (for gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError, ValueError):  # a torch build without this device type
        return False


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast disabled for every device type it is enabled for, restored on exit."""
    with contextlib.ExitStack() as stack:
        for device_type in _DEVICE_TYPES:
            if _enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def fp32_loss_stage(fn: F) -> F:
    """Run ``fn`` with autocast off (see the module's docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        with autocast_off():
            return fn(*args, **kwargs)

    return cast(F, wrapper)
