"""docs/troubleshooting.md quotes the package's own error and warning messages: each ```text block there is
found (``{…}`` standing for a filled-in value) in a message the package raises or warns, read from the source
with ``ast`` (string constants, f-strings and their concatenations). A reworded message fails here, so the
page is updated with it."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
PLACEHOLDER = "{…}"


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


@functools.cache
def _messages() -> list[str]:
    """The first argument of every call in the package whose text can be read statically."""
    out = []
    for path in sorted((ROOT / "st_cached_losses").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args:
                text = _text(node.args[0])
                if text:
                    out.append(text)
    return out


QUOTES = re.findall(r"^```text\n(.*?)\n```", PAGE.read_text(), re.S | re.M)


def test_the_page_quotes_messages():
    assert len(QUOTES) >= 15


@pytest.mark.parametrize("quote", QUOTES, ids=[q[:40] for q in QUOTES])
def test_each_quote_is_a_message_of_the_package(quote):
    pattern = re.compile(".*?".join(re.escape(part) for part in quote.split(PLACEHOLDER)), re.S)
    assert any(pattern.search(message) for message in _messages()), quote
