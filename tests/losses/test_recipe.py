"""docs/development.md's recipe for adding a loss, followed literally from a module outside the package
(``tests/support/two_way_loss.py``: a settings class, a stage, the class with its name, registered when
defined): the loss equals the loss it restates, ``CachedCLIPLoss``, in value and gradients, takes the engine's
knobs without restating them, rebuilds from its config, and builds by its name from a dict, a YAML file and
the command line, and trains (in a process of its own, as a user's script imports its module)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from st_cached_losses import CachedCLIPLoss
from st_cached_losses.losses import registry
from st_cached_losses.losses.settings import Plan
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_way():
    """The recipe's module, its loss registered for this test only (the registry is the process's)."""
    module = importlib.import_module("tests.support.two_way_loss")
    registry.register(module.CachedTwoWayLoss)  # again, where an earlier test unregistered it
    try:
        yield module
    finally:
        registry.unregister(module.CachedTwoWayLoss)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("recipe") / "bert")


@pytest.mark.parametrize("mode", ["per_direction", "joint"])
def test_a_loss_from_the_recipe_equals_the_loss_it_restates(model, two_way, mode):
    ours = two_way.CachedTwoWayLoss(model, 7.0, mode, tile_size=3, keep_params_unsharded=True)
    clip = CachedCLIPLoss(model, 7.0, partition_mode=mode, tile_size=3)
    assert ours.keep_params_unsharded and ours.cache.keep_params_unsharded and ours.tile_size == 3
    params = inspect.signature(two_way.CachedTwoWayLoss.__init__).parameters
    assert params["memory_budget"].kind is inspect.Parameter.KEYWORD_ONLY
    torch.manual_seed(0)
    columns = [torch.randn(5, 8, dtype=torch.float64) for _ in range(3)]
    got_leaves = [c.clone().requires_grad_() for c in columns]
    want_leaves = [c.clone().requires_grad_() for c in columns]
    got = ours.compute_loss_from_embeddings(got_leaves)
    want = clip.compute_loss_from_embeddings(want_leaves)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for g, w in zip(got_leaves, want_leaves):
        assert w.grad is not None and w.grad.abs().sum() > 0
        torch.testing.assert_close(g.grad, w.grad)
    config = ours.get_config_dict()
    assert config == {
        "mini_batch_size": 32,
        "mini_batch_num_tokens": None,
        "scale": 7.0,
        "partition_mode": mode,
        "tile_size": 3,
    }
    assert type(ours)(model, **config).get_config_dict() == config
    with pytest.raises(TypeError, match="unexpected keyword argument 'tile_sise'"):
        two_way.CachedTwoWayLoss(model, tile_sise=3)
    with pytest.raises(ValueError, match="partition_mode must be 'joint' or 'per_direction'"):
        ours.partition_mode = "sideways"


SCRIPT = """
import sys
from pathlib import Path

import torch
import yaml

import two_way_loss  # the user's module: its loss is registered when defined
from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments, build_loss
from tests.support.tiny_model import make_tiny_model, random_texts

out, model_dir = sys.argv[1], sys.argv[2]
model = make_tiny_model(Path(model_dir))
base = {"output_dir": out, "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 6}
parser = CachedLossArgumentParser(CachedLossTrainingArguments)
(from_dict,) = parser.parse_dict({**base, "loss": "two_way", "scale": 10.0, "partition_mode": "joint", "mini_batch_size": 2})
with open(f"{out}/run.yaml", "w") as f:
    yaml.safe_dump({**base, "loss": "CachedTwoWayLoss", "temperature": 0.1, "mini_batch_size": 2}, f)
(from_yaml,) = parser.parse_yaml_file(f"{out}/run.yaml")
(from_cli,) = parser.parse_args_into_dataclasses(
    ["--output_dir", out, "--use_cpu", "true", "--per_device_train_batch_size", "6", "--loss", "two-way",
     "--scale", "10", "--partition_mode", "joint", "--mini_batch_size", "2"]
)
for args in (from_dict, from_yaml, from_cli):
    loss = build_loss(model, args)
    assert type(loss) is two_way_loss.CachedTwoWayLoss and args.loss == "two_way", (type(loss), args.loss)
    assert loss.scale == 10.0 and loss.mini_batch_size == 2, loss.get_config_dict()
assert build_loss(model, from_cli).get_config_dict() == build_loss(model, from_dict).get_config_dict()
try:
    CachedLossTrainingArguments(**base, loss="two_way", margin=0.1)
except ValueError as err:
    assert "margin does not apply to loss='two_way'" in str(err), err
else:
    raise AssertionError("a field the loss does not take was accepted")
features = [model.preprocess(random_texts(6, seed=k)) for k in range(2)]
value = loss(features, None)
value.backward()
assert torch.isfinite(value) and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
print("trained", float(value))
"""


def test_the_recipe_s_loss_builds_by_its_name_from_a_dict_yaml_and_the_command_line(tmp_path):
    """In a process of its own, as a user's script: importing the loss's module registers it; the arguments
    take ``loss: two_way`` (its alias, its class name), read its settings' fields, refuse a field it does not
    take, and the built loss trains."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "two_way_loss.py").write_text((ROOT / "tests" / "support" / "two_way_loss.py").read_text())
    (user / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {**__import__("os").environ, "PYTHONPATH": f"{user}:{ROOT}"}
    done = subprocess.run(
        [sys.executable, str(user / "script.py"), str(tmp_path), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout


def test_the_recipe_s_loss_honours_matmul_precision(model, two_way):
    """Issue 58: the recipe's loss took matmul_precision and dropped it (its stage ran torch's global
    precision). It now reaches the stage: "medium" equals CachedCLIPLoss's "medium" bit for bit and differs
    from "highest"; the config lists it."""
    torch.manual_seed(0)
    columns = [torch.randn(6, 8) for _ in range(2)]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        values = {}
        for precision in ("highest", "medium"):
            ours = two_way.CachedTwoWayLoss(model, 7.0, matmul_precision=precision)
            clip = CachedCLIPLoss(model, 7.0, matmul_precision=precision)
            values[precision] = ours.compute_loss_from_embeddings(columns)
            assert torch.equal(values[precision], clip.compute_loss_from_embeddings(columns))
            assert ours.stage.plan.matmul_precision == precision
            assert ours.get_config_dict()["matmul_precision"] == precision
        assert not torch.equal(values["medium"], values["highest"])
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_stage_built_without_a_plan_setting_is_refused(model, two_way):
    """The template refuses a loss whose build_stage leaves a setting of the plan out of a stage that takes
    it (it would be accepted and ignored), naming the setting and the fix."""

    class Forgetful(two_way.CachedTwoWayLoss):
        def build_stage(self):
            return dataclasses.replace(super().build_stage(), plan=Plan())

    assert Forgetful(model).stage.plan.tile_size is None  # the defaults reach it either way
    with pytest.raises(ValueError, match=r"Forgetful: matmul_precision='medium' does not reach its stage"):
        Forgetful(model, matmul_precision="medium")
    with pytest.raises(
        ValueError,
        match=r"tile_size=3 does not reach .*\.build_stage must pass plan=settings\.plan\(\)",
    ):
        Forgetful(model, tile_size=3)
    loss = Forgetful(model)
    with pytest.raises(ValueError, match="does not reach its stage"):
        loss.tile_size = 5
    # the refused assignment left no trace
    assert loss.tile_size is None and loss.stage.plan.tile_size is None
