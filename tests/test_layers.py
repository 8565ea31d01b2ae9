"""The layering: functional < engine < losses < config < demo, each package importing only the layers at
or below its own; no import circle; the pure-torch layer loads torch alone; no module imports another's
private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "st_cached_losses"
HEAVY = ("sentence_transformers", "transformers", "accelerate", "datasets")


@pytest.mark.parametrize(
    "module",
    [
        "st_cached_losses.functional",
        "st_cached_losses.functional.softmax.parallel",
        "st_cached_losses.distributed",
    ],
)
def test_pure_torch_layers_import_only_torch(module):
    # also no module of ours above the functional layer (``st_cached_losses.distributed`` re-exports its collectives)
    code = (
        f"import sys, {module}; print(' '.join(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or "
        "(m.startswith('st_cached_losses.') and m.split('.')[1] not in ('functional', 'distributed'))))"
    )
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


def test_functional_imports_nothing_above_it():
    for path in (PACKAGE / "functional").rglob("*.py"):
        for module, _ in _imports(path):
            top = module.split(".")[0]
            if top == "st_cached_losses":
                assert module.startswith("st_cached_losses.functional"), (
                    f"{_module_name(path)} imports {module}"
                )
            else:
                # the standard library and torch only; Triton in the kernels' module alone, which only
                # flash imports, lazily (the layer imports with torch alone)
                triton_ok = top == "triton" and path.name == "triton_kernels.py"
                assert top == "torch" or triton_ok or top in sys.stdlib_module_names, (
                    f"{_module_name(path)} imports {module}"
                )
        if path.name == "distributed.py":
            assert not any(m.startswith("st_cached_losses") for m, _ in _imports(path)), "collectives only"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``TYPE_CHECKING`` imports included: ties of design)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imports(path):
            if not module.startswith("st_cached_losses"):
                continue
            # `from package import module` names a module; `from module import name` the module itself
            found = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            targets |= set(found) if found else {module}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # a package face importing its own modules counts too: one of them importing the face back is a circle
    circles = [sorted(c) for c in _strongly_connected(_import_graph())]
    assert not circles, f"import circles: {circles}"


#: the layers, lowest first
LAYERS = ("functional", "engine", "losses", "config", "demo")
#: top-level modules that are no layer: the package face and the re-exports of documented paths
TOP = {
    "st_cached_losses",
    "st_cached_losses.distributed",
    "st_cached_losses.training_args",
    "st_cached_losses.model_card",
    "st_cached_losses.data",
}


def _layer(module: str) -> int:
    """The index of ``module``'s layer in :data:`LAYERS`; ``len(LAYERS)`` for the top-level modules."""
    if module in TOP:
        return len(LAYERS)
    parts = module.split(".")
    assert len(parts) > 1 and parts[1] in LAYERS, f"{module} is in no layer: put it in one (or in TOP)"
    return LAYERS.index(parts[1])


def test_every_module_imports_only_its_layer_and_those_below():
    offenders = []
    for name, targets in _import_graph().items():
        offenders += [f"{name} imports {t}" for t in sorted(targets) if _layer(t) > _layer(name)]
    assert not offenders, offenders


def test_the_top_level_holds_at_most_five_modules():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert len(modules) <= 5, sorted(modules)
    assert {f"st_cached_losses.{m}" for m in modules} <= TOP


def test_functional_holds_one_autograd_function():
    """One InfoNCE core: every loss of the family is a set of logit terms of one autograd Function (the
    statistics pass in forward, the tiles recomputed in backward), not a second code path. The sigmoid loss
    is no softmax (no terms, no statistics): its Function is the one for losses whose gradients come out of
    the forward pass, usable by any other such loss. (The last Function is a collective: the all-gather whose
    backward sums over processes.)"""
    functions = []
    for path in sorted((PACKAGE / "functional").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith("autograd.Function") for base in node.bases
            ):
                functions.append(f"{path.relative_to(PACKAGE / 'functional').as_posix()}:{node.name}")
    assert sorted(functions) == [
        "distributed.py:_GatherWithSummedGrad",
        "sigmoid/autograd.py:OnePassFunction",
        "softmax/autograd.py:InfoNCEFunction",
    ]


#: helpers of ``st_cached_losses.functional.distributed`` that communicate nothing (the process's rank, the world size, a
#: warning): the losses may read them; every other name there is a collective
_NOT_COLLECTIVES = {"is_distributed", "rank", "world_size", "warn_no_process_group_once", "PeersFailed"}


def test_losses_call_no_collective():
    """The losses orchestrate: a collective they need runs inside the functional layer or the engine
    (``losses/sparse_cache.py`` once all-reduced its cache form itself)."""
    import st_cached_losses.distributed as distributed

    collectives = set(distributed.__all__) - _NOT_COLLECTIVES
    offenders = []
    for path in sorted((PACKAGE / "losses").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for module, names in _imports(path):
            if module == "torch.distributed" or module.startswith("torch.distributed."):
                offenders.append(f"{path.name} imports {module}")
            if module in ("st_cached_losses.distributed", "st_cached_losses.functional.distributed"):
                offenders += [f"{path.name} imports {n}" for n in names if n not in _NOT_COLLECTIVES]
            if module == "torch" and "distributed" in names:
                offenders.append(f"{path.name} imports torch.distributed")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in collectives:
                    offenders.append(f"{path.name}:{node.lineno} calls {called}")
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("dist", "torch.distributed"):
                offenders.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
    assert not offenders, offenders


def _documented_objects(
    module: Any, body: list[ast.stmt], prefix: str = ""
) -> Iterator[tuple[str, Any, str]]:
    """``(qualified name, object, docstring as written)`` for each class and function defined at the top of
    ``body`` (and in the classes' bodies) whose source has a docstring."""
    for node in body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        found = vars(module).get(node.name) if isinstance(module, type) else getattr(module, node.name, None)
        if isinstance(found, property):
            found = found.fget if found.fget is not None and found.fget.__name__ == node.name else found.fset
        found = getattr(found, "__func__", found)  # staticmethod, classmethod
        written = ast.get_docstring(node)
        if found is None or getattr(found, "__name__", None) != node.name:
            continue  # defined under a condition, or replaced (an overload's stub)
        if written is not None:
            yield prefix + node.name, found, written
        if isinstance(node, ast.ClassDef) and isinstance(found, type):
            yield from _documented_objects(found, node.body, f"{prefix}{node.name}.")


def test_no_docstring_is_assembled_at_import():
    """Every class's and function's docstring is the one its source shows: none is filled in, templated
    or replaced when the module is imported (what a reader sees is what ``help()`` and the API reference show)."""
    import importlib
    import inspect

    assembled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name.split(".")[1:2] == ["demo"]:
            continue  # the demo app (its UI) is not part of the library's API
        module = importlib.import_module(name)
        for qualname, obj, written in _documented_objects(module, ast.parse(path.read_text()).body):
            if inspect.cleandoc(obj.__doc__ or "") != inspect.cleandoc(written):
                assembled.append(f"{name}.{qualname}")
    assert not assembled, f"docstrings that differ from their source: {assembled}"


@pytest.fixture(scope="module")
def one_loss_of_each_kind(tmp_path_factory):
    """An instance of every loss class, on tiny random models of their kinds."""
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

    import st_cached_losses as s
    from tests.support.tiny_model import (
        make_tiny_cross_encoder,
        make_tiny_model,
        make_tiny_multi_vector,
        make_tiny_splade,
    )

    base = tmp_path_factory.mktemp("layer_losses")
    model = make_tiny_model(base / "st")
    splade = make_tiny_splade(base / "splade")
    return [
        s.CachedMNRLoss(model),
        s.CachedCLIPLoss(model, learnable_scale=True),
        s.CachedTiledLoss(model),
        s.CachedGISTLoss(model, model),
        s.CachedSparseLoss(
            splade, SparseMultipleNegativesRankingLoss(splade), document_regularizer_weight=3e-5
        ),
        s.CachedMultiVectorLoss(mv := make_tiny_multi_vector(base / "mv")),
        s.CachedCrossEncoderLoss(make_tiny_cross_encoder(base / "ce")),
        s.CachedDistillKLDivLoss(model, infonce_weight=0.1),
        s.CachedMarginMSELoss(model),
        s.CachedMultiVectorDistillKLDivLoss(mv),
        s.CachedMultiVectorMarginMSELoss(mv, infonce_weight=0.1),
    ]


def test_no_loss_refuses_an_inherited_setting(one_loss_of_each_kind):
    """Every setting a loss has (each name of its settings object, and its other settable attributes) can be
    read, and assigned the value it holds: a loss carries only the settings it takes, none inherited to be
    refused."""
    import inspect

    refused = []
    for loss in one_loss_of_each_kind:
        names = set(loss.settings_class.names())
        names |= {
            n for n, m in inspect.getmembers(type(loss)) if isinstance(m, property) and m.fset is not None
        }
        for name in sorted(n for n in names if not n.startswith("_")):
            view = loss.settings_class.views().get(name)
            if view is not None and view.fchanges is None:
                getattr(loss, name)  # read-only (the resolved similarity)
                continue
            try:
                setattr(loss, name, getattr(loss, name))
            except (AttributeError, ValueError, TypeError) as err:
                refused.append(f"{type(loss).__name__}.{name}: {err}")
    assert not refused, refused


def test_the_template_is_written_once():
    """No loss outside ``losses/base.py`` defines ``calculate_loss`` or ``forward``, nor a stage's loss: each
    is its settings and the stage it builds (``build_stage``), so a fix to the template lands once. Every
    loss, the reranker's included, is a ``CachedLoss`` whose ``forward`` and ``calculate_loss`` are the
    template's, and every one has ``compute_loss_from_embeddings``."""
    from st_cached_losses.losses import base
    from st_cached_losses.losses.registry import losses

    rewritten = []
    for path in sorted((PACKAGE / "losses").rglob("*.py")):
        if path.name == "base.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                rewritten += [
                    f"{path.name}:{node.name}.{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef)
                    and f.name in ("calculate_loss", "forward", "_stage2", "compute_loss_from_embeddings")
                ]
    assert not rewritten, rewritten
    classes = set(losses().values())
    assert len(classes) >= 11
    for cls in classes:
        assert issubclass(cls, base.CachedLoss), cls
        assert cls.forward is base.CachedLoss.forward, cls
        assert cls.calculate_loss is base.CachedLoss.calculate_loss, cls
        assert cls.compute_loss_from_embeddings is base.CachedLoss.compute_loss_from_embeddings, cls


def test_mini_batch_size_reaches_the_planner(tmp_path):
    """``--mini_batch_size 16`` from the command line cuts a column of 40 rows into 16, 16 and 8."""
    from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments, build_loss
    from tests.support.tiny_model import make_tiny_model

    parser = CachedLossArgumentParser(CachedLossTrainingArguments)
    argv = ["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "40"]
    (args,) = parser.parse_args_into_dataclasses([*argv, "--mini_batch_size", "16"])
    model = make_tiny_model(tmp_path / "model")
    loss = build_loss(model, args)
    assert loss.mini_batch_size == 16 and loss.cache.rows_per_mini_batch == 16
    features = model.tokenize([f"w{i} " * (1 + i % 7) for i in range(40)])
    assert [len(mb.rows) for mb in loss.cache.plan(0, features)] == [16, 16, 8]
    (auto,) = parser.parse_args_into_dataclasses(
        [*argv, "--mini_batch_size", "auto", "--use_cpu", "true", "--mini_batch_memory_budget", "64MB"]
    )
    assert build_loss(model, auto).mini_batch_size == "auto"


#: the functional layer's rooms of one family each: neither imports the other
FAMILIES = ("st_cached_losses.functional.softmax", "st_cached_losses.functional.sigmoid")


def test_functional_holds_at_most_fourteen_entries():
    """``functional/``'s top: the face, the shared floor and the rooms (folders), 14 at most (files and folders)."""
    entries = sorted(p.name for p in (PACKAGE / "functional").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 14, entries


def test_the_families_do_not_import_each_other():
    """Every module a family's module imports, directly or through others (``TYPE_CHECKING`` imports included),
    is of its own family or below both: the shared floor, the kernels, the representations."""
    graph = _import_graph()
    for family in FAMILIES:
        other = next(f for f in FAMILIES if f != family)
        for start in (m for m in graph if m == family or m.startswith(family + ".")):
            seen, todo = set(), [start]
            while todo:
                for target in graph[todo.pop()] - seen:
                    seen.add(target)
                    todo.append(target)
            crossing = sorted(m for m in seen if m == other or m.startswith(other + "."))
            assert not crossing, f"{start} imports {crossing}"


@pytest.mark.parametrize(
    ("module", "not_loaded"),
    [
        ("st_cached_losses.functional.sigmoid", "st_cached_losses.functional.softmax"),
        ("st_cached_losses.functional.softmax.parallel", "st_cached_losses.functional.sigmoid"),
        ("st_cached_losses.losses.cached_siglip", "st_cached_losses.functional.softmax"),
        ("st_cached_losses.losses.cached_mnr", "st_cached_losses.functional.sigmoid"),
    ],
)
def test_a_loss_imports_stop_at_its_own_family(module, not_loaded):
    """Importing a family, or a loss with what it imports, loads nothing of the other family. The losses'
    package face imports every loss (the registry's order), so a loss is imported here with the face left out."""
    code = (
        "import sys, types, st_cached_losses\n"
        "face = types.ModuleType('st_cached_losses.losses')\n"
        "face.__path__ = [st_cached_losses.__path__[0] + '/losses']\n"
        "sys.modules['st_cached_losses.losses'] = face\n"
        f"import {module}\n"
        f"print(' '.join(m for m in sys.modules if m == {not_loaded!r} or m.startswith({not_loaded!r} + '.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} also loaded: {out.stdout.strip()}"
