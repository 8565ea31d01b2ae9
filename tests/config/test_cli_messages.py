"""The demo's command line as a user meets it: a configuration file that is missing or malformed
is one ``error:`` line and exit status 2, and ``--help`` is plain text with its own words for every flag."""

from __future__ import annotations

import sys

import pytest

from st_cached_losses.config.cli import CachedLossArgumentParser, load_config, plain_text
from st_cached_losses.demo import main

PROG = "python -m st_cached_losses.demo"


def _command_line_error(monkeypatch, capsys, *argv: str) -> str:
    """What ``python -m st_cached_losses.demo ARGV`` prints to stderr; it must exit with status 2 and
    print one line, no traceback."""
    monkeypatch.setattr(sys, "argv", [PROG, *argv])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"{PROG}: error: "), err
    return err


def test_a_missing_config_file_is_one_error_line(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    err = _command_line_error(monkeypatch, capsys, "--config", str(missing))
    assert "not found" in err and "missing.yaml" in err
    err = _command_line_error(monkeypatch, capsys, str(missing))  # the file as the first argument
    assert "not found" in err


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.yaml", "loss: mnr\n  scale: [1\n", ["not valid YAML", "line 2"]),
        ("bad.yml", "loss: [mnr\n", ["not valid YAML", "line"]),
        ("bad.json", '{"loss": "mnr",}', ["not valid JSON", "line 1"]),
        ("list.yaml", "- loss\n- mnr\n", ["must hold a mapping"]),
    ],
)
def test_a_malformed_config_file_is_one_error_line(monkeypatch, capsys, tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    err = _command_line_error(monkeypatch, capsys, "--config", str(path))
    assert str(path) in err
    for word in words:
        assert word in err, err
    with pytest.raises(ValueError, match=r"not valid|mapping"):  # the API: a ValueError
        load_config(path)


def test_a_misspelt_hardness_mode_on_the_command_line(monkeypatch, capsys):
    err = _command_line_error(monkeypatch, capsys, "--hardness_mode", "hard_negative")
    assert "Did you mean 'hard_negatives'?" in err
    assert "'in_batch_negatives', 'hard_negatives', 'all_negatives'" in err
    assert "None" not in err and "{" not in err


@pytest.fixture(scope="module")
def demo_help() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    return out.getvalue()


def test_help_names_the_program_and_is_free_of_rst_markup(demo_help):
    assert demo_help.startswith(f"usage: {PROG} ")
    assert "``" not in demo_help
    for role in (":class:", ":meth:", ":func:", ":mod:", ":data:", "::\n"):
        assert role not in demo_help, role
    assert "Every setting is a field of DemoArguments or CachedLossTrainingArguments" in demo_help


def _option_help(text: str, flag: str) -> str:
    """The help of ``flag`` in ``--help``'s text: its lines up to the next option."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() and line.split()[0].rstrip(",") == flag)
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.strip().startswith("-") or not line.strip():
            break
        block.append(line)
    return " ".join(" ".join(block).split())


@pytest.mark.parametrize("name", ["contrast_anchors", "contrast_positives", "log_on_each_node"])
def test_a_no_flag_has_its_own_help(demo_help, name):
    positive = _option_help(demo_help, f"--{name}")
    negative = _option_help(demo_help, f"--no_{name}")
    assert f"Turn off {name}" in negative, negative
    assert "(default: False)" not in negative  # what the flag sets, not a default
    assert "Turn off" not in positive
    assert (
        positive.rsplit("]", 1)[-1].strip() != negative.split(f"--no-{name.replace('_', '-')}", 1)[-1].strip()
    )


def test_plain_text():
    assert plain_text(":class:`~st_cached_losses.demo.app.DemoArguments`") == "DemoArguments"
    assert plain_text(":meth:`a.b.c`") == "a.b.c"
    assert plain_text("``make demo``: run ``--help``") == "make demo: run --help"
    assert plain_text("Example::\n\n    x") == "Example:\n\n    x"
    assert plain_text("a [`DemoArguments`][st_cached_losses.demo.app.DemoArguments] or [b][a.b]") == (
        "a DemoArguments or b"
    )


def test_parser_description_is_plain_text():
    parser = CachedLossArgumentParser(description="Run :class:`~x.Y` with ``--loss clip``.")
    assert "Run Y with --loss clip." in parser.format_help()
