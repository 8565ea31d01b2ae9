"""Shared pytest configuration: the marking of the costly tests, and the ``device`` fixture and the ``--device``
option that picks its values.

Each collected test is marked ``distributed``, ``subprocess`` or ``trainer`` when its code reaches those
(``tests/support/lanes.py``); pyproject.toml's ``addopts`` deselects those kinds and ``slow`` by default, so
``pytest`` (``make test-fast``) runs the fast lane and ``pytest -m ""`` (``make test``) the whole suite.

A test that takes ``device`` runs once per selected device: ``--device cpu``, ``--device cuda``,
``--device all`` (both), or, by default, cpu plus cuda when a CUDA device is available. ``make
gpu-check`` runs the suite with ``--device cuda``; asking for cuda where there is none is an error,
not a silent skip.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import dist_utils, lanes

_DEVICES = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=("cpu", "cuda", "all"),
        default=None,
        help="devices for the tests taking the `device` fixture: cpu, cuda or all (cpu and cuda); "
        "default: cpu, plus cuda when a CUDA device is available",
    )


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread for the tests' own process unless OMP_NUM_THREADS says otherwise: their tensors are
    # tiny, and with two threads on two cores each parallel region waits for the second thread to be
    # scheduled, ~50x an op's arithmetic once the cores are busy (the gloo workers, other work, pytest -n)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    choice = config.getoption("--device")
    cuda = torch.cuda.is_available()
    if choice in ("cuda", "all") and not cuda:
        raise pytest.UsageError(
            f"--device {choice}: no CUDA device is available to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda or 'no'})."
        )
    if choice is None:
        choice = "all" if cuda else "cpu"
    config.stash[_DEVICES] = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu", "cuda"]}[choice]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        # session scope: hypothesis refuses function-scoped fixtures in @given tests
        metafunc.parametrize("device", metafunc.config.stash[_DEVICES], indirect=True, scope="session")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"`` or ``"cuda"``: move a test's tensors there (see ``--device``)."""
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the costly kinds its code reaches (``tests/support/lanes.py``), before ``-m``
    deselects: pytest's default leaves them out (the fast lane), ``make test`` runs them."""
    found = config.stash.setdefault(lanes.KINDS, {})
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        kinds = _kinds(item)
        by_hand = lanes.BY_HAND.get(item.nodeid.split("[")[0])
        found[item.nodeid] = kinds | {by_hand} if by_hand else kinds
        for kind in sorted(found[item.nodeid] - {m.name for m in item.iter_markers()}):
            item.add_marker(kind)
        # pytest -n N --dist loadgroup: the tests that start process groups on one worker (one set of kept
        # groups, not one per worker), the site's tests on one (one mkdocs build)
        if not xdist:
            continue  # its marker is registered by pytest-xdist (--strict-markers)
        if "distributed" in kinds:
            item.add_marker(pytest.mark.xdist_group("processes"))
        elif "site" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("site"))


def _kinds(item: pytest.Item) -> set[str]:
    function = getattr(item, "function", None)
    if function is None:
        return set()
    seen: set[int] = set()
    extra = {k: v for c in reversed(item.cls.__mro__) for k, v in vars(c).items()} if item.cls else None
    kinds = lanes.kinds_of(function, extra=extra, seen=seen)
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            kinds |= lanes.kinds_of(fixturedef.func, seen=seen)
    callspec = getattr(item, "callspec", None)
    for value in callspec.params.values() if callspec else ():
        kinds |= lanes.kinds_of(value, seen=seen)
    return kinds


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test not marked ``distributed`` may not start process groups (``dist_utils.run_distributed``
    refuses): one the marking missed fails, saying so, instead of slowing the fast lane."""
    dist_utils.UNMARKED_TEST = None if item.get_closest_marker("distributed") else item.nodeid
    try:
        return (yield)
    finally:
        dist_utils.UNMARKED_TEST = None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    deselected = len(terminalreporter.stats.get("deselected", ()))
    if config.option.markexpr == lanes.FAST and deselected:
        terminalreporter.write_line(
            f"the fast lane: {deselected} tests marked {', '.join(lanes.COSTLY)} deselected; "
            'the whole suite: make test (pytest -m "")'
        )
