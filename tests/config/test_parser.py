"""CachedLossArgumentParser: the command line, JSON and YAML agree; the closest field named before anything is
built; the loss fields first in --help; a file plus overrides; a whole run from one YAML file."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml
from transformers import HfArgumentParser

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE, parse_cli
from tests.support.tiny_model import make_tiny_model


def test_cli_json_yaml_agree(tmp_path):
    fields = {"loss": "tiled", "temperature": 0.05, "symmetric": True, "tile_size": 256, "mini_batch_size": 8}
    cli = parse_cli(
        [
            "--loss",
            "tiled",
            "--temperature",
            "0.05",
            "--symmetric",
            "true",
            "--tile_size",
            "256",
            "--mini_batch_size",
            "8",
        ]
    )
    (tmp_path / "a.json").write_text(json.dumps({**BASE, **fields}))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**BASE, **fields}))
    parser = HfArgumentParser(CachedLossTrainingArguments)
    (from_json,) = parser.parse_json_file(str(tmp_path / "a.json"))
    (from_yaml,) = parser.parse_yaml_file(str(tmp_path / "a.yaml"))
    for args in (cli, from_json, from_yaml):
        assert (args.loss, args.loss_scale, args.symmetric, args.tile_size, args.mini_batch_size) == (
            "tiled",
            20.0,
            True,
            256,
            8,
        )


def test_unknown_yaml_field_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**BASE, "loss": "mnr", "mini_bach_size": 8}))
    with pytest.raises(ValueError, match="mini_bach_size"):
        HfArgumentParser(CachedLossTrainingArguments).parse_yaml_file(str(tmp_path / "bad.yaml"))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_the_readme_parser_names_the_closest_field_before_building_anything(tmp_path, suffix):
    """HfArgumentParser builds the arguments before it looks at unknown keys: with the default
    mini_batch_size (32) >= the batch, a typo'd mini_batch_size warned that caching is off, then failed
    without a suggestion. CachedLossArgumentParser (README's route) names the field first, alone."""
    config = {**BASE, "per_device_train_batch_size": 8, "mini_bach_size": 4}
    path = tmp_path / f"bad{suffix}"
    path.write_text(yaml.safe_dump(config) if suffix == ".yaml" else json.dumps(config))
    parser = CachedLossArgumentParser()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning comes before the error
        with pytest.raises(
            ValueError,
            match=r"bad\.\w+: unknown field\(s\) \['mini_bach_size'\].*Did you mean 'mini_batch_size'",
        ):
            parser.parse_yaml_file(path) if suffix == ".yaml" else parser.parse_json_file(path)
        with pytest.raises(ValueError, match="Did you mean 'mini_batch_size'"):
            parser.parse_dict(config)
        with pytest.raises(ValueError, match=r"--mini_bach_size.*Did you mean 'mini_batch_size'"):
            parser.parse_args_into_dataclasses(["--output_dir", "x", "--mini_bach_size", "4"])
    (args,) = parser.parse_yaml_file(path, allow_extra_keys=True)
    assert args.per_device_train_batch_size == 8


def test_help_lists_the_loss_fields_first():
    parser = CachedLossArgumentParser(description="first line\n\n    python train.py --loss clip\n")
    text = parser.format_help()
    usage = text.splitlines()[0]  # one line, not the ~130 fields
    assert usage.startswith("usage: ") and usage.endswith(
        "[CONFIG.yaml | --config CONFIG.yaml] [--FIELD VALUE ...]"
    )
    assert "\n    python train.py --loss clip\n" in text  # the description's lines are kept
    loss_section = text.index("cached loss (CachedLossTrainingArguments):")
    assert (
        loss_section < text.index("--mini_batch_size") < text.index("training (") < text.index("--output_dir")
    )


def test_parse_command_line_file_then_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, "loss": "clip", "mini_batch_size": 4}))
    parse = CachedLossArgumentParser().parse_command_line
    (args,) = parse(["--config", str(tmp_path / "run.yaml"), "--mini_batch_size", "2"])
    assert (args.loss, args.mini_batch_size) == ("clip", 2)
    (args,) = parse([str(tmp_path / "run.yaml")])
    assert args.mini_batch_size == 4
    (args,) = parse([f"--config={tmp_path / 'run.yaml'}"], defaults={"mini_batch_size": 8, "loss": "tiled"})
    assert (args.loss, args.mini_batch_size) == ("clip", 4)  # the file over the defaults
    with pytest.raises(ValueError, match=r"mini_bach_size.*Did you mean 'mini_batch_size'"):
        parse([str(tmp_path / "run.yaml"), "--mini_bach_size", "2"])
    with pytest.raises(ValueError, match="--config needs a path"):
        parse(["--config"])


@pytest.mark.parametrize(
    ("defaults", "config", "argv", "expected"),
    [
        ({"temperature": 0.05}, None, ["--scale", "30"], (30.0, None)),
        ({"scale": 20.0}, None, ["--temperature", "0.07"], (None, 0.07)),
        ({"scale": 20.0}, {"temperature": 0.1}, [], (None, 0.1)),
        ({}, {"scale": 20.0}, ["--temperature", "0.05"], (None, 0.05)),
        ({"temperature": 0.05}, None, ["--scale", "20", "--temperature", "0.05"], (20.0, 0.05)),
    ],
)
def test_scale_or_temperature_replaces_the_other_from_a_lower_source(
    tmp_path, defaults, config, argv, expected
):
    """Script defaults < file < command line; setting scale drops a lower source's temperature and the
    other way round, so they never "disagree" unless one source gives both."""
    if config is not None:
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, **config}))
        argv = [str(tmp_path / "run.yaml"), *argv]
    defaults = {**BASE, "per_device_train_batch_size": 64, **defaults}
    (args,) = CachedLossArgumentParser().parse_command_line(argv, defaults=defaults)
    assert (args.scale, args.temperature) == expected
    with pytest.raises(ValueError, match="disagree"):
        CachedLossArgumentParser().parse_command_line(
            ["--scale", "30", "--temperature", "0.05"], defaults=BASE
        )


@pytest.mark.slow
def test_training_run_driven_only_by_a_yaml_file(tmp_path):
    """A whole run from one YAML file (the demo's entry point, a tiny model): the loss the file names is
    trained with its settings, which are saved with the model's card and the training arguments."""
    import torch

    from st_cached_losses.demo import main

    model_dir = tmp_path / "model"
    make_tiny_model(tmp_path / "bert").save(str(model_dir))
    config = {
        "model_name_or_path": str(model_dir),
        "output_dir": str(tmp_path / "out"),
        "train_pairs": 32,
        "eval_pairs": 16,
        "max_seq_length": 24,
        "loss": "tiled",
        "symmetric": True,
        "tile_size": 8,
        "temperature": 0.1,
        "per_device_train_batch_size": 16,
        "mini_batch_size": 4,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "save_strategy": "steps",
        "save_steps": 2,
        "disable_tqdm": True,
        "loss_show_progress_bar": False,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    summary = main([str(tmp_path / "run.yaml")])
    assert summary["loss"] == "CachedTiledLoss" and summary["steps"] == 2 and summary["batch_size"] == 16
    assert summary["loss_config"]["partition_mode"] == "per_direction"
    assert summary["loss_config"]["scale"] == pytest.approx(10.0)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "loss:CachedTiledLoss" in card and "cheng2024breaking" in card and "- `tile_size`: 8" in card
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert (saved.loss, saved.tile_size, saved.symmetric, saved.loss_scale) == ("tiled", 8, True, 10.0)
