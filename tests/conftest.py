"""Shared pytest configuration: the ``device`` fixture and the ``--device`` option that picks its values.

A test that takes ``device`` runs once per selected device: ``--device cpu``, ``--device cuda``,
``--device all`` (both), or, by default, cpu plus cuda when a CUDA device is available. ``make
gpu-check`` runs the suite with ``--device cuda``; asking for cuda where there is none is an error,
not a silent skip.
"""

from __future__ import annotations

import pytest
import torch

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
