"""The fast lane's marking (``tests/support/lanes.py``, ``tests/conftest.py``): what a test's code reaches is
found through helpers, local imports, fixtures and test classes; plain code is not marked; the lane's marker
expression is pyproject.toml's default; and a process group started from an unmarked test is refused."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import sentence_transformers  # noqa: F401 (imported as in the suite: _trains's local import is seen)

from tests.support import dist_utils, lanes
from tests.support.dist_utils import accelerate_launch, run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _helper_that_spawns():
    return run_distributed(print, 2)


def _two_calls_away():
    return _helper_that_spawns()


def _local_import():
    from tests.support.dist_utils import run_distributed as spawn

    return spawn


def _through_the_module():
    return dist_utils.run_distributed


def _runs_a_script():
    return subprocess.run(["true"], check=True)


def _launches():
    return accelerate_launch(2)


def _trains(model):
    from sentence_transformers import SentenceTransformerTrainer

    return SentenceTransformerTrainer(model=model)


def _plain(x):
    return [abs(v) for v in x]


def _lambda_calling_a_helper():
    return (lambda: _two_calls_away())()


def _lambda_calling_plain_code():
    return (lambda: _plain([1]))()


class _Case:
    def helper(self):
        return _helper_that_spawns()

    def test_like(self):
        return self.helper()


# The probes are named by strings, looked up in globals() by the tests: the scan follows names in code, not
# strings, so these tests are not marked themselves and stay in the fast lane.
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_helper_that_spawns", {"distributed"}),
        ("_two_calls_away", {"distributed"}),
        ("_local_import", {"distributed"}),
        ("_through_the_module", {"distributed"}),
        ("_lambda_calling_a_helper", {"distributed"}),
        ("_runs_a_script", {"subprocess"}),
        ("_launches", {"distributed", "subprocess"}),
        ("_trains", {"trainer"}),
        ("_plain", set()),
        ("_lambda_calling_plain_code", set()),
    ],
)
def test_kinds_are_found_through_what_the_code_calls(name, expected):
    assert lanes.kinds_of(globals()[name]) == expected


def test_a_test_methods_class_attributes_are_followed():
    case = globals()["_Case"]
    assert lanes.kinds_of(case.test_like, extra=dict(vars(case))) == {"distributed"}
    assert lanes.kinds_of(case.test_like) == set()  # without the class: `self.helper` is not seen
    assert lanes.kinds_of(case) == {"distributed"}  # a class named in code: its methods


def test_the_fast_lane_is_pytests_default_and_every_marker_is_registered():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert f"-m '{lanes.FAST}'" in options["addopts"] and "--strict-markers" in options["addopts"]
    registered = {m.split(":")[0] for m in options["markers"]}
    assert set(lanes.COSTLY) <= registered


def test_a_test_whose_code_reaches_a_process_group_is_marked(request):
    """Marked by the scan (its code names the helper), so deselected from the fast lane; run by make test."""
    assert callable(_helper_that_spawns)
    assert request.node.get_closest_marker("distributed") is not None


def test_this_session_was_marked_from_the_code(request):
    """The collection hook scanned every collected test, deselected ones included, before ``-m`` chose."""
    kinds = request.config.stash[lanes.KINDS]
    assert set(kinds) >= {item.nodeid for item in request.session.items}
    assert kinds[request.node.nodeid] == set()
    sibling = request.node.nodeid.replace(
        request.node.name, "test_a_test_whose_code_reaches_a_process_group_is_marked"
    )
    if sibling in kinds:  # collected with this one (not when this test runs alone)
        assert kinds[sibling] == {"distributed"}
    probes = [n for n in kinds if "test_kinds_are_found_through_what_the_code_calls" in n]
    assert all(kinds[n] == set() for n in probes)  # named by strings: not marked


def test_process_groups_are_refused_in_a_test_not_marked_distributed(request):
    """Picked by a string, which the scan does not follow (the case the refusal is for): nothing is started."""
    assert request.node.nodeid == dist_utils.UNMARKED_TEST
    groups = dict(dist_utils._GROUPS)
    spawn = vars(dist_utils)["run_" + "distributed"]
    with pytest.raises(RuntimeError, match="not marked `distributed`"):
        spawn(print, 2)
    assert groups == dist_utils._GROUPS


def test_each_test_marked_by_hand_exists():
    """A renamed or removed test listed in ``lanes.BY_HAND`` fails here (its file no longer defines it)."""
    for nodeid, kind in lanes.BY_HAND.items():
        path, name = nodeid.split("::")
        assert kind in lanes.COSTLY
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), nodeid
