"""The set-up numbers the README states, from a run on this machine: the test count, and the times of the
test suite, the demo and the examples.

* the test count: ``pytest --collect-only -q -m ""`` (seconds; the whole suite, not the fast lane); ``--write``
  puts it in README.md's ``make test`` line, ``--check`` exits 1 when the README's count is more than 25%
  off (``tests/test_readme_numbers.py`` does the same check in the suite);
* ``--measure test demo examples`` (any of them) times what ``make test`` / ``make demo`` run and each
  script in ``examples/`` on its defaults (``--disable_tqdm true``), with this Python, without the
  Makefile's install step (the suite less the one test that checks these times: once the suite has grown
  past the tolerance it fails until they are re-measured); ``--write`` then puts the times in README.md (``make test`` and ``make demo``)
  and examples/README.md (the examples' range), and the day they were measured in README.md's
  "(times measured YYYY-MM-DD)". The suite takes tens of minutes on 2 CPU cores. With a
  1-minute load average above the CPU count (other work running), ``--write`` refuses to measure unless
  ``--busy_ok``: such times measure the other work.

Every measured number goes to ``benchmarks/results/readme_numbers.json`` with the machine's CPU count and
the date, merged with the numbers measured before (``times_date`` and ``times_tests``: the day of the last
``--measure`` and the suite's size then). Run from the repository root::

    .venv/bin/python tools/readme_numbers.py                      # the count: collected vs stated
    .venv/bin/python tools/readme_numbers.py --write              # the README states the collected count
    .venv/bin/python tools/readme_numbers.py --measure demo examples --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES_README = ROOT / "examples" / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "readme_numbers.json"
#: how far (relative) the README's count may be from the collected one before --check fails
TOLERANCE = 0.25

#: the count in README.md's `make test` line: "pytest (749 tests, ..."
COUNT = re.compile(r"(pytest \()(\d[\d,]*)( tests)")
#: the suite's time in the same line: "pytest (749 tests, about 25 minutes on 2 CPU cores)"
TEST_TIME = re.compile(r"(pytest \(\d[\d,]* tests, about )([^)]*?)( on \d+ CPU cores\))")
#: the day the README's times were measured: "(times measured 2026-11-25)"
TIMES_DATE = re.compile(r"(\(times measured )(\d{4}-\d{2}-\d{2})(\))")
#: the demo's time in README.md's `make demo` line: "runs the main job (~1.5 min)"
DEMO_TIME = re.compile(r"(runs the main job \(~)([^)]*)(\))")
#: the examples' range in examples/README.md: "(30-40 s on this project's 2\ncores"
EXAMPLES_TIME = re.compile(r"(\()(\d+-\d+ s)( on this project's\s+\d+\s+cores)")
#: the scripts timed by --measure examples (train_accelerate.py needs `accelerate launch`: left out)
EXAMPLE_SCRIPTS = ("train_cached_mnr.py", "train_cached_clip.py", "train_cached_tiled.py")

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def collected_count(python: str = sys.executable, cwd: Path = ROOT) -> int:
    """The number of tests ``pytest --collect-only -q -m ""`` collects in ``cwd``: the whole suite."""
    proc = subprocess.run(
        # -m "": every test, the costly ones the fast lane (pytest's default -m) deselects included
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", ""],
        cwd=cwd,
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    match = re.search(r"(\d+) tests? collected", proc.stdout)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"pytest --collect-only failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return int(match.group(1))


def stated_count(text: str) -> int:
    """The test count README.md's ``make test`` line states."""
    match = COUNT.search(text)
    if match is None:
        raise ValueError("README.md states no test count ('pytest (N tests' in the make test line).")
    return int(match.group(2).replace(",", ""))


def off_by(stated: int, collected: int) -> float:
    """How far the stated count is from the collected one, relative to the collected one."""
    return abs(stated - collected) / max(collected, 1)


def duration(seconds: float) -> str:
    """A time as the README says it: "40 s" under two minutes, else minutes ("1.5 min" under ten)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"


def stated_times(record: dict) -> dict[str, str]:
    """How the READMEs state the measured times of ``record`` (the keys it has): ``"test"`` ("10 minutes"),
    ``"demo"`` ("87 s") and ``"examples"`` (a range, "32-44 s")."""
    out = {}
    if "test_seconds" in record:
        out["test"] = duration(record["test_seconds"]).replace(" min", " minutes")
    if "demo_seconds" in record:
        out["demo"] = duration(record["demo_seconds"])
    if "examples_seconds" in record:
        seconds = record["examples_seconds"]
        out["examples"] = f"{min(seconds):.0f}-{max(seconds):.0f} s"
    return out


def rewrite(pattern: re.Pattern[str], text: str, value: str) -> str:
    """``text`` with the middle group of ``pattern``'s one match replaced by ``value``."""
    new, n = pattern.subn(lambda m: m.group(1) + value + m.group(3), text, count=1)
    if n != 1:
        raise ValueError(
            f"no match for {pattern.pattern!r}: the README's wording changed; update this script."
        )
    return new


def timed(cmd: list[str]) -> float:
    """Wall-clock seconds of ``cmd`` run from the repository root; raises if it fails."""
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, check=True)
    return time.perf_counter() - start


#: the suite as --measure test runs it: less the one test that checks the times this run replaces (after the suite
#: grew by more than the tolerance it fails until they are re-measured, and a failing run writes nothing)
TEST_ARGS = (
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-m",
    "",
    "--deselect",
    "tests/test_readme_numbers.py::test_the_readmes_times_are_the_last_measured_ones",
)


def measure(what: list[str], python: str) -> dict[str, float | list[float]]:
    """Time the suite, the demo and / or each example (what ``make test`` / ``make demo`` run)."""
    times: dict[str, float | list[float]] = {}
    if "test" in what:
        times["test_seconds"] = timed([python, *TEST_ARGS])
    if "demo" in what:
        times["demo_seconds"] = timed([python, "-m", "st_cached_losses.demo", "--disable_tqdm", "true"])
    if "examples" in what:
        times["examples_seconds"] = [
            timed([python, str(ROOT / "examples" / name), "--disable_tqdm", "true"])
            for name in EXAMPLE_SCRIPTS
        ]
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--measure", nargs="+", choices=("test", "demo", "examples"), default=[])
    parser.add_argument("--write", action="store_true", help="rewrite README.md (and examples/README.md)")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if the count is > {TOLERANCE:.0%}% off")
    parser.add_argument(
        "--python", default=sys.executable, help="the Python that runs pytest and the scripts"
    )
    parser.add_argument(
        "--busy_ok", action="store_true", help="write times measured while the machine was busy (see above)"
    )
    options = parser.parse_args(argv)
    # a time measured while other work holds the CPUs is not the machine's: --write refuses it unless asked
    load = os.getloadavg()[0]
    if options.measure and options.write and not options.busy_ok and load > (os.cpu_count() or 1):
        parser.error(
            f"the 1-minute load average is {load:.1f} on {os.cpu_count()} CPUs: the times would measure the "
            "other work. Run when the machine is idle, or pass --busy_ok."
        )

    record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    record.update(
        tests=collected_count(options.python),
        cpu_count=os.cpu_count(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    if options.measure:
        record.update(measure(options.measure, options.python), load_average_before=round(load, 1))
        if "test" in options.measure:  # what was timed, by this script
            record["test_command"] = " ".join(TEST_ARGS[1:]) + " (tools/readme_numbers.py --measure test)"
        # the times' own day and suite size: a later --write of the count alone keeps them
        record.update(times_date=record["date"], times_tests=record["tests"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")

    text = README.read_text()
    stated = stated_count(text)
    print(
        f"collected {record['tests']} tests; README.md states {stated} ({off_by(stated, record['tests']):.0%} off)"
    )
    if options.write:
        text = rewrite(COUNT, text, str(record["tests"]))
        stated = stated_times(record)
        if "test" in options.measure:
            text = rewrite(TEST_TIME, text, stated["test"])
        if "demo" in options.measure:
            text = rewrite(DEMO_TIME, text, stated["demo"])
        if options.measure:
            text = rewrite(TIMES_DATE, text, record["times_date"][:10])
        README.write_text(text)
        if "examples" in options.measure:
            EXAMPLES_README.write_text(
                rewrite(EXAMPLES_TIME, EXAMPLES_README.read_text(), stated["examples"])
            )
        print("README numbers written; measured:", {k: v for k, v in record.items() if k.endswith("seconds")})
    if options.check and off_by(stated, record["tests"]) > TOLERANCE:
        print(
            f"README.md's test count {stated} is more than {TOLERANCE:.0%} off the collected {record['tests']}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
