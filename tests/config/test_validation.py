"""CachedLossTrainingArguments refuses invalid combinations before training, naming the field, and warns at the
user's line."""

from __future__ import annotations

import warnings

import pytest
import yaml

from st_cached_losses import CachedLossArgumentParser
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"loss": "nope"}, "loss"),
        ({"scale": 20.0, "temperature": 0.1}, "temperature"),
        ({"scale": -1.0}, "scale"),
        ({"loss": "gist", "guide_model": "g", "directions": "query_to_doc"}, "directions"),
        ({"loss": "clip", "symmetric": True}, "symmetric"),
        ({"loss": "mnr", "use_document_regularizer_only": True}, "use_document_regularizer_only"),
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


def test_a_mini_batch_holding_a_whole_pair_batch_warns_caching_off_at_the_users_line(tmp_path):
    """Caching is off when the whole batch, every column together, fits in one mini-batch: a batch of 8
    pairs (16 rows) at mini_batch_size 16. At 8 (one column's rows) it is cached, one column at a time."""
    with pytest.warns(UserWarning, match="caching is off") as record:
        args = CachedLossTrainingArguments(**BASE, per_device_train_batch_size=8, mini_batch_size=16)
    assert args.mini_batch_size == 16  # allowed: a warning, not an error
    assert record[0].filename == __file__
    assert "a batch of pairs (16 rows, both columns together)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CachedLossTrainingArguments(**BASE, per_device_train_batch_size=8, mini_batch_size=15)
    # through the parser too: the warning points at the line that parses, not into transformers
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump({**BASE, "per_device_train_batch_size": 8, "mini_batch_size": 16})
    )
    with pytest.warns(UserWarning, match="caching is off") as record:
        CachedLossArgumentParser().parse_yaml_file(tmp_path / "run.yaml")
    assert record[0].filename == __file__


def test_bare_arguments_do_not_warn():
    """transformers' batch of 8 under the default mini-batch of 32 is nobody's choice: a bare
    CachedLossTrainingArguments() (or one that sets neither size) builds without a warning; setting either
    size to a batch that fits in one mini-batch warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CachedLossTrainingArguments()
        CachedLossTrainingArguments(**BASE)
    with pytest.warns(UserWarning, match="caching is off"):
        CachedLossTrainingArguments(**BASE, per_device_train_batch_size=4)
    with pytest.warns(UserWarning, match="caching is off"):
        CachedLossTrainingArguments(**BASE, mini_batch_size=64)
