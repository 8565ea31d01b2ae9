"""README.md's set-up numbers follow the suite (``tools/readme_numbers.py``): the test count it states
is within 25% of what pytest collects, and the script finds and rewrites each number it maintains."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def numbers():
    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "tools" / "readme_numbers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_readmes_test_count_is_within_25_percent_of_the_collected_count(numbers):
    stated = numbers.stated_count((ROOT / "README.md").read_text())
    collected = numbers.collected_count(sys.executable, ROOT)
    assert numbers.off_by(stated, collected) <= numbers.TOLERANCE, (
        f"README.md says {stated} tests, pytest collects {collected}: run "
        "`.venv/bin/python tools/readme_numbers.py --write`"
    )


def test_every_number_the_script_maintains_is_found(numbers):
    """A rewording of the README that the script no longer matches fails here, not at the next --write."""
    readme = (ROOT / "README.md").read_text()
    for pattern in (numbers.COUNT, numbers.TEST_TIME, numbers.DEMO_TIME, numbers.TIMES_DATE):
        assert pattern.search(readme), pattern.pattern
    assert numbers.EXAMPLES_TIME.search((ROOT / "examples" / "README.md").read_text())


def test_rewrite(numbers):
    line = "make test   # ruff check, mypy, pytest (158 tests, about 2 minutes on 2 CPU cores)"
    line = numbers.rewrite(numbers.COUNT, line, "749")
    line = numbers.rewrite(numbers.TEST_TIME, line, "25 minutes")
    assert line.endswith("pytest (749 tests, about 25 minutes on 2 CPU cores)")
    assert numbers.stated_count(line) == 749
    assert (
        numbers.rewrite(numbers.DEMO_TIME, "runs the main job (~1.5 min)", "95 s")
        == "runs the main job (~95 s)"
    )
    text = "each (30-40 s on this project's 2\ncores; longer"
    assert (
        numbers.rewrite(numbers.EXAMPLES_TIME, text, "41-52 s")
        == "each (41-52 s on this project's 2\ncores; longer"
    )
    assert (
        numbers.rewrite(numbers.TIMES_DATE, "machine (times measured 2026-11-25), again", "2027-01-02")
        == "machine (times measured 2027-01-02), again"
    )
    with pytest.raises(ValueError, match="wording changed"):
        numbers.rewrite(numbers.DEMO_TIME, "no such line", "1 s")
    assert [numbers.duration(s) for s in (41.4, 95, 130, 1500)] == ["41 s", "95 s", "2.2 min", "25 min"]
    assert numbers.off_by(158, 749) > numbers.TOLERANCE >= numbers.off_by(700, 749)


def test_the_readmes_times_are_the_last_measured_ones(numbers):
    """The times README.md and examples/README.md state are those of the last measured run
    (``benchmarks/results/readme_numbers.json``, written by ``readme_numbers.py --measure ... --write``), as the
    script writes them: a hand edit, or a measurement not written into the README, fails here; and that run
    was of this suite's size (its count within 25% of what pytest collects now)."""
    import json

    record = json.loads(numbers.RESULTS.read_text())
    stated = numbers.stated_times(record)
    readme = (ROOT / "README.md").read_text()
    assert numbers.TEST_TIME.search(readme).group(2) == stated["test"]
    assert numbers.DEMO_TIME.search(readme).group(2) == stated["demo"]
    assert numbers.TIMES_DATE.search(readme).group(2) == record["times_date"][:10]  # the day they are from
    examples = (ROOT / "examples" / "README.md").read_text()
    assert numbers.EXAMPLES_TIME.search(examples).group(2) == stated["examples"]
    collected = numbers.collected_count(sys.executable, ROOT)
    assert numbers.off_by(record["tests"], collected) <= numbers.TOLERANCE
    assert numbers.off_by(record["times_tests"], collected) <= numbers.TOLERANCE  # times of this suite's size
