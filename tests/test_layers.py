"""The layering: the pure-torch layers import nothing above them, and no module imports another's
private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "st_cached_losses"
HEAVY = ("sentence_transformers", "transformers", "accelerate", "datasets")


@pytest.mark.parametrize(
    "module",
    ["st_cached_losses.functional", "st_cached_losses.functional.parallel", "st_cached_losses.distributed"],
)
def test_pure_torch_layers_import_only_torch(module):
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} also loaded: {out.stdout.strip()}"


def test_top_level_names_load_lazily():
    code = (
        "import sys, st_cached_losses as s; assert 'sentence_transformers' not in sys.modules; "
        "assert s.CachedMNRLoss.__name__ == 'CachedMNRLoss' and s.build_loss and s.LossStateCallback; "
        "assert 'functional' in dir(s)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_private_names_of_another():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for module, names in _imports(path):
            if module.startswith("st_cached_losses"):
                offenders += [f"{_module_name(path)}: {module}.{n}" for n in names if n.startswith("_")]
    assert not offenders, offenders


def test_functional_and_distributed_import_nothing_above_them():
    allowed = ("st_cached_losses.functional", "st_cached_losses.distributed")
    for path in [*(PACKAGE / "functional").rglob("*.py"), PACKAGE / "distributed.py"]:
        for module, _ in _imports(path):
            top = module.split(".")[0]
            if top == "st_cached_losses":
                assert module.startswith(allowed), f"{_module_name(path)} imports {module}"
            else:
                # the standard library and torch only
                assert top == "torch" or top in sys.stdlib_module_names, (
                    f"{_module_name(path)} imports {module}"
                )
        if path.name == "distributed.py":
            assert not any(m.startswith("st_cached_losses") for m, _ in _imports(path)), "collectives only"
