"""Deterministic peak-memory measurement: live tensor bytes tracked by a dispatch mode.

RSS is noisy and allocator caches hide frees; this counts the bytes of tensor storages that are
alive, as the dispatcher creates them and Python frees them. On CUDA, prefer
``torch.cuda.max_memory_allocated`` (also reported here when a CUDA device is in use).
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the ``with`` block and alive at once.

    Storages that existed before entering are not counted (the inputs); outputs that are still
    alive at the end are (e.g. returned gradients).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak_bytes = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: not a new allocation
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
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
