"""What the losses' constructors share besides the base class: their arguments handed on to the base
constructor by name, and the docstring entries of the arguments they have in common (one wording; the
engine settings' from their specs' help, as the configuration's fields and CLI help)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

from st_cached_losses.losses.settings import SPECS

__all__ = ["DOCS", "arguments", "shared_docs"]

F = TypeVar("F", bound=Callable[..., Any])


def arguments(local_vars: dict[str, Any], **changed: Any) -> dict[str, Any]:
    """A constructor's arguments, from its ``locals()`` taken before any other local is set, for the base
    constructor (``super().__init__(**arguments(locals()))``); ``changed``: values it passes instead."""
    return {k: v for k, v in local_vars.items() if k not in ("self", "__class__")} | changed


def _spec_entries(*names: str) -> str:
    return "\n".join(
        textwrap.fill(
            f"{name}: {SPECS[name].help[:1].lower()}{SPECS[name].help[1:]}", 100, subsequent_indent="    "
        )
        for name in names
    )


_INPUTS = """\
Inputs:
    +-------------------------------------------------+--------+
    | Texts                                           | Labels |
    +=================================================+========+
    | (anchor, positive) pairs                        | none   |
    +-------------------------------------------------+--------+
    | (anchor, positive, negative) triplets           | none   |
    +-------------------------------------------------+--------+
    | (anchor, positive, negative_1, ..., negative_n) | none   |
    +-------------------------------------------------+--------+"""

#: the shared entries, by the name a docstring's ``{doc:<name>}`` line gives
DOCS = {
    "similarity": """\
similarity_fct: ``sentence_transformers.util.cos_sim`` / ``"cosine"`` (default) or ``dot_score`` /
    ``"dot"`` (GEMM tiles); any other function ``f(a, b) -> (len(a), len(b))`` (e.g. ``euclidean_sim``)
    is scored exactly tile by tile through autograd (slower). The full matrix is never built.""",
    "mini_batches": _spec_entries("mini_batch_size", "mini_batch_num_tokens"),
    "directions": """\
``"query_to_doc"`` (required: every candidate column), ``"query_to_query"`` (the other anchors),
``"doc_to_query"`` (the positive against every anchor), ``"doc_to_doc"`` (the positive against every
other row's documents).""",
    "partition_mode": """\
partition_mode: ``"joint"`` (one softmax over every selected term; GTE with all four directions) or
    ``"per_direction"`` (one per direction, averaged; not with ``query_to_query`` / ``doc_to_doc``).""",
    "hardness": _spec_entries("show_progress_bar", "hardness_mode", "hardness_strength"),
    "mask_duplicates": _spec_entries("mask_duplicates"),
    "engine": _spec_entries(
        "sort_by_length",
        "reuse_last_graph",
        "keep_params_unsharded",
        "graph_memory_budget",
        "mini_batch_memory_budget",
    ),
    "inputs": """\
Requirements:
    1. (anchor, positive) pairs, optionally with hard-negative columns (anchor, positive, negative_1,
       ..., negative_n).
    2. A model whose inputs have a batch dimension (not StaticEmbedding).

"""
    + _INPUTS,
    "inputs_table": _INPUTS,
}


def shared_docs(fn: F) -> F:
    """Fill each ``{doc:<name>}`` line of ``fn``'s docstring with :data:`DOCS`' entry, and each
    ``{spec:<name> <name>...}`` line with those settings' help, at that line's indentation."""

    def fill(match: re.Match[str]) -> str:
        kind, names = match.group(2), match.group(3).split()
        return textwrap.indent(DOCS[names[0]] if kind == "doc" else _spec_entries(*names), match.group(1))

    fn.__doc__ = re.sub(r"(?m)^([ \t]*)\{(doc|spec):([\w ]+)\}$", fill, fn.__doc__ or "")
    return fn
