"""A griffe extension for the API reference (``extensions:`` in mkdocs.yml).

The reference is built by inspecting the imported package (``force_inspection``), and inspection lists every
name a module holds, its imports included (``Any``, ``cast``, constants it re-uses from other modules, its
logger). A module that declares ``__all__`` documents those names only (and its submodules): the others are
dropped, as static analysis of ``__all__`` would. Modules without ``__all__`` keep every name the ``!^_``
filter lets through; their pages list the members to show.

Inspection also gives a constant or a class attribute the docstring of its value's type: ``str``'s "Create a
new string object from the given object..." under a class name, ``dict``'s under a table, ``int``'s under a
size. Such an attribute gets its own words instead, where the source has them: the ``#:`` comment above its
assignment (as Sphinx reads it), or a dataclass field's ``help``; otherwise no docstring (its name and value
are shown). ``tests/docs/test_site.py`` fails on a built-in docstring in the reference.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
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


def _same_text(a: Any, b: Any) -> bool:
    """Whether two docstrings read the same (a type's ``__doc__`` may also be a descriptor, or None)."""
    return isinstance(a, str) and isinstance(b, str) and " ".join(a.split()) == " ".join(b.split())


@functools.cache
def _comments(owner: Any) -> dict[str, str]:
    """``{name: text}`` of the ``#:`` comments right above the assignments in ``owner``'s body (a class or a
    module), as Sphinx's autodoc reads attribute documentation."""
    try:
        lines, _ = inspect.getsourcelines(owner)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    body = tree.body
    if inspect.isclass(owner) and body and isinstance(body[0], ast.ClassDef):
        body = body[0].body
    text = source.splitlines()
    out: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            continue
        comment: list[str] = []
        row = node.lineno - 2  # the line above, 0-based
        while row >= 0 and text[row].strip().startswith("#:"):
            comment.insert(0, text[row].strip()[2:].strip())
            row -= 1
        if comment:
            out.update(dict.fromkeys(names, " ".join(comment)))
    return out


def _field_help(owner: Any, name: str) -> str | None:
    """A dataclass field's ``help`` (the arguments classes' fields: what ``--help`` prints)."""
    if not (inspect.isclass(owner) and dataclasses.is_dataclass(owner)):
        return None
    field = owner.__dataclass_fields__.get(name)
    help_text = field.metadata.get("help") if field is not None else None
    return help_text if isinstance(help_text, str) and help_text.strip() else None


class AttributeDocs(griffe.Extension):
    """An attribute documented by the docstring of its value's type gets its own words, or none."""

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, **kwargs: Any) -> None:
        if not isinstance(node, griffe.ObjectNode) or node.parent is None:
            return  # found by static analysis: its docstring is its own
        value, owner = node.obj, node.parent.obj
        inherited = attr.docstring is not None and _same_text(
            attr.docstring.value, getattr(type(value), "__doc__", None)
        )
        if attr.docstring is not None and not inherited:
            return
        own = _comments(owner).get(attr.name) or _field_help(owner, attr.name)
        attr.docstring = griffe.Docstring(own, parent=attr) if own else None


def _setting_meaning(settings_class: Any, name: str) -> str:
    """A setting's meaning as its declaration says it: a settings field's ``doc``, or a view's docstring."""
    found = settings_class.__dataclass_fields__.get(name)
    if found is not None and found.metadata.get("doc"):
        return " ".join(str(found.metadata["doc"]).split())
    view = settings_class.views().get(name)
    return " ".join((getattr(view, "__doc__", None) or "").split())


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table(loss_class: Any) -> str:
    """The Markdown table of a loss's settings: every argument its constructor takes but the model, with its
    default and its declaration's meaning."""
    rows = [
        "**Settings.** Each is also an attribute of the loss: read it, or assign it to replace the settings "
        "(checked as a whole).",
        "",
        "| setting | default | meaning |",
        "|---|---|---|",
    ]
    for param in list(inspect.signature(loss_class).parameters.values())[1:]:
        if param.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        default = getattr(param.default, "__name__", None) or repr(param.default)
        meaning = _setting_meaning(loss_class.settings_class, param.name)
        rows.append(f"| `{param.name}` | `{_markdown_cell(default)}` | {_markdown_cell(meaning)} |")
    return "\n".join(rows)


class LossSettingsTable(griffe.Extension):
    """A loss's settings are attributes of the loss (``SettingAttribute``s, one per setting): listed one by
    one they would be as many entries saying "the setting x". They are dropped, and the loss's docstring ends
    with one table of its settings instead. Its ``citations`` (BibTeX strings) are shown by name and meaning,
    without their raw text."""

    def on_class_members(self, *, node: Any, cls: griffe.Class, **kwargs: Any) -> None:
        if not isinstance(node, griffe.ObjectNode):
            return
        runtime = node.obj
        settings_class = getattr(runtime, "settings_class", None)
        if settings_class is None or not hasattr(settings_class, "views"):
            return
        for name in list(cls.members):
            if type(inspect.getattr_static(runtime, name, None)).__name__ == "SettingAttribute":
                cls.del_member(name)
        citations = cls.members.get("citations")
        if citations is not None and not citations.is_alias:
            citations.value = None
        if "settings_class" not in vars(runtime) or "__init__" not in vars(runtime):
            return  # a class that declares no loss of its own (the template, a base)
        table = settings_table(runtime)
        if cls.docstring is None:
            cls.docstring = griffe.Docstring(table, parent=cls)
        else:
            cls.docstring.value = cls.docstring.value.rstrip() + "\n\n" + table
