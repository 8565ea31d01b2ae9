"""Which costly things a test does, read from its code: the markers the fast lane leaves out.

``pytest`` alone runs the fast lane: ``pyproject.toml``'s ``addopts`` deselects the tests marked with one
of :data:`COSTLY`; ``make test`` (``-m ""``) runs them all. ``tests/conftest.py`` marks each collected test
with the kinds :func:`kinds_of` finds, so a new test of those kinds is marked without a decorator:

* ``distributed``: it starts gloo process groups (:func:`tests.support.dist_utils.run_distributed`) or an
  ``accelerate launch`` (:func:`tests.support.dist_utils.accelerate_launch`);
* ``subprocess``: it starts another program (the ``subprocess`` module: a script, ``accelerate launch``,
  ``mkdocs build``, a Triton interpreter run in a fresh Python);
* ``trainer``: it builds a Hugging Face ``Trainer`` (sentence-transformers' trainers are subclasses) to train.

A test reaches these through the functions it calls: the test function, its fixtures, and every function,
class or module of the test suite (modules named ``tests.*``) that their code names, followed transitively;
an identity match (the object a name is bound to), not a name match. What code builds at run time (an
example script loaded from its file, a function picked by a string) is not seen: such tests carry the
marker themselves (``@pytest.mark.trainer``, or ``pytestmark`` at the module's top), and ``slow`` is always
written by hand (the biggest property tests, the examples end to end). :func:`run_distributed` refuses to
run in a test that is not marked ``distributed`` (a test the scan missed fails, saying so, instead of
slowing the fast lane).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import subprocess
import sys
import types
from collections.abc import Iterable
from typing import Any

import pytest

#: the markers the fast lane (pytest's default ``-m``) leaves out; ``make test`` runs everything
COSTLY = ("distributed", "subprocess", "trainer", "slow")

#: the fast lane's marker expression: pyproject.toml's ``addopts`` passes it as ``-m``
FAST = "not (" + " or ".join(COSTLY) + ")"

#: where tests/conftest.py keeps the kinds it found for each collected test, by node id (for tests/test_lanes.py)
KINDS = pytest.StashKey[dict[str, set[str]]]()

#: what the scan cannot see, by test function (every parametrisation): costly tests whose program, trainer or
#: size comes from a module loaded at run time or from their own arithmetic, marked here rather than in their
#: files (tests/test_lanes.py checks that each one still exists)
BY_HAND = {
    # pytest --collect-only of the whole suite in a subprocess (tools/readme_numbers.py, loaded from its file)
    "tests/test_readme_numbers.py::test_the_readmes_test_count_is_within_25_percent_of_the_collected_count": (
        "subprocess"
    ),
    "tests/test_readme_numbers.py::test_the_readmes_times_are_the_last_measured_ones": "subprocess",
    # examples/train_cached_cross_encoder.py, loaded from its file, trains
    "tests/losses/test_cached_cross_encoder_trainer.py::test_example_runs_end_to_end_on_a_tiny_reranker": "trainer",
    # the biggest property tests: 120 to 150 hypothesis examples each
    "tests/functional/test_functional_core.py::test_values_and_gradients_match_reference": "slow",
    "tests/functional/test_sigmoid.py::test_values_and_gradients_match_reference": "slow",
    "tests/config/test_sampling.py::test_property_one_dataset_per_step_no_row_twice_every_row_once": "slow",
}

_SUBPROCESS = frozenset(
    id(f)
    for f in (
        subprocess,
        subprocess.run,
        subprocess.Popen,
        subprocess.call,
        subprocess.check_call,
        subprocess.check_output,
    )
)


def _ours(module: str | None) -> bool:
    """Whether code of ``module`` belongs to the test suite (whose code is followed)."""
    return module is not None and (module == "tests" or module.startswith("tests.") or module == "conftest")


def _is_trainer_class(obj: Any) -> bool:
    return isinstance(obj, type) and any(
        c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in obj.__mro__
    )


def _direct(obj: Any) -> set[str]:
    """The kinds ``obj`` is by itself (not through what it calls)."""
    from tests.support import dist_utils

    if obj is dist_utils.run_distributed:
        return {"distributed"}
    if obj is dist_utils.accelerate_launch:
        return {"distributed", "subprocess"}
    if id(obj) in _SUBPROCESS:
        return {"subprocess"}
    if _is_trainer_class(obj):
        return {"trainer"}
    return set()


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    """``code`` and the code nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names(code: types.CodeType) -> set[str]:
    return {name for c in _codes(code) for name in (*c.co_names, *c.co_freevars)}


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def kinds_of(obj: Any, *, extra: dict[str, Any] | None = None, seen: set[int] | None = None) -> set[str]:
    """The costly kinds (of ``"distributed"``, ``"subprocess"``, ``"trainer"``) that calling ``obj`` can
    reach: ``obj`` itself, and what the test suite's code it names reaches, transitively.

    ``extra``: names to look up besides the function's globals (a test method's class attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    kinds = _direct(obj)
    if kinds:
        return kinds
    if isinstance(obj, functools.partial):
        return kinds_of(obj.func, seen=seen) | set().union(*(kinds_of(a, seen=seen) for a in obj.args))
    if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
        return kinds_of(obj.__func__, seen=seen, extra=extra)
    if isinstance(obj, property):
        return set().union(*(kinds_of(f, seen=seen) for f in (obj.fget, obj.fset) if f is not None))
    if isinstance(obj, type):
        if not _ours(obj.__module__):
            return set()
        return set().union(set(), *(kinds_of(v, seen=seen, extra=vars(obj)) for v in vars(obj).values()))
    if not isinstance(obj, types.FunctionType):
        return set()
    wrapped = inspect.unwrap(obj)
    if wrapped is not obj:
        kinds |= kinds_of(wrapped, seen=seen, extra=extra)
    if not _ours(obj.__module__):
        return kinds
    names = _names(obj.__code__)
    spaces = [obj.__globals__, extra or {}]
    # a module of the suite named in the code (`dist_utils.run_distributed`): its attributes too
    spaces += [
        vars(m)
        for n in names
        if isinstance(m := obj.__globals__.get(n), types.ModuleType) and _ours(m.__name__)
    ]
    # a local import (`from tests.support.dist_utils import run_distributed` in the function): the module's
    # dotted name is among the code's names
    spaces += [vars(importlib.import_module(n)) for n in sorted(names) if _ours(n) and "." in n]
    # another library's module named in the code, imported there or locally (`from sentence_transformers
    # import SentenceTransformerTrainer`): what its names are, not what they call
    modules = [obj.__globals__.get(n) for n in names] + [sys.modules.get(n) for n in names]
    for module in modules:
        if isinstance(module, types.ModuleType) and not _ours(module.__name__):
            space = vars(module)
            kinds |= set().union(*(_direct(space[n]) for n in names if n in space))
    cells = zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False)
    spaces.append({n: c.cell_contents for n, c in cells if _filled(c)})
    for name in names:
        for space in spaces:
            if name in space:
                target = space[name]
                if isinstance(target, types.ModuleType):
                    kinds |= _direct(target)
                else:
                    kinds |= kinds_of(target, seen=seen, extra=extra)
    return kinds
