"""The modules' paths before ``functional/`` had rooms, and where each module lives now: ``import
st_cached_losses.functional.own`` and ``from st_cached_losses.functional.sigmoid_options import SigmoidOptions``
keep working, and give the module at its new home (the same module object: a monkeypatch or an ``isinstance``
check through either path sees one module). The package's face installs [`OldPaths`][st_cached_losses.functional.old_paths.OldPaths]
on ``sys.meta_path``, after every other finder, so it never hides a module that exists. New code imports the
new homes; ``functional.sigmoid`` and ``functional.distill`` are packages now, re-exporting what the modules of
those names exported."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "OldPaths", "install"]

PREFIX = "st_cached_losses.functional."

#: old module (under ``st_cached_losses.functional``) -> its new home (under the same)
MOVED = {
    "_kernels": "kernels.tiles",
    "triton_kernels": "kernels.triton_kernels",
    "autograd": "softmax.autograd",
    "binding": "softmax.binding",
    "flash": "softmax.flash",
    "infonce": "softmax.loss",
    "local": "softmax.local",
    "options": "softmax.options",
    "own": "softmax.own",
    "parallel": "softmax.parallel",
    "positives": "softmax.positives",
    "ring": "softmax.ring",
    "terms": "softmax.terms",
    "sigmoid_blocks": "sigmoid.blocks",
    "sigmoid_drivers": "sigmoid.drivers",
    "sigmoid_options": "sigmoid.options",
    "embed_distill": "distill.embed",
    "listwise": "distill.listwise",
    "multi_vector": "representations.multi_vector",
    "sparse": "representations.sparse",
    "flops": "representations.flops",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new home (imported there first, as any import would)."""

    def __init__(self, home: str) -> None:
        self.home = home
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.home)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module the old path's spec: it keeps its own (its name, its file)
        module.__spec__ = self.spec


class OldPaths(importlib.abc.MetaPathFinder):
    """The finder of the old paths in [`MOVED`][st_cached_losses.functional.old_paths.MOVED]."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        home = MOVED.get(fullname[len(PREFIX) :]) if fullname.startswith(PREFIX) else None
        if home is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(PREFIX + home))


def install() -> None:
    """Puts [`OldPaths`][st_cached_losses.functional.old_paths.OldPaths] last on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
