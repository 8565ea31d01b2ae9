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


def _demo_help(flag: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def demo_help() -> str:
    return _demo_help("--help")


@pytest.fixture(scope="module")
def demo_help_all() -> str:
    return _demo_help("--help_all")


def test_help_names_the_training_arguments_and_help_all_describes_them(demo_help, demo_help_all):
    """--help describes the loss fields and the script's, and names the ~120 training arguments (it ran to 873
    lines); --help_all describes them too. Each default is shown once: not appended where the help states it.
    (Under 450 lines before SigLIP's and matmul_precision's fields: 470 with them; 516 with
    CachedEmbedDistillLoss's seven.)"""
    assert len(demo_help.splitlines()) < 540 < len(demo_help_all.splitlines())
    assert "--help_all describes each" in demo_help and "--log_on_each_node" in demo_help
    assert "--help_all describes each" not in demo_help_all
    for text in (demo_help, demo_help_all):
        assert _option_help(text, "--mini_batch_size").startswith("--mini_batch_size")
    assert "whether to log once per node" not in demo_help  # transformers' help of log_on_each_node
    assert "whether to log once per node" in " ".join(demo_help_all.split())
    budget = _option_help(demo_help, "--memory_budget")
    assert "(default 64 MiB)" in budget and "(default: None)" not in budget
    assert "(default: mnr)" in _option_help(demo_help, "--loss")  # a help that does not state it: appended


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
def test_a_no_flag_has_its_own_help(demo_help_all, name):
    positive = _option_help(demo_help_all, f"--{name}")
    negative = _option_help(demo_help_all, f"--no_{name}")
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


# ---------------------------------------------------------------------- the messages of issue 45


def test_help_titles_the_loss_section_by_the_arguments_class(demo_help):
    """The loss fields' section is titled by the class that holds them, not by the script's first dataclass."""
    assert "\ncached loss (CachedLossTrainingArguments):" in demo_help
    assert "cached loss (DemoArguments)" not in demo_help


@pytest.mark.parametrize(
    ("kind", "name", "expected"),
    [
        ("CachedLossTrainingArguments", "CachedMultipleNegativesRankingLoss", "mnr"),
        ("CachedLossTrainingArguments", "cachedmultiplenegativessymmetricrankingloss", "clip"),
        ("CachedCrossEncoderTrainingArguments", "CachedMultipleNegativesRankingLoss", "cross_encoder"),
        ("CachedSparseEncoderTrainingArguments", "CachedSpladeLoss", "sparse"),
        # the non-cached losses the switching table maps to ours
        ("CachedLossTrainingArguments", "MultipleNegativesRankingLoss", "mnr"),
        ("CachedLossTrainingArguments", "MultipleNegativesSymmetricRankingLoss", "clip"),
        ("CachedLossTrainingArguments", "GISTEmbedLoss", "gist"),
        ("CachedCrossEncoderTrainingArguments", "MultipleNegativesRankingLoss", "cross_encoder"),
        ("CachedSparseEncoderTrainingArguments", "SpladeLoss", "sparse"),
        (
            "CachedMultiVectorEncoderTrainingArguments",
            "MultiVectorMultipleNegativesRankingLoss",
            "multi_vector",
        ),
        (
            "CachedMultiVectorEncoderTrainingArguments",
            "CachedMultiVectorMultipleNegativesRankingLoss",
            "multi_vector",
        ),
    ],
)
def test_sentence_transformers_class_names_name_our_losses(kind, name, expected):
    """``--loss CachedMultipleNegativesRankingLoss`` (their class) is our 'mnr', not a hint at another kind's loss;
    the cross-encoder's class of the same name is 'cross_encoder' for the CrossEncoder's arguments."""
    import st_cached_losses

    extra = {"document_regularizer_weight": 3e-5} if expected == "sparse" else {}
    args = getattr(st_cached_losses, kind)(
        output_dir="out", per_device_train_batch_size=64, loss=name, **extra
    )
    assert args.loss == expected
    from st_cached_losses import CachedLossTrainingArguments

    args = CachedLossTrainingArguments(
        output_dir="out", per_device_train_batch_size=64, loss="CachedGISTEmbedLoss", guide_model="g"
    )
    assert args.loss == "gist"


def test_an_unknown_loss_suggests_by_our_names(monkeypatch, capsys):
    err = _command_line_error(monkeypatch, capsys, "--loss", "CachedMultipleNegativesRankingLos")
    assert "Did you mean loss='mnr'?" in err and "cachedmultivectorloss" not in err
    err = _command_line_error(monkeypatch, capsys, "--loss", "nmr")
    assert "Did you mean loss='mnr'?" in err


def test_a_similarity_the_arguments_cannot_name_points_at_the_python_api(monkeypatch, capsys):
    err = _command_line_error(monkeypatch, capsys, "--similarity", "euclidean")
    assert "the arguments (and the command line) name only these two" in err
    assert "similarity_fct=sentence_transformers.util.euclidean_sim" in err
    assert "only these two are possible" not in err


def test_directions_without_query_to_doc_names_the_field_and_the_fix(monkeypatch, capsys):
    err = _command_line_error(monkeypatch, capsys, "--directions", "query_to_query")
    assert "'query_to_doc' direction is required" in err  # sentence-transformers' words first
    assert "directions='query_to_query' lacks it; add it: directions='query_to_doc,query_to_query'." in err


def test_a_memory_budget_without_auto_is_refused(monkeypatch, capsys):
    err = _command_line_error(monkeypatch, capsys, "--mini_batch_memory_budget", "2GB")
    assert "mini_batch_memory_budget='2GB' sizes 'auto' mini-batches only" in err
    assert "Set mini_batch_size='auto'" in err and "or remove mini_batch_memory_budget" in err


def test_auto_without_a_budget_is_refused_by_the_arguments_off_cuda(monkeypatch, capsys):
    """Not at the first step: the arguments refuse it (no CUDA here, or use_cpu), naming the fix."""
    from st_cached_losses.config import training_args

    monkeypatch.setattr(training_args, "_cuda_available", lambda: False)
    err = _command_line_error(monkeypatch, capsys, "--mini_batch_size", "auto")
    assert "set mini_batch_memory_budget (e.g. '2GB')" in err
    from st_cached_losses import CachedLossTrainingArguments

    with pytest.raises(ValueError, match="set mini_batch_memory_budget"):
        CachedLossTrainingArguments(output_dir="out", mini_batch_num_tokens="auto")
    monkeypatch.setattr(training_args, "_cuda_available", lambda: True)
    CachedLossTrainingArguments(output_dir="out", mini_batch_size="auto")  # CUDA: half its free memory
    with pytest.raises(ValueError, match="set mini_batch_memory_budget"):
        CachedLossTrainingArguments(output_dir="out", mini_batch_size="auto", use_cpu=True)


def test_the_wrong_arguments_class_for_a_reranker_says_what_its_collator_does():
    from st_cached_losses import CachedLossTrainingArguments

    with pytest.raises(ValueError) as info:
        CachedLossTrainingArguments(output_dir="out", loss="cross_encoder")
    message = str(info.value)
    assert "takes CachedCrossEncoderTrainingArguments only" in message
    assert "keeps the texts for the loss, which pairs each query with its documents" in message
    assert "tokenizes queries as queries" not in message


def test_an_unknown_loss_lists_each_class_once():
    """CachedSparseLoss is three names' class ('sparse', 'sparse_distill_kl', 'sparse_margin_mse'): the error
    lists it once."""
    from st_cached_losses import CachedLossTrainingArguments

    with pytest.raises(ValueError, match="is not a cached loss") as info:
        CachedLossTrainingArguments(output_dir="out", loss="nonsense")
    classes = str(info.value).split("ours: ")[1].split(";")[0].split(", ")
    assert classes.count("CachedSparseLoss") == 1 and len(classes) == len(set(classes)) >= 11


def test_a_misspelt_keyword_in_python_names_the_closest_one(tmp_path):
    """Python's own TypeError names no alternative; the arguments classes and the losses name the closest."""
    import pickle

    from st_cached_losses import (
        CachedLossTrainingArguments,
        CachedMNRLoss,
        CachedSparseEncoderTrainingArguments,
    )
    from tests.support.tiny_model import make_tiny_model

    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'mini_bach_size'\. Did you mean 'mini_batch_size'"
    ):
        CachedLossTrainingArguments(output_dir="out", mini_bach_size=4)
    with pytest.raises(TypeError, match="Did you mean 'document_regularizer_weight'"):
        CachedSparseEncoderTrainingArguments(
            output_dir="out", loss="sparse", document_regulariser_weight=3e-5
        )
    args = CachedLossTrainingArguments(output_dir="out", loss="clip", per_device_train_batch_size=64)
    assert pickle.loads(pickle.dumps(args)).loss == "clip"  # what checkpoints do still works
    model = make_tiny_model(tmp_path)
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'mini_bach_size'\. Did you mean 'mini_batch_size'"
    ):
        CachedMNRLoss(model, mini_bach_size=4)
    with pytest.raises(TypeError, match="Did you mean 'memory_budget'"):
        CachedMNRLoss(model, memory_budgit="1GB")
