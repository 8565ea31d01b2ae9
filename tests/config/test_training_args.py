"""CachedLossTrainingArguments: parsing from the command line, JSON and YAML (CachedLossArgumentParser:
the closest field named before anything is built, the loss fields first in --help, a file plus
overrides); invalid combinations rejected before training, naming the field; warnings at the user's
line; build_loss for each loss."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import yaml
from transformers import HfArgumentParser

from st_cached_losses import CachedCLIPLoss, CachedLossArgumentParser, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.registry import DEFAULT_SCALE_LEARNING_RATE, LOSS_ALIASES, MODEL_KINDS
from st_cached_losses.config.training_args import (
    ARGUMENTS_CLASSES,
    LOSS_FIELDS,
    SCALE_PARAMETER_PATTERN,
    CachedLossArguments,
    CachedLossTrainingArguments,
)
from tests.support.tiny_model import make_tiny_model, random_texts

BASE = {"output_dir": "unused", "use_cpu": True, "report_to": "none"}


def _class_of(loss: str) -> type[CachedLossArguments]:
    """The arguments class that trains the model kind of ``loss`` (a misspelt loss: the default class, which
    names the closest loss)."""
    name = LOSS_ALIASES.get(str(loss).lower(), "mnr")
    return ARGUMENTS_CLASSES[MODEL_KINDS[name]]


def _arguments(**kwargs) -> CachedLossArguments:
    """The arguments of the class that trains the loss's model kind (its trainer takes only that class)."""
    return _class_of(kwargs.get("loss", "mnr"))(**kwargs)


def parse_cli(
    argv: list[str], cls: type[CachedLossArguments] = CachedLossTrainingArguments
) -> CachedLossArguments:
    # sentence-transformers' MultiVectorEncoderTrainingArguments has a field HfArgumentParser refuses (max_length:
    # int | None | dict): CachedLossArgumentParser reads that class, that field included
    parser = HfArgumentParser(cls) if cls.trains != "MultiVectorEncoder" else CachedLossArgumentParser(cls)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "unused", "--use_cpu", "--report_to", "none", *argv]
    )
    return args


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


@pytest.mark.parametrize(
    ("kwargs", "cls", "checks"),
    [
        ({"loss": "mnr", "scale": 30.0}, CachedMNRLoss, {"_scale": 30.0, "symmetric": False}),
        (
            {"loss": "CachedCLIPLoss", "learnable_scale": True, "max_scale": 50.0},
            CachedCLIPLoss,
            {"learnable_scale": True, "max_scale": 50.0},
        ),
        (
            {"loss": "tiled", "symmetric": True, "tile_size": 64, "similarity": "dot"},
            CachedTiledLoss,
            {"symmetric": True, "tile_size": 64, "similarity": "dot"},
        ),
    ],
)
def test_build_loss(tmp_path, kwargs, cls, checks):
    model = make_tiny_model(tmp_path / "m")
    args = CachedLossTrainingArguments(**BASE, mini_batch_size=4, mask_duplicates=True, **kwargs)
    loss = build_loss(model, args)
    assert type(loss) is cls and loss.mini_batch_size == 4 and loss.mask_duplicates
    for name, value in checks.items():
        assert getattr(loss, name) == value


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"loss": "nope"}, "loss"),
        ({"scale": 20.0, "temperature": 0.1}, "temperature"),
        ({"scale": -1.0}, "scale"),
        ({"loss": "mnr", "learnable_scale": True}, "learnable_scale"),
        ({"loss": "clip", "symmetric": True}, "symmetric"),
        ({"loss": "mnr", "tile_size": 128}, "tile_size"),
        ({"mini_batch_size": 0}, "mini_batch_size"),
        ({"similarity": "l2"}, "similarity"),
        ({"loss": "clip", "learnable_scale": True, "scale_learning_rate": -1e-2}, "scale_learning_rate"),
        ({"scale_learning_rate": float("nan")}, "scale_learning_rate"),
        (
            {"loss": "clip", "learnable_scale": True, "learning_rate_mapping": {"(": 1e-3}},
            "learning_rate_mapping",
        ),
    ],
)
def test_invalid_combinations_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        CachedLossTrainingArguments(**BASE, **kwargs)


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


def test_mini_batch_not_smaller_than_batch_warns_caching_off_at_the_users_line(tmp_path):
    with pytest.warns(UserWarning, match="caching is off") as record:
        args = CachedLossTrainingArguments(**BASE, per_device_train_batch_size=8, mini_batch_size=8)
    assert args.mini_batch_size == 8  # allowed: a warning, not an error
    assert record[0].filename == __file__
    # through the parser too: the warning points at the line that parses, not into transformers
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump({**BASE, "per_device_train_batch_size": 8, "mini_batch_size": 8})
    )
    with pytest.warns(UserWarning, match="caching is off") as record:
        CachedLossArgumentParser().parse_yaml_file(tmp_path / "run.yaml")
    assert record[0].filename == __file__


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


def test_dataset_with_too_few_columns_is_rejected_before_training():
    from datasets import Dataset

    args = CachedLossTrainingArguments(**BASE, loss="clip", per_device_train_batch_size=4, mini_batch_size=2)
    pairs = Dataset.from_dict({"anchor": ["a", "b"], "positive": ["c", "d"]})
    with pytest.warns(UserWarning, match="fewer than one global batch"):
        check_dataset_columns(pairs, args)
    one_text = Dataset.from_dict({"anchor": ["a", "b"], "label": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"CachedCLIPLoss.*1 text column.*at least two"):
        check_dataset_columns(one_text, args)
    with pytest.raises(ValueError, match=r"train_dataset\['b'\]"):
        check_dataset_columns({"a": pairs, "b": one_text}, args)


def test_build_loss_checks_the_dataset_it_is_given(tmp_path):
    from datasets import Dataset

    model = make_tiny_model(tmp_path / "m")
    args = CachedLossTrainingArguments(**BASE, loss="mnr", per_device_train_batch_size=2, mini_batch_size=1)
    one_text = Dataset.from_dict({"anchor": ["a", "b"], "score": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"CachedMNRLoss.*\['anchor'\].*at least two"):
        build_loss(model, args, train_dataset=one_text)
    triplets = Dataset.from_dict({"anchor": ["a", "b"], "positive": ["c", "d"], "negative": ["e", "f"]})
    assert isinstance(build_loss(model, args, train_dataset=triplets), CachedMNRLoss)


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


# ---------------------------------------------------------------- the learnable scale's own learning rate


def _optimizer_groups(tmp_path, args, wrap=None):
    """The param groups of the optimizer the stock trainer builds for ``build_loss(model, args)``, as
    (learning rate, holds the loss's logit_scale, number of parameters); and the loss."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    model = make_tiny_model(tmp_path / "m")
    loss = build_loss(model, args)
    data = Dataset.from_dict({"anchor": random_texts(16, seed=0), "positive": random_texts(16, seed=1)})
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data, loss=wrap(model, loss) if wrap else loss
    )
    optimizer = trainer.create_optimizer()
    scale = getattr(loss, "logit_scale", None)
    groups = [
        (g["lr"], any(p is scale for p in g["params"]), len(g["params"]))
        for g in optimizer.param_groups
        if g["params"]
    ]
    return groups, loss


ARGS = {**BASE, "per_device_train_batch_size": 8, "mini_batch_size": 4, "learning_rate": 1e-4}


@pytest.mark.parametrize("loss_name", ["clip", "tiled"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_learnable_scale_gets_its_own_param_group_at_scale_learning_rate(tmp_path, loss_name, wrapped):
    """The trainer names the scale ``logit_scale`` (``loss.logit_scale`` inside MatryoshkaLoss): it is
    alone in a group at scale_learning_rate, every model parameter stays at learning_rate."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    args = CachedLossTrainingArguments(**ARGS, loss=loss_name, learnable_scale=True)
    assert args.scale_learning_rate == DEFAULT_SCALE_LEARNING_RATE == 1e-2
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 1e-2}
    wrap = (lambda model, loss: MatryoshkaLoss(model, loss, [32, 16])) if wrapped else None
    groups, _ = _optimizer_groups(tmp_path, args, wrap)
    assert [g for g in groups if g[1]] == [(1e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {1e-4}


def test_scale_pattern_matches_the_losses_scale_never_the_models():
    import re

    names = {
        "logit_scale": True,  # one loss
        "retrieval.logit_scale": True,  # a dict of losses
        "loss.logit_scale": True,  # MatryoshkaLoss(CachedCLIPLoss)
        "retrieval.loss.logit_scale": True,
        "model.0.model.logit_scale": False,  # a CLIP encoder's own scale
        "retrieval.model.0.model.logit_scale": False,
        "logit_scale_bias": False,
    }
    assert {name: bool(re.search(SCALE_PARAMETER_PATTERN, name)) for name in names} == names


def test_a_users_learning_rate_mapping_is_kept(tmp_path):
    user = {r"^model\.0\.": 2e-4}
    args = CachedLossTrainingArguments(**ARGS, loss="clip", learnable_scale=True, learning_rate_mapping=user)
    assert user == {r"^model\.0\.": 2e-4}  # the user's dict is not changed
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 1e-2, r"^model\.0\.": 2e-4}
    groups, _ = _optimizer_groups(tmp_path, args)
    assert [g for g in groups if g[1]] == [(1e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {2e-4}

    # a user's entry for the scale wins over scale_learning_rate, also given as a JSON string (the CLI)
    for mapping in ({"logit_scale": 5e-2}, json.dumps({"logit_scale": 5e-2})):
        args = CachedLossTrainingArguments(
            **ARGS, loss="clip", learnable_scale=True, learning_rate_mapping=mapping
        )
        assert args.learning_rate_mapping == {"logit_scale": 5e-2}
    groups, _ = _optimizer_groups(tmp_path, args)
    assert [g for g in groups if g[1]] == [(5e-2, True, 1)]
    assert {lr for lr, has_scale, _ in groups if not has_scale} == {1e-4}


def test_saved_arguments_parsed_again_follow_their_scale_learning_rate(tmp_path):
    args = CachedLossTrainingArguments(**ARGS, loss="clip", learnable_scale=True)
    saved = {k: v for k, v in json.loads(args.to_json_string()).items() if k in {"learning_rate_mapping"}}
    (again,) = CachedLossArgumentParser().parse_dict(
        {**ARGS, "loss": "clip", "learnable_scale": True, "scale_learning_rate": 3e-2, **saved}
    )
    assert again.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 3e-2}
    (off,) = CachedLossArgumentParser().parse_dict(
        {**ARGS, "loss": "clip", "learnable_scale": False, **saved}
    )
    assert off.learning_rate_mapping == {}  # the trainer rejects a pattern matching no parameter


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": "clip", "learnable_scale": True, "scale_learning_rate": None},
        {"loss": "clip", "learnable_scale": True, "scale_learning_rate": 0.0},
        {"loss": "clip", "learnable_scale": False},
        {"loss": "mnr"},
    ],
)
def test_scale_learning_rate_disabled_or_no_learnable_scale(tmp_path, kwargs):
    args = CachedLossTrainingArguments(**ARGS, **kwargs)
    assert args.learning_rate_mapping == {}
    groups, loss = _optimizer_groups(tmp_path, args)  # builds: no pattern without a parameter to match
    assert {lr for lr, _, _ in groups} == {1e-4}
    assert any(has_scale for _, has_scale, _ in groups) == loss.learnable_scale


def test_scale_learning_rate_from_the_command_line():
    args = parse_cli(
        [
            "--loss",
            "clip",
            "--learnable_scale",
            "true",
            "--scale_learning_rate",
            "0.05",
            "--mini_batch_size",
            "4",
        ]
    )
    assert args.learning_rate_mapping == {SCALE_PARAMETER_PATTERN: 0.05}
    args = parse_cli(
        [
            "--loss",
            "clip",
            "--learnable_scale",
            "true",
            "--scale_learning_rate",
            "0",
            "--mini_batch_size",
            "4",
        ]
    )
    assert args.learning_rate_mapping == {}


@pytest.mark.slow
def test_the_scale_moves_more_at_scale_learning_rate_than_at_learning_rate(tmp_path):
    """A few steps at a fine-tuning learning rate: the scale barely moves at learning_rate (the issue's
    20.00 -> 20.03), and moves by about steps x scale_learning_rate in log space with its own rate."""
    import math

    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    data = Dataset.from_dict({"anchor": random_texts(64, seed=0), "positive": random_texts(64, seed=1)})
    moved = {}
    for rate in (None, DEFAULT_SCALE_LEARNING_RATE):
        model = make_tiny_model(tmp_path / "m")
        args = CachedLossTrainingArguments(
            **{**BASE, "output_dir": str(tmp_path / "out")},
            loss="clip",
            learnable_scale=True,
            scale_learning_rate=rate,
            per_device_train_batch_size=16,
            mini_batch_size=8,
            learning_rate=1e-4,
            lr_scheduler_type="constant",
            max_steps=4,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        loss = build_loss(model, args)
        SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()
        moved[rate] = abs(math.log(loss.scale / 20.0))
    assert moved[None] < 4 * 1e-4 * 1.5  # Adam: about the learning rate per step, at most
    assert moved[DEFAULT_SCALE_LEARNING_RATE] > 10 * moved[None]
    assert moved[DEFAULT_SCALE_LEARNING_RATE] > 4 * DEFAULT_SCALE_LEARNING_RATE * 0.5


# --------------------------------------------------------------------------- MNRL options and GIST


def test_mnrl_options_reach_the_loss(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    args = parse_cli(
        ["--directions", "query_to_doc,query_to_query,doc_to_doc", "--hardness_mode", "all_negatives",
         "--hardness_strength", "5", "--mini_batch_size", "4"]
    )  # fmt: skip
    loss = build_loss(model, args)
    assert loss.directions == ("query_to_doc", "query_to_query", "doc_to_doc")
    assert loss.partition_mode == "joint" and loss.hardness_mode == "all_negatives"
    assert loss.hardness_strength == 5.0
    clip = build_loss(model, parse_cli(["--loss", "clip", "--partition_mode", "joint"]))
    assert clip.directions == ("query_to_doc", "doc_to_query") and clip.partition_mode == "joint"


def test_directions_as_a_yaml_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path), "directions": ["query_to_doc", "doc_to_query"]})
    )
    (args,) = CachedLossArgumentParser().parse_yaml_file(str(path))
    assert args.loss_directions == ("query_to_doc", "doc_to_query")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--directions", "query_to_doc,query_to_dok"], "query_to_query|query_to_doc"),
        (["--directions", "query_to_doc,doc_to_doc", "--partition_mode", "per_direction"], "joint"),
        (["--hardness_mode", "hardest"], "hardness_mode"),
        (["--loss", "gist"], "guide_model"),
        (["--guide_model", "x"], "guide_model applies to loss='gist' only"),
        (["--margin", "0.1"], "margin applies to loss='gist' only"),
        (
            ["--loss", "gist", "--guide_model", "x", "--directions", "query_to_doc"],
            "directions does not apply",
        ),
        (["--loss", "gist", "--guide_model", "x", "--learnable_scale"], "learnable_scale"),
        (["--loss", "gist", "--guide_model", "x", "--margin_strategy", "percent"], "margin_strategy"),
        (
            ["--loss", "tiled", "--symmetric", "true", "--directions", "query_to_doc"],
            "symmetric or directions",
        ),
    ],
)
def test_bad_option_fields_raise_naming_the_field(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_cli(argv)


def test_gist_from_arguments(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    guide_dir = tmp_path / "guide_st"
    make_tiny_model(tmp_path / "g", seed=4).save(str(guide_dir))
    args = parse_cli(
        ["--loss", "gist", "--guide_model", str(guide_dir), "--margin", "0.05", "--mini_batch_size", "4"]
    )
    loss = build_loss(model, args)
    from st_cached_losses import CachedGISTLoss

    assert isinstance(loss, CachedGISTLoss)
    assert loss.temperature == pytest.approx(0.01)  # GISTEmbedLoss's default
    assert loss.margin == 0.05 and loss.guide is not model
    feats = [model.preprocess(random_texts(6, seed=k)) for k in range(2)]
    loss(feats, None).backward()
    assert args.loss_settings()["guide_model"] == str(guide_dir)


def test_checkpoints_pickle_the_documented_path(tmp_path):
    """``training_args.bin`` names the class by ``st_cached_losses.training_args``, the documented path kept
    as a re-export: a checkpoint from before the move into ``config/`` loads (the same bytes), and one
    written now loads under an older version; a fresh process unpickles it by that path alone."""
    import pickle
    import subprocess
    import sys

    import st_cached_losses.training_args as documented

    assert documented.CachedLossTrainingArguments is CachedLossTrainingArguments
    assert documented.build_loss is build_loss and documented.check_dataset_columns is check_dataset_columns
    args = CachedLossTrainingArguments(**BASE, loss="clip", temperature=0.05, mini_batch_size=4)
    data = pickle.dumps(args)
    assert b"st_cached_losses.training_args" in data and b"st_cached_losses.config" not in data
    back = pickle.loads(data)
    assert type(back) is CachedLossTrainingArguments
    assert back.loss_settings() == args.loss_settings()
    (tmp_path / "args.pkl").write_bytes(data)
    code = (
        "import pickle, sys; a = pickle.load(open(sys.argv[1], 'rb')); "
        "from st_cached_losses.config.training_args import CachedLossTrainingArguments as C; "
        "assert type(a) is C and a.loss == 'clip' and a.loss_scale == 20.0, a"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "args.pkl")], check=True)


def test_every_constructor_argument_is_a_field_with_the_specs_default_and_help():
    """One spec per setting: every argument of every loss's constructor is a field of the arguments (under
    ``FIELD_NAMES``' name) or on ``NOT_FIELDS`` with its reason; a field of a plain setting has its spec's
    default (or None for the loss's own) and help; and each loss built from default arguments has its
    constructor's defaults."""
    import dataclasses
    import inspect

    from st_cached_losses.config.registry import LOSSES, loss_parameters
    from st_cached_losses.losses.settings import FIELD_NAMES, NOT_FIELDS, SPECS

    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    none_is_loss_default = {
        "scale",
        "temperature",
        "directions",
        "partition_mode",
        "symmetric",
        "memory_budget",
    }
    assert {"sparse", "multi_vector"} <= set(LOSSES)
    for name, cls in LOSSES.items():
        params = loss_parameters(name)  # 'sparse': its base loss's arguments too (the factory builds it)
        if name == "sparse":
            assert {"loss", "scale", "similarity_fct", "directions", "hardness_mode"} <= set(params)
        for param in params:
            if param in NOT_FIELDS:
                continue
            field_name = FIELD_NAMES.get(param, param)
            assert field_name in fields, f"{cls.__name__}({param}=...) has no field in the arguments"
            f = fields[field_name]
            default = params[param].default
            if param in SPECS:
                assert f.metadata["help"].startswith(SPECS[param].help), field_name
                # a spec's None default: the losses differ, each has its own (the field's None leaves it)
                assert SPECS[param].default in (None, default), (cls.__name__, param)
            if f.default is None and param in none_is_loss_default:
                continue
            if (
                default is inspect.Parameter.empty
            ):  # required (document_regularizer_weight): checked when built
                assert f.default is None, field_name
                continue
            if param in ("similarity_fct", "guide", "mini_batch_size"):
                continue  # a function / a model in the loss; mini_batch_size: ours 32 as theirs
            if f.default != default and not (name == "gist" and param == "mini_batch_size"):
                raise AssertionError(
                    f"{field_name}: field default {f.default!r} != {cls.__name__}'s {default!r}"
                )


def test_every_loss_field_is_its_specs():
    """One spec per field: every field the arguments add (but the loss choice) is a spec's field, with the
    spec's help (first) and default (or None: the loss's own), and is checked by the spec's check."""
    from st_cached_losses.config.training_args import FIELD_SPECS

    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    assert set(LOSS_FIELDS) - {"loss"} == set(FIELD_SPECS)
    for name, (_, spec) in FIELD_SPECS.items():
        assert fields[name].metadata["help"].startswith(spec.help), name
        assert fields[name].default in (spec.default, None), name
    for name, value in [("margin", float("nan")), ("contrast_anchors", "yes"), ("scale_learning_rate", -1.0)]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            CachedLossTrainingArguments(**BASE, loss="gist", guide_model="g", **{name: value})


@pytest.mark.parametrize("loss", ["mnr", "clip", "tiled", "gist", "sparse", "multi_vector"])
def test_loss_settings_list_only_what_the_loss_takes(loss):
    """The model card's loss settings: the chosen loss's own fields only (no GIST fields on an MNR card, no
    tile_size or symmetric outside 'tiled', the sparse and multi-vector fields on their own cards only)."""
    extra = {
        "gist": {"guide_model": "guide"},
        "sparse": {"document_regularizer_weight": 3e-5, "query_regularizer_weight": 5e-5},
        "multi_vector": {"score_mini_batch_size": 8},
    }.get(loss, {})
    args = _arguments(output_dir="out", per_device_train_batch_size=64, loss=loss, **extra)
    settings = args.loss_settings()
    gist_only = {"guide_model", "margin", "margin_strategy", "contrast_anchors", "contrast_positives"}
    sparse_only = {
        "document_regularizer_weight",
        "query_regularizer_weight",
        "document_regularizer_threshold",
        "query_regularizer_threshold",
        "use_document_regularizer_only",
    }
    assert bool(gist_only & set(settings)) == (loss == "gist")
    assert (sparse_only & set(settings)) == (sparse_only if loss == "sparse" else set())
    assert ("score_mini_batch_size" in settings) == (loss == "multi_vector")
    assert ("symmetric" in settings) == (loss == "tiled")
    assert ("tile_size" in settings) == (loss in ("tiled", "gist", "sparse", "multi_vector"))
    assert ("learnable_scale" in settings) == (loss in ("clip", "tiled"))
    assert ("mask_duplicates" in settings) == (loss not in ("gist", "multi_vector"))
    assert ("directions" in settings) == (loss not in ("gist", "multi_vector"))
    assert ("hardness_mode" in settings) == (loss not in ("gist", "multi_vector"))
    assert "gather_across_devices" in settings  # every loss takes it (sparse: its base loss)
    for name, value in extra.items():
        assert settings[name] == value


def test_fields_of_engine_settings_reach_the_loss(tmp_path):
    """The settings the arguments lacked before (path, budgets, engine switches) are fields now and reach
    the loss; one a loss does not take is refused, naming the field."""
    from st_cached_losses.config.factory import build_loss
    from tests.support.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "bert")
    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=64,
        path="chunked",
        memory_budget="1MiB",
        sort_by_length=False,
        reuse_last_graph=False,
        graph_memory_budget="1GB",
        mini_batch_memory_budget="512MB",
    )
    loss = build_loss(model, args)
    assert (loss.path, loss.memory_budget, loss.sort_by_length, loss.reuse_last_graph) == (
        "chunked",
        2**20,
        False,
        False,
    )
    assert loss.graph_memory_budget == 10**9 and loss.mini_batch_memory_budget == 512 * 10**6
    with pytest.raises(ValueError, match="path does not apply to loss='tiled'"):
        CachedLossTrainingArguments(output_dir="out", loss="tiled", path="chunked")
    with pytest.raises(ValueError, match="graph_memory_budget must be a positive number of bytes"):
        CachedLossTrainingArguments(output_dir="out", graph_memory_budget="lots")


def test_mini_batch_size_auto_from_the_command_line_and_a_file(tmp_path):
    """``auto`` (issue 21) is a value of the arguments too: from the command line (any case), a dict / YAML
    value, for rows or tokens; it reaches the loss with the memory budget, warns nothing about caching, and
    a word that is neither a count nor auto is a one-line parser error naming the field."""
    from tests.support.tiny_model import make_tiny_model

    parser = CachedLossArgumentParser()
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--mini_batch_size", "Auto", "--mini_batch_memory_budget", "1GB"]
    )
    assert args.mini_batch_size == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mini_batch_size >= per_device_train_batch_size" warning
        (args_tokens,) = parser.parse_dict(
            {"output_dir": str(tmp_path), "mini_batch_size": 4, "mini_batch_num_tokens": "auto"}
        )
    assert (args_tokens.mini_batch_size, args_tokens.mini_batch_num_tokens) == (4, "auto")
    loss = build_loss(make_tiny_model(tmp_path / "bert"), args)
    assert loss.mini_batch_size == "auto" and loss.mini_batch_memory_budget == 10**9
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--mini_batch_size", "lots"])
    with pytest.raises(ValueError, match="mini_batch_size must be a positive integer or 'auto'"):
        CachedLossTrainingArguments(output_dir=str(tmp_path), mini_batch_size="lots")


# --------------------------------------------------------------------------- the sparse and multi-vector losses

SPARSE_FIELDS = {
    "loss": "sparse",
    "document_regularizer_weight": 3e-5,
    "query_regularizer_weight": 5e-5,
    "document_regularizer_threshold": 40,
    "query_regularizer_threshold": 20,
    "mini_batch_size": 4,
    "hardness_mode": "in_batch_negatives",
    "hardness_strength": 2.0,
    "mask_duplicates": True,
}
MULTI_VECTOR_FIELDS = {
    "loss": "multi_vector",
    "similarity": "xtr",
    "score_mini_batch_size": 3,
    "mini_batch_size": 4,
    "path": "tiled",
    "tile_size": 16,
}


def _cli_argv(fields: dict) -> list[str]:
    argv = []
    for key, value in fields.items():
        argv += [f"--{key}", str(value)]
    return argv


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_sparse_loss_from_the_arguments(tmp_path, source):
    """loss: sparse builds CachedSparseLoss around a SparseMultipleNegativesRankingLoss with
    sentence-transformers' defaults (scale 1, dot product) and the configured regularisers, from a dict, a
    YAML file or the command line."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss, SparseMultipleNegativesRankingLoss
    from sentence_transformers.util import dot_score

    from st_cached_losses import CachedSparseLoss
    from tests.support.tiny_model import make_tiny_splade

    args = _parsed(tmp_path, source, SPARSE_FIELDS)
    assert args.model_kind == "SparseEncoder" and args.loss_scale == 1.0
    loss = build_loss(make_tiny_splade(tmp_path / "splade"), args)
    assert type(loss) is CachedSparseLoss
    assert type(loss.loss) is SparseMultipleNegativesRankingLoss
    assert (loss.loss.scale, loss.loss.similarity_fct) == (1.0, dot_score)
    assert (loss.loss.hardness_mode, loss.loss.hardness_strength) == ("in_batch_negatives", 2.0)
    assert (loss.document_regularizer_weight, loss.query_regularizer_weight) == (3e-5, 5e-5)
    assert isinstance(loss.document_regularizer, FlopsLoss) and loss.document_regularizer.threshold == 40
    assert isinstance(loss.query_regularizer, FlopsLoss) and loss.query_regularizer.threshold == 20
    assert (loss.mini_batch_size, loss.mask_duplicates, loss.use_document_regularizer_only) == (
        4,
        True,
        False,
    )

    scaled = _arguments(
        **BASE,
        **{**SPARSE_FIELDS, "temperature": 0.05, "similarity": "cosine", "gather_across_devices": True},
    )
    loss = build_loss(make_tiny_splade(tmp_path / "splade2"), scaled)
    assert loss.loss.scale == pytest.approx(20.0) and loss.loss.gather_across_devices
    assert loss.loss.similarity_fct.__name__ == "cos_sim"


@pytest.mark.parametrize("source", ["dict", "yaml", "cli"])
def test_multi_vector_loss_from_the_arguments(tmp_path, source):
    """loss: multi_vector builds CachedMultiVectorLoss with sentence-transformers' defaults (scale 1, MaxSim)
    unless configured: here XTR, score_mini_batch_size, the tiled path."""
    from sentence_transformers.multi_vector_encoder.scoring import (
        colbert_scores,
        mean_colbert_scores,
        xtr_scores,
    )

    from st_cached_losses import CachedMultiVectorLoss
    from st_cached_losses.functional.multi_vector import XTR, MaxSim
    from tests.support.tiny_model import make_tiny_multi_vector

    model = make_tiny_multi_vector(tmp_path / "mv")
    args = _parsed(tmp_path, source, MULTI_VECTOR_FIELDS)
    assert args.model_kind == "MultiVectorEncoder"
    loss = build_loss(model, args)
    assert type(loss) is CachedMultiVectorLoss
    assert (loss.scale, loss.similarity_fct, loss.similarity) == (1.0, xtr_scores, XTR(256))
    assert (loss.score_mini_batch_size, loss.mini_batch_size, loss.path, loss.tile_size) == (
        3,
        4,
        "tiled",
        16,
    )
    default = build_loss(model, _arguments(**BASE, loss="multi_vector", mini_batch_size=4))
    assert (default.scale, default.similarity) == (1.0, MaxSim())
    assert default.get_config_dict()["similarity_fct"] == colbert_scores.__name__
    mean = build_loss(
        model,
        _arguments(
            **BASE, loss="CachedMultiVectorLoss", similarity="MeanMaxSim", scale=8.0, mini_batch_size=4
        ),
    )
    assert (mean.scale, mean.similarity_fct, mean.similarity) == (8.0, mean_colbert_scores, MaxSim(True))


def _parsed(tmp_path, source: str, fields: dict) -> CachedLossArguments:
    if source == "dict":
        return _arguments(**BASE, **fields)
    if source == "yaml":
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**BASE, **fields}))
        (args,) = CachedLossArgumentParser(_class_of(fields["loss"])).parse_yaml_file(
            str(tmp_path / "run.yaml")
        )
        return args
    return parse_cli(_cli_argv(fields), _class_of(fields["loss"]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss": "sparse"}, "needs document_regularizer_weight"),
        ({"loss": "sparse", "document_regularizer_weight": -1.0}, "document_regularizer_weight must be"),
        (
            {"loss": "sparse", "document_regularizer_weight": 1e-5, "score_mini_batch_size": 4},
            "score_mini_batch_size",
        ),
        ({"loss": "sparse", "document_regularizer_weight": 1e-5, "similarity": "maxsim"}, "similarity"),
        ({"loss": "sparse", "document_regularizer_weight": 1e-5, "learnable_scale": True}, "learnable_scale"),
        ({"loss": "multi_vector", "directions": "query_to_doc"}, "directions does not apply"),
        ({"loss": "multi_vector", "hardness_mode": "in_batch_negatives"}, "hardness_mode does not apply"),
        ({"loss": "multi_vector", "mask_duplicates": True}, "mask_duplicates does not apply"),
        ({"loss": "multi_vector", "max_scale": 50.0}, "max_scale does not apply"),
        ({"loss": "multi_vector", "similarity": "dot"}, "'maxsim', 'meanmaxsim' or 'xtr'"),
        (
            {"loss": "multi_vector", "document_regularizer_weight": 1e-5},
            "document_regularizer_weight does not",
        ),
        ({"loss": "multi_vector", "score_mini_batch_size": 0}, "score_mini_batch_size must be"),
        ({"loss": "mnr", "score_mini_batch_size": 4}, "score_mini_batch_size does not apply"),
        ({"loss": "clip", "use_document_regularizer_only": True}, "use_document_regularizer_only does not"),
        (
            {"loss": "gist", "guide_model": "g", "query_regularizer_weight": 1e-5},
            "query_regularizer_weight does",
        ),
        ({"loss": "mnr", "similarity": "xtr"}, "loss='multi_vector'"),
        ({"loss": "multi-vektor"}, "Did you mean 'multi-vector'"),
    ],
)
def test_fields_the_chosen_loss_does_not_take_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _arguments(**BASE, **kwargs)


def test_a_model_of_another_kind_is_refused_naming_the_one_needed(tmp_path):
    """build_loss checks the model against the loss: a SentenceTransformer for loss='sparse' (or a
    SparseEncoder for 'mnr') names the kind and trainer the loss needs."""
    from tests.support.tiny_model import make_tiny_splade

    dense = make_tiny_model(tmp_path / "dense")
    sparse_args = _arguments(**BASE, loss="sparse", document_regularizer_weight=3e-5, mini_batch_size=4)
    with pytest.raises(
        ValueError, match=r"trains a SparseEncoder, got a SentenceTransformer.*SparseEncoderTrainer"
    ):
        build_loss(dense, sparse_args)
    with pytest.raises(ValueError, match=r"trains a MultiVectorEncoder.*'mnr', 'clip', 'tiled', 'gist'"):
        build_loss(dense, _arguments(**BASE, loss="multi_vector", mini_batch_size=4))
    with pytest.raises(ValueError, match=r"trains a SentenceTransformer, got a SparseEncoder.*'sparse'"):
        build_loss(
            make_tiny_splade(tmp_path / "splade"),
            _arguments(**BASE, loss="mnr", mini_batch_size=4),
        )


def test_model_card_lists_the_sparse_settings_only(tmp_path):
    """The card's loss settings for loss='sparse' name its own fields (and not GIST's or the multi-vector
    loss's): the callback's non-default hyperparameters, from loss_settings."""
    from st_cached_losses.config.training_args import LOSS_DEFAULTS

    args = _arguments(**BASE, **SPARSE_FIELDS)
    changed = {k: v for k, v in args.loss_settings().items() if v != LOSS_DEFAULTS[k]}
    assert changed == {k: v for k, v in SPARSE_FIELDS.items()}


@pytest.mark.parametrize("loss", ["tiled", "gist", "sparse", "multi_vector"])
def test_tile_size_reaches_every_loss_that_takes_it(loss):
    """CachedGISTLoss takes tile_size, but a hand-written list in the arguments refused it for 'gist': which
    loss takes a field is its signature's answer alone."""
    extra = {"guide_model": "guide"} if loss == "gist" else {}
    if loss == "sparse":
        extra["document_regularizer_weight"] = 3e-5
    args = _arguments(**ARGS, loss=loss, tile_size=64, **extra)
    assert args.loss_kwargs()["tile_size"] == 64 and args.loss_settings()["tile_size"] == 64
