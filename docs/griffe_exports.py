"""A griffe extension for the API reference (``extensions:`` in mkdocs.yml).

The reference is built by inspecting the imported package (``force_inspection``), and inspection lists every
name a module holds, its imports included (``Any``, ``cast``, constants it re-uses from other modules, its
logger). A module that declares ``__all__`` documents those names only (and its submodules): the others are
dropped, as static analysis of ``__all__`` would. Modules without ``__all__`` keep every name the ``!^_``
filter lets through; their pages list the members to show.
"""

from __future__ import annotations

from typing import Any

import griffe


class ExportsOnly(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        if mod.exports is None or not mod.path.startswith("st_cached_losses"):
            return
        exported = {
            export if isinstance(export, str) else getattr(export, "name", str(export))
            for export in mod.exports
        }
        for name, member in list(mod.members.items()):
            # an alias is not resolved here (its target may not be loaded): imported names go unless exported
            if name not in exported and (member.is_alias or not member.is_module):
                mod.del_member(name)
