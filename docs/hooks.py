"""mkdocs hooks (``hooks:`` in mkdocs.yml): what the site reads from the package and the repository at build time.

* ``<!-- settings-table -->`` in a page becomes the table of every field ``CachedLossTrainingArguments`` adds to
  sentence-transformers' training arguments: its type, default, the losses that take it (from the losses'
  settings, as the arguments' own check decides) and its help text (the settings' declarations). Nothing in
  it is typed into the docs.
* ``<!-- renamed-fields -->``: the loss settings whose field has another name (``bias`` is ``siglip_bias``).
* ``<!-- loss-names-table -->``: the names ``loss:`` accepts, each loss's class and the model it trains (the
  losses' registry, read through ``st_cached_losses/config/registry.py``).
* The repository's address is ``Repository`` under ``[project.urls]`` in ``pyproject.toml``, the one place it is
  written: it becomes the site's ``repo_url`` (the header's link) and replaces ``<!-- repository-url -->`` in
  every page (code blocks included); ``<!-- repository-placeholder-note -->`` says that it is a placeholder
  while it is one (``OWNER``).
* The plots and CSV files of ``benchmarks/results/`` are served under ``results/`` (the pages link
  ``results/<name>.png``): they are read from where the benchmarks write them, never copied into ``docs/``.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import re
import sys
import typing
import warnings
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _griffe_workaround() -> None:
    """``CachedLossTrainingArguments.__module__`` is its documented path, ``st_cached_losses.training_args``
    (what checkpoints pickle), but the ``__init__`` that ``dataclass`` generated keeps the defining module's:
    griffe's inspection then sees each as an alias of the other (``CyclicAliasError``). In this build process
    only, the ``__init__`` gets the class's module too."""
    from st_cached_losses.config.training_args import CachedLossTrainingArguments

    CachedLossTrainingArguments.__init__.__module__ = CachedLossTrainingArguments.__module__


def repository_url() -> str:
    """``Repository`` of ``[project.urls]`` in pyproject.toml (read as text: no TOML parser on Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.urls\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = section and re.search(r'^Repository\s*=\s*"([^"]+)"', section.group(1), re.M)
    if not found:
        raise ValueError('pyproject.toml: [project.urls] has no Repository = "https://..." line; add it')
    return found.group(1)


REPOSITORY_MARKER = "<!-- repository-url -->"
#: where a page says that the address is a placeholder, while it is one (``OWNER``): nothing once it is real
PLACEHOLDER_NOTE_MARKER = "<!-- repository-placeholder-note -->"


def placeholder_note(url: str) -> str:
    if "/OWNER/" not in url:
        return ""
    return " (`OWNER` is a placeholder: the repository's public address is not settled yet)"


def on_config(config):
    url = repository_url()
    config.repo_url = url
    config.repo_name = "/".join(url.rstrip("/").split("/")[-2:])
    return config


def on_startup(command: str, dirty: bool) -> None:
    _griffe_workaround()
    # preloading typing (mkdocs.yml) has griffe read typing.io / typing.re, which warn on Python 3.11
    warnings.filterwarnings("ignore", r"typing\.(io|re) is deprecated", DeprecationWarning)


def _type_name(annotation: typing.Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    if args:
        name = " or ".join(_type_name(a) for a in args)
    else:
        name = getattr(annotation, "__name__", str(annotation))
    return f"{name} or None" if optional and args else name


def _cell(text: str) -> str:
    """A table cell's code (inside backticks): HTML escaped, its pipes kept from splitting the row."""
    return html.escape(text).replace("|", "\\|").replace("\n", " ")


#: the characters of a help text that Markdown would read as markup (a regex's ``.*`` as emphasis)
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]|])")


#: a docstring's inline code, ``like this``
_INLINE_CODE = re.compile(r"``(.+?)``")


def _text_cell(text: str) -> str:
    """A table cell of plain text (a field's help), shown as written: Markdown's specials backslash-escaped
    (``*`` would start emphasis, ``_`` and ``[`` too), then HTML escaped; a docstring's double-backticked code
    becomes inline code."""
    parts = _INLINE_CODE.split(text)
    # split() alternates text and the code spans' contents
    cells = [
        f"<code>{html.escape(part)}</code>" if i % 2 else html.escape(_MARKDOWN_SPECIALS.sub(r"\\\1", part))
        for i, part in enumerate(parts)
    ]
    return "".join(cells).replace("\n", " ")


def settings_table() -> str:
    """Markdown table of the arguments' own fields, in their declaration order: two columns, so that the help
    texts get the page's width (five columns were cut at 1,400 px): the field with its type and default, then
    its help and the losses that take it. The ``loss`` field's help names every loss: its row points at the
    table of names above instead."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    from st_cached_losses.config.registry import LOSSES, field_takers
    from st_cached_losses.config.training_args import (
        FIELD_MEANINGS,
        FIELD_SETTINGS,
        CachedLossTrainingArguments,
    )

    inherited = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
    hints = typing.get_type_hints(CachedLossTrainingArguments)
    rows = ["| field | meaning |", "|---|---|"]
    for f in dataclasses.fields(CachedLossTrainingArguments):
        if f.name in inherited:
            continue
        setting = FIELD_SETTINGS.get(f.name)
        if f.name == "loss":
            takes = "all"
        elif setting is None:
            takes = (
                "all (sets no loss setting)" if f.name != "loss_options" else "all (settings without a field)"
            )
        else:
            names = field_takers(setting)  # the arguments' own rule, as --help and the errors list them
            takes = "all" if len(names) == len(LOSSES) else ", ".join(f"`{n}`" for n in names)
        default = "none" if f.default is None else f"`{f.default!r}`"
        if f.name == "loss":
            meaning = "The loss to train: a name of the table above (or a class name it lists)."
        else:
            meaning = _text_cell(FIELD_MEANINGS.get(f.name, f.metadata.get("help", "")))
        rows.append(
            f"| `{f.name}`<br>`{_cell(_type_name(hints[f.name]))}`, default {default} | "
            f"{meaning}<br>Losses: {takes} |"
        )
    # a wrapper the stylesheet sizes the columns by (md_in_html renders the table inside it)
    return '<div class="settings-table" markdown>\n\n' + "\n".join(rows) + "\n\n</div>"


def _st_class_names() -> dict[str, str]:
    """sentence-transformers' loss class names by their lower case (the registry keeps them lower-cased)."""
    import importlib

    out: dict[str, str] = {}
    for module in ("sentence_transformer", "sparse_encoder", "multi_vector_encoder", "cross_encoder"):
        losses = importlib.import_module(f"sentence_transformers.{module}.losses")
        out.update({name.lower(): name for name in dir(losses) if name.endswith("Loss")})
    return out


def loss_names_table() -> str:
    """The names ``loss:`` takes: ours, then the class (and the model it trains), then every other spelling:
    ours hyphenated and sentence-transformers' class names (any case is accepted; our class names too)."""
    from st_cached_losses.config.registry import BASE_LOSSES, LOSS_ALIASES, LOSSES, MODEL_KINDS, ST_LOSS_NAMES

    proper = _st_class_names()
    rows = ["| `loss:` | class (model it trains) | also accepted |", "|---|---|---|"]
    for name, cls in LOSSES.items():
        aliases = sorted(
            a for a, n in LOSS_ALIASES.items() if n == name and a != name and a != cls.__name__.lower()
        )
        aliases += sorted(proper.get(st, st) for st, ours in ST_LOSS_NAMES.items() if name in ours.values())
        base = f" with `{BASE_LOSSES[name].__name__}`" if name in BASE_LOSSES else ""
        rows.append(
            f"| `{name}` | `{cls.__name__}`{base} (`{MODEL_KINDS.get(name, '?')}`) | "
            f"{', '.join(f'`{a}`' for a in aliases) or '-'} |"
        )
    return "\n".join(rows)


def renamed_fields() -> str:
    """The loss settings whose arguments' field has another name, as a sentence's list: "`similarity_fct` is
    `similarity`, ...", read from the registry's ``FIELD_NAMES``."""
    from st_cached_losses.config.registry import FIELD_NAMES

    items = [f"`{setting}` is `{field}`" for setting, field in FIELD_NAMES.items()]
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


GENERATED = {
    "<!-- settings-table -->": settings_table,
    "<!-- loss-names-table -->": loss_names_table,
    "<!-- renamed-fields -->": renamed_fields,
}
TYPE_ALIASES = re.compile(r"<!-- type-aliases: ([\w. ]+) -->")


def type_aliases(paths: str) -> str:
    """A heading (anchored at the alias's path) and the definition, as Python prints it, of each type alias
    ``module.Name`` in ``paths``: griffe's inspection cannot render a ``typing`` alias as an object."""
    import importlib

    out = []
    for path in paths.split():
        module, name = path.rsplit(".", 1)
        value = getattr(importlib.import_module(module), name)
        text = repr(value).replace("typing.", "").replace("torch.Tensor", "Tensor")
        out.append(
            f"### `{name}` {{ #{path} }}\n\nType alias in `{module}`:\n\n```python\n{name} = {text}\n```\n"
        )
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = markdown.replace(PLACEHOLDER_NOTE_MARKER, placeholder_note(repository_url()))
    markdown = markdown.replace(REPOSITORY_MARKER, repository_url())
    for marker, build in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, build())
    return TYPE_ALIASES.sub(lambda match: type_aliases(match.group(1)), markdown)


def on_files(files: Files, config) -> Files:
    """Serve benchmarks/results' plots and data as ``results/...`` (their Markdown tables are included into
    the benchmarks page by pymdownx.snippets instead)."""
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".png", ".csv", ".json"):
            files.append(
                File(
                    f"results/{path.relative_to(RESULTS).as_posix()}",
                    src_dir=str(RESULTS.parent),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def _public_names() -> dict[str, list[str]]:
    """Module -> the names its ``__all__`` exports, for every module of the package but the demo's entry point."""
    import importlib
    import pkgutil

    import st_cached_losses

    out = {"st_cached_losses": [n for n in st_cached_losses.__all__ if not n.startswith("_")]}
    for info in pkgutil.walk_packages(st_cached_losses.__path__, "st_cached_losses."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        out[info.name] = list(getattr(module, "__all__", []))
    return out


def on_post_build(config) -> None:
    """Every name a module of the package exports appears in the API reference (as an object heading of its
    own, under the path where it is documented): a new public name without a place in ``docs/api/`` fails the
    strict build."""
    log = logging.getLogger("mkdocs.hooks.api_coverage")
    ids: set[str] = set()
    for page in Path(config["site_dir"], "api").rglob("*.html"):
        ids.update(re.findall(r'id="(st_cached_losses[\w.]*)"', page.read_text()))
    documented = {identifier.rsplit(".", 1)[-1] for identifier in ids} | {i for i in ids}
    for module, names in _public_names().items():
        for name in names:
            if name not in documented and f"{module}.{name}" not in documented:
                log.warning(
                    "API reference: %s.%s (in its __all__) appears on no page of docs/api/", module, name
                )
