"""The loss stage's one dtype rule: similarities, log-sum-exp statistics and gradients in fp32 whatever
the caller's autocast says (the autocast state is the caller's, for its encoder; the loss stage decides
its own), gradients returned in each input's dtype; and the one exception it allows, the precision of the
GEMM products (``matmul_precision``, [`Products`][st_cached_losses.functional.precision.Products]).

Under ``torch.autocast`` a matrix product of fp32 operands runs in bf16 / fp16: a logit tile would lose
its low bits (at scale 50 a near-converged batch's loss turns negative) and mixing such a tile into an
fp32 buffer fails outright. Every entry point of the loss stage, and the backward of its autograd
functions (autograd may run them inside the caller's autocast region), runs with autocast off."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import torch
from torch import Tensor

__all__ = [
    "MATMUL_PRECISIONS",
    "MatmulPrecision",
    "Products",
    "accumulation_dtype",
    "autocast_off",
    "fp32_loss_stage",
    "global_matmul_precision",
]

#: ``torch.set_float32_matmul_precision``'s names: fp32 products, TF32 products, bf16 products
MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

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


# --------------------------------------------------------------------------- the products' precision

#: torch's per-backend names of the fp32 matmul precision (the API of torch >= 2.9) and torch's global names
_FROM_BACKEND = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def _backend(device_type: str) -> object | None:
    """torch's matmul backend flags of a device type (cuBLAS, oneDNN), where this torch has them."""
    if device_type == "cuda":
        return torch.backends.cuda.matmul
    mkldnn = getattr(torch.backends, "mkldnn", None)
    return getattr(mkldnn, "matmul", None) if device_type == "cpu" else None


def global_matmul_precision(device_type: str) -> str:
    """``torch.get_float32_matmul_precision()``; where the caller set torch's per-backend flags instead (torch
    then refuses to answer for all backends at once), the flag of ``device_type``'s backend, by the same names."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and the per-backend API were both used: ask the device's backend
        flag = getattr(_backend(device_type), "fp32_precision", "ieee")
        return _FROM_BACKEND.get(str(flag), "highest")


@contextlib.contextmanager
def _pinned(device_type: str, flag: str) -> Iterator[None]:
    """torch's fp32 GEMMs on ``device_type`` at ``flag`` ("ieee": fp32, "tf32") inside, restored on exit; nothing
    touched where they are already so (the default case), nor on a torch without per-backend flags (cuBLAS:
    its ``allow_tf32`` then)."""
    backend = _backend(device_type)
    if backend is not None and hasattr(backend, "fp32_precision"):
        old = backend.fp32_precision
        if old == flag:
            yield
            return
        backend.fp32_precision = flag
        try:
            yield
        finally:
            backend.fp32_precision = old
        return
    if device_type == "cuda":
        old_tf32 = torch.backends.cuda.matmul.allow_tf32
        want = flag == "tf32"
        if old_tf32 != want:
            torch.backends.cuda.matmul.allow_tf32 = want
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old_tf32
            return
    yield


@dataclass(frozen=True)
class Products:
    """How one call of the loss stage multiplies its GEMM-scored tiles (cosine / dot similarities): the
    precision ``matmul_precision`` resolved for the call's device and loss.

    * ``"highest"``: fp32 products (fp64 for fp64 inputs), torch's fp32 GEMMs held at full precision for the
      call whatever torch's global setting says: the exact path.
    * ``"high"``: TF32 products (CUDA), through the Triton kernels (``kernels``) or torch's GEMMs with TF32
      allowed for the call. A CPU has no TF32: there it runs as ``"highest"``.
    * ``"medium"``: bf16 products: each operand normalised and scaled once in fp32, then rounded to bf16
      (``rounds``), and each gradient product's probabilities rounded to bf16 too, every product summed in fp32:
      what bf16 tensor cores compute. The Triton kernels run it on CUDA; elsewhere (and as their fallback) torch
      multiplies the rounded values in fp32 GEMMs (TF32 on CUDA, exact for bf16 values).

    Whatever the products, maxima, log-sum-exps, sums of probabilities and every accumulated gradient are
    fp32. ``kernels``: the plain GEMM-scored terms may run the Triton kernels
    ([`flash`][st_cached_losses.functional.softmax.flash]); the other terms of such a call, and every pass whose
    kernels cannot run, use the torch tiles at the same precision."""

    precision: str = "highest"
    kernels: bool = False

    @property
    def rounds(self) -> bool:
        """Operands (and the gradient products' probabilities) are rounded to bf16."""
        return self.precision == "medium"

    def round(self, t: Tensor) -> Tensor:
        """``t`` (fp32) rounded to bf16 values, kept as fp32 (a new tensor)."""
        return t.to(torch.bfloat16).to(t.dtype)

    def pinned(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """torch's fp32 GEMMs on ``device`` at this precision for the duration of a pass: fp32 for
        ``"highest"`` (and bf16-rounded operands on a CPU), TF32 on CUDA for ``"high"`` and for bf16-rounded
        operands (exact there: a bf16 value has fewer mantissa bits than TF32)."""
        tf32 = device.type == "cuda" and self.precision in ("high", "medium")
        return _pinned(device.type, "tf32" if tf32 else "ieee")
