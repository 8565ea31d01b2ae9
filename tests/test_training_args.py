"""CachedLossTrainingArguments: parsing from the command line, JSON and YAML; invalid combinations
rejected before training, naming the field; build_loss for each loss."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import HfArgumentParser

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.training_args import CachedLossTrainingArguments, build_loss
from tests.tiny_model import make_tiny_model

BASE = {"output_dir": "unused", "use_cpu": True, "report_to": "none"}


def parse_cli(argv: list[str]) -> CachedLossTrainingArguments:
    (args,) = HfArgumentParser(CachedLossTrainingArguments).parse_args_into_dataclasses(
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
    ],
)
def test_invalid_combinations_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        CachedLossTrainingArguments(**BASE, **kwargs)


def test_unknown_yaml_field_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**BASE, "loss": "mnr", "mini_bach_size": 8}))
    with pytest.raises(ValueError, match="mini_bach_size"):
        HfArgumentParser(CachedLossTrainingArguments).parse_yaml_file(str(tmp_path / "bad.yaml"))
