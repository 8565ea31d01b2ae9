"""Real text pairs found on any machine, for demos and benchmarks: the Python standard library.

Each pair is (a function's docstring summary, the function's source without its docstring): a
code-search task with queries and documents of very different, varied lengths. Deterministic for a
given Python version; no network.
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__", "ensurepip"}


def _summary(doc: str) -> str | None:
    first = doc.strip().split("\n\n")[0]
    text = " ".join(first.split())
    if len(text) < 20 or len(text) > 300:
        return None
    return text


def _pairs_in_file(path: Path) -> list[tuple[str, str]]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None:
            continue
        summary = _summary(doc)
        if summary is None:
            continue
        if len(node.body) < 2:  # the docstring alone
            continue
        start = node.body[1].lineno
        header = lines[node.lineno - 1].strip()
        code = "\n".join(line.strip() for line in lines[start - 1 : node.end_lineno] if line.strip())
        document = f"{header}\n{code}"
        if len(document) < 40:
            continue
        out.append((summary, document[:2000]))
    return out


def stdlib_pairs(limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(docstring summary, source) pairs from the standard library, shuffled with ``seed``, duplicates
    (same summary or same source) dropped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not (SKIP_DIRS & set(p.relative_to(root).parts)))
    seen_q: set[str] = set()
    seen_d: set[str] = set()
    pairs = []
    for path in files:
        for q, d in _pairs_in_file(path):
            if q in seen_q or d in seen_d:
                continue
            seen_q.add(q)
            seen_d.add(d)
            pairs.append((q, d))
    random.Random(seed).shuffle(pairs)
    return pairs[:limit] if limit is not None else pairs


def split_pairs(
    pairs: list[tuple[str, str]], n_eval: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(training pairs, held-out pairs)``: the first ``n_eval`` pairs are held out for evaluation, the
    rest are for training."""
    if n_eval >= len(pairs):
        raise ValueError(
            f"asked for {n_eval} held-out pairs but only {len(pairs)} were found (Python {sys.version})."
        )
    return pairs[n_eval:], pairs[:n_eval]
