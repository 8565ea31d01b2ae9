"""The arguments' fields are the settings' specs: one field per constructor argument, its default and help;
the loss settings a loss takes; engine settings and mini_batch_size='auto' reach the loss."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.training_args import (
    LOSS_FIELDS,
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE, _arguments


def test_every_constructor_argument_is_a_field_with_the_specs_default_and_help():
    """One spec per setting: every argument of every loss's constructor is a field of the arguments (under
    ``FIELD_NAMES``' name) or on ``NOT_FIELDS`` with its reason; a field of a plain setting has its spec's
    default (or None for the loss's own) and a help text (its field's own); and each loss built from default arguments has its
    constructor's defaults."""
    import dataclasses
    import inspect

    from st_cached_losses.config.registry import FIELD_NAMES, LOSSES, NOT_FIELDS, loss_parameters
    from st_cached_losses.losses.settings import SPECS

    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    none_is_loss_default = {
        "scale",
        "temperature",
        "directions",
        "partition_mode",
        "symmetric",
        "memory_budget",
        "infonce_scale",
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
                assert f.metadata["help"], field_name  # its help is written on the field's line
                # a spec's None default: the losses differ, each has its own (the field's None leaves it)
                # (the multi-vector distillation losses' mini_batch_size=None is theirs: the whole batch at
                # once; ours then runs mini-batches of the spec's 32)
                if not (param == "mini_batch_size" and default is None):
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
    default (or None: the loss's own) and a help text of its own, and is checked by the spec's check."""
    from st_cached_losses.config.training_args import FIELD_SPECS

    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    assert set(LOSS_FIELDS) - {"loss"} == set(FIELD_SPECS)
    for name, (_, spec) in FIELD_SPECS.items():
        assert fields[name].metadata["help"], name
        assert fields[name].default in (spec.default, None), name
    for name, value in [("margin", float("nan")), ("contrast_anchors", "yes"), ("scale_learning_rate", -1.0)]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            CachedLossTrainingArguments(**BASE, loss="gist", guide_model="g", **{name: value})


def test_the_help_texts_live_with_the_configuration():
    """The command line's words are the configuration layer's: the losses' specs carry a setting's default,
    check and config mode, no help text; each field's help is written on its line in
    ``config/training_args.py``."""
    from pathlib import Path

    import st_cached_losses.config.training_args as training_args
    from st_cached_losses.losses.settings import SPECS, Spec

    assert "help" not in {f.name for f in dataclasses.fields(Spec)}
    assert not any(hasattr(spec, "help") for spec in SPECS.values())
    source = Path(training_args.__file__).read_text()
    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    help_text = fields["keep_params_unsharded"].metadata["help"]
    assert help_text.startswith("Under FSDP2: gather every parameter group once per step")
    assert '"Under FSDP2: gather every parameter group once per step' in source


@pytest.mark.parametrize("loss", ["mnr", "clip", "tiled", "gist", "sparse", "multi_vector"])
def test_loss_settings_list_only_what_the_loss_takes(loss):
    """The model card's loss settings: the chosen loss's own fields only (no GIST fields on an MNR card, no
    symmetric outside 'tiled', the sparse and multi-vector fields on their own cards only)."""
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
    assert ("tile_size" in settings) == (loss != "cross_encoder")
    assert ("learnable_scale" in settings) == (loss in ("mnr", "clip", "tiled", "gist"))
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
        mini_batch_size="auto",
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
    """``auto`` is a value of the arguments too: from the command line (any case), a dict / YAML
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
            {
                "output_dir": str(tmp_path),
                "mini_batch_size": 4,
                "mini_batch_num_tokens": "auto",
                "mini_batch_memory_budget": "1GB",
            }
        )
    assert (args_tokens.mini_batch_size, args_tokens.mini_batch_num_tokens) == (4, "auto")
    loss = build_loss(make_tiny_model(tmp_path / "bert"), args)
    assert loss.mini_batch_size == "auto" and loss.mini_batch_memory_budget == 10**9
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--mini_batch_size", "lots"])
    with pytest.raises(ValueError, match="mini_batch_size must be a positive integer or 'auto'"):
        CachedLossTrainingArguments(output_dir=str(tmp_path), mini_batch_size="lots")
