"""examples/train_cached_distill.py end to end on a tiny model (the teacher; the student its first layer): the
teacher's mined negatives and scores in the dataset, CachedDistillKLDivLoss with the InfoNCE term from the
script's defaults, the card's loss, settings, citations and the before / after / teacher table; its YAML."""

from __future__ import annotations

import pytest

from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments
from tests.demo.test_examples import EXAMPLES, TINY, check_card, load_example, make_text_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
def test_distill_example_runs_end_to_end(tmp_path, tiny_model):
    module = load_example("train_cached_distill")
    out = tmp_path / "out"
    trainer, metrics = module.main(
        ["--teacher_name_or_path", tiny_model, "--student_layers", "1", "--negatives", "3",
         "--output_dir", str(out), *TINY]
    )  # fmt: skip
    loss = trainer.loss
    assert type(loss).__name__ == "CachedDistillKLDivLoss" and trainer.state.global_step == 2
    assert (loss.temperature, loss.infonce_weight, loss.infonce_scale) == (0.05, 0.1, 20.0)
    assert len(trainer.model[0].auto_model.encoder.layer) == 1
    columns = trainer.train_dataset.column_names
    assert columns[:2] == ["query", "positive"] and "negative_3" in columns and columns[-1] == "label"
    assert len(trainer.train_dataset[0]["label"]) == 4
    assert set(metrics) == {"before", "after", "teacher"}
    card = (out / "README.md").read_text()
    check_card(
        card,
        "CachedDistillKLDivLoss",
        ["gao2021scaling", "lin2020distillingdenserepresentationsranking"],
        {"loss": "distill_kl", "infonce_weight": 0.1, "temperature": 0.05},
    )
    assert "| teacher |" in card


def test_distill_example_yaml_is_its_defaults():
    module = load_example("train_cached_distill")
    parser = CachedLossArgumentParser((module.ExampleArguments, CachedLossTrainingArguments))
    example, args = parser.parse_command_line(
        [str(EXAMPLES / "configs" / "cached_distill.yaml")], module.DEFAULTS
    )
    _, defaults = parser.parse_command_line([], module.DEFAULTS)
    assert (args.loss, args.infonce_weight, args.temperature) == ("distill_kl", 0.1, 0.05)
    assert (example.student_layers, example.negatives) == (2, 7)
    for name in ("mini_batch_size", "per_device_train_batch_size", "learning_rate", "infonce_scale"):
        assert getattr(args, name) == getattr(defaults, name), name
