"""Deterministic peak-memory measurement: live tensor bytes tracked by a dispatch mode.

RSS is noisy and allocator caches hide frees; this counts the bytes of tensor storages that are
alive, as the dispatcher creates them and Python frees them, on any device. On CUDA the caching
allocator's own count, ``torch.cuda.max_memory_allocated``, is reported too (``cuda_peak_bytes``).

Test and benchmark tooling (it relies on torch's private dispatch API), so it lives under ``tests/``, out of
the wheel.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _storages(t: torch.Tensor) -> list[Any]:
    """The storages holding ``t``'s data: its own, or a sparse tensor's index and value tensors'."""
    if t.layout == torch.strided:
        return [t.untyped_storage()]
    if t.layout in _COMPRESSED:
        compressed = (
            t.crow_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) else t.ccol_indices()
        )
        plain = t.col_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) else t.row_indices()
        return [x.untyped_storage() for x in (compressed, plain, t.values())]
    if t.layout == torch.sparse_coo:
        return [t._indices().untyped_storage(), t._values().untyped_storage()]
    return []


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the ``with`` block and alive at once.

    Storages that existed before entering are not counted (the inputs); outputs that are still
    alive at the end are (e.g. returned gradients).

    ``device``: a CUDA device (or ``None``: the current one, if CUDA is already initialised) also gets
    ``cuda_peak_bytes``, the allocator's peak inside the block above what was allocated on entry
    (``torch.cuda.max_memory_allocated``; its peak statistics are reset on entry). It includes what the
    dispatcher does not see (library workspaces, allocator rounding to 512 bytes); warm up first. It
    stays ``None`` on CPU.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak_bytes = 0
        self.cuda_peak_bytes: int | None = None
        self._seen: set[int] = set()
        self._cuda: torch.device | None = None
        if device is None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._cuda = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if dev.type == "cuda":
                self._cuda = dev
        self._cuda_base = 0

    def __enter__(self) -> PeakMemory:
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            torch.cuda.reset_peak_memory_stats(self._cuda)
            self._cuda_base = torch.cuda.memory_allocated(self._cuda)
        super().__enter__()
        return self

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: not a new allocation
        inputs = {
            storage.data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
            for storage in _storages(t)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            for storage in _storages(t):
                key = storage.data_ptr()
                if key in self._seen or key in inputs or storage.nbytes() == 0:
                    continue
                self._seen.add(key)
                nbytes = storage.nbytes()
                self.live += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live)
                weakref.finalize(storage, self._release, key, nbytes)
        return out

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self._cuda) - self._cuda_base
