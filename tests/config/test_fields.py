"""The arguments' fields are the settings' specs: one field per constructor argument, its default and help;
the loss settings a loss takes; engine settings and mini_batch_size='auto' reach the loss."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.factory import build_loss
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE, _arguments


def test_every_setting_a_loss_takes_is_a_field_with_its_declarations_help():
    """The arguments' fields are read from the losses' settings: every setting a loss takes from the arguments
    (its settings' fields, the views its constructor takes, its base loss's arguments) is a field of the
    arguments (under ``FIELD_NAMES``' name) or on ``NOT_FIELDS`` with its reason; a field's help is its
    setting's declaration (its meaning), and its default the declaration's or None (the loss's own)."""
    from st_cached_losses.config.registry import FIELD_NAMES, LOSSES, NOT_FIELDS, declaration, loss_parameters
    from st_cached_losses.config.training_args import FIELD_SETTINGS

    fields = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}
    assert {"sparse", "multi_vector", "distill_kl", "sparse_distill_kl"} <= set(LOSSES)
    for name in LOSSES:
        for setting in loss_parameters(name):
            if setting in NOT_FIELDS:
                continue
            field_name = FIELD_NAMES.get(setting, setting)
            assert field_name in fields, (
                f"loss {name!r} takes {setting}, which no field of the arguments sets"
            )
            assert FIELD_SETTINGS[field_name] == setting
    for field_name, setting in FIELD_SETTINGS.items():
        f = fields[field_name]
        found = declaration(setting)
        if found is not None and setting not in (
            "scale",
            "temperature",
            "similarity_fct",
            "directions",
            "guide",
        ):
            assert f.metadata["help"].startswith(found.metadata["doc"]), field_name
            assert f.default in (found.default, None), field_name
        assert f.metadata["help"], field_name


def test_each_constructor_takes_its_settings():
    """A loss's constructor is the one list of its settings: its parameters (but the model) are its settings'
    fields (but those the loss sets itself), the views it takes (the tiled loss's ``symmetric``), and the
    engine's knobs; each parameter's default is its setting's default."""
    import inspect

    from st_cached_losses.losses.registry import losses

    for cls in set(losses().values()):
        settings = cls.settings_class
        params = {
            k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k not in ("self", "model")
        }
        wanted = (set(settings.field_names()) - settings.not_arguments) | settings.view_arguments
        assert set(params) == wanted, (cls.__name__, set(params) ^ wanted)
        for name, param in params.items():
            if name in settings.view_arguments or settings.declaration(name).metadata.get("module"):
                continue
            default = settings.default(name)
            if default is not dataclasses.MISSING and param.default is not inspect.Parameter.empty:
                assert param.default == default or (
                    cls.__name__ == "CachedTiledLoss" and name in ("directions", "partition_mode")
                ), (
                    cls.__name__,
                    name,
                    param.default,
                    default,
                )


def test_every_loss_field_is_checked_by_its_setting():
    """A field's value is checked by its setting's declaration (the losses' own check, naming the field)."""
    for name, value in [("margin", float("nan")), ("contrast_anchors", "yes"), ("scale_learning_rate", -1.0)]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            CachedLossTrainingArguments(**BASE, loss="gist", guide_model="g", **{name: value})


def test_loss_options_take_the_settings_without_a_field():
    """``loss_options``: a setting without a field of its own (a user's loss's) is passed to the loss and
    checked by its settings; a name the loss lacks, or one with a field of its own, is refused."""
    with pytest.raises(ValueError, match=r"loss_options: CachedMNRLoss has no setting 'jointt'"):
        CachedLossTrainingArguments(**BASE, loss_options={"jointt": True})
    with pytest.raises(ValueError, match="has a field of its own: set tile_size instead"):
        CachedLossTrainingArguments(**BASE, loss_options={"tile_size": 4})


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


@pytest.mark.parametrize(
    ("field_name", "value"), [("scale", 5.0), ("temperature", 0.2), ("siglip_bias", -3.0)]
)
def test_the_listed_losses_are_those_whose_arguments_take_the_field(field_name, value):
    """One rule lists the losses of a field (``field_takers``: --help, the errors, the configuration page):
    the losses listed are exactly those whose arguments take the field (built with it away from its default
    without "does not apply"); ``scale`` is not listed for the KL distillation losses, which refuse it, and
    ``temperature`` is listed for the InfoNCE losses, which take it as ``1 / scale``."""
    from st_cached_losses.config.registry import LOSSES, field_takers
    from st_cached_losses.config.training_args import FIELD_SETTINGS

    # what a loss needs besides the field to be built at all
    needs = {
        "gist": {"guide_model": "guide"},
        "sparse": {"document_regularizer_weight": 3e-5},
        "sparse_distill_kl": {"document_regularizer_weight": 3e-5},
        "sparse_margin_mse": {"document_regularizer_weight": 3e-5},
    }
    accepted = []
    for name in LOSSES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _arguments(**BASE, loss=name, **needs.get(name, {}), **{field_name: value})
        except ValueError as err:
            assert "does not apply" in str(err), (name, str(err))
            continue
        accepted.append(name)
    listed = field_takers(FIELD_SETTINGS[field_name])
    assert listed == accepted
    assert len(accepted) < len(LOSSES)
    if field_name == "scale":
        assert "distill_kl" not in listed and "mnr" in listed
    if field_name == "temperature":
        assert {"mnr", "clip", "tiled", "siglip", "distill_kl"} <= set(listed)
    help_text = {f.name: f for f in dataclasses.fields(CachedLossTrainingArguments)}[field_name].metadata[
        "help"
    ]
    assert help_text.count("Losses:") == 1
    from st_cached_losses.config.training_args import _names

    assert help_text.endswith(f" Losses: {_names(listed)}.")


def test_a_field_under_its_settings_name_names_the_field(tmp_path):
    """A configuration file or flag with a loss setting's name whose field has another name (SigLIP's ``bias``
    is ``siglip_bias``) is an error naming that field."""
    config = tmp_path / "run.yaml"
    config.write_text("output_dir: out\nloss: siglip\nbias: -5\n")
    parser = CachedLossArgumentParser(CachedLossTrainingArguments)
    with pytest.raises(ValueError, match="The loss setting 'bias' is the field 'siglip_bias'"):
        parser.parse_yaml_file(str(config))
    with pytest.raises(ValueError, match="The loss setting 'bias' is the field 'siglip_bias'"):
        parser.parse_args_into_dataclasses(["--output_dir", "out", "--loss", "siglip", "--bias", "-5"])


def test_help_states_each_default_once():
    """``--help`` adds "(default: None)" only where the help text does not state the default itself (a
    "None: ..." or "required")."""
    import re

    help_text = " ".join(CachedLossArgumentParser(CachedLossTrainingArguments).format_help().split())
    entries = re.split(r" (?=--\w)", help_text)
    doubled = [e[:40] for e in entries if "(default: None)" in e and re.search(r"None:|required", e)]
    assert not doubled
