"""The MNRL options (directions, partition_mode, hardness) and GIST's fields, from the arguments to the loss."""

from __future__ import annotations

import pytest
import yaml

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from tests.config.helpers import parse_cli
from tests.support.tiny_model import make_tiny_model, random_texts


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
        (["--guide_model", "x"], "guide_model applies to loss='gist' only"),
        (["--margin", "0.1"], "margin applies to loss='gist' only"),
        (
            ["--loss", "gist", "--guide_model", "x", "--directions", "query_to_doc"],
            "directions does not apply",
        ),
        (["--loss", "gist", "--guide_model", "x", "--mask_duplicates"], "mask_duplicates"),
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
