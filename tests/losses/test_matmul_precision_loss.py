"""``matmul_precision`` as a loss setting (issue 52): every InfoNCE loss takes it and hands it to the core's
loss stage. ``"highest"`` is the exact path bit for bit; ``"medium"`` (bf16 products, fp32 statistics) moves
the loss and the gradients by bf16's rounding only; the config lists it when changed, the arguments' field
reaches the loss, a wrong value is refused naming the setting, and a loss whose stage keeps fp32 products
(the sparse distillation losses) does not take it."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import CachedCLIPLoss, CachedGISTLoss, CachedMNRLoss, CachedTiledLoss
from tests.losses.test_losses import columns, param_grads
from tests.support.tiny_model import make_tiny_model

LOSSES = [CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss, CachedGISTLoss]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


@pytest.fixture(autouse=True)
def _highest_globally():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("cls", LOSSES, ids=lambda c: c.__name__)
def test_highest_is_the_default_path_bit_for_bit_and_medium_rounds_like_bf16(model, cls):
    features = columns(model, 3)
    default_loss, default_grads = param_grads(model, cls(model, mini_batch_size=4), features)
    loss, grads = param_grads(model, cls(model, mini_batch_size=4, matmul_precision="highest"), features)
    assert torch.equal(loss, default_loss) and torch.equal(grads, default_grads)
    medium = cls(model, mini_batch_size=4, matmul_precision="medium")
    m_loss, m_grads = param_grads(model, medium, features)
    assert medium.get_config_dict()["matmul_precision"] == "medium"
    if cls is CachedGISTLoss:  # the guide's masks keep fp32 products whatever the setting (docs/memory.md)
        assert torch.equal(m_loss, loss) and torch.equal(m_grads, grads)
        return
    # bf16 products with fp32 statistics: a difference (the products are rounded), of bf16's size
    assert not torch.equal(m_loss, loss)
    assert abs(m_loss - loss) / loss.abs() < 1e-2
    assert (m_grads - grads).norm() / grads.norm() < 5e-2
    assert "matmul_precision" not in cls(model, mini_batch_size=4).get_config_dict()


def test_the_global_precision_is_read_at_the_step(model):
    features = columns(model, 2)
    medium_loss, _ = param_grads(
        model, CachedMNRLoss(model, mini_batch_size=4, matmul_precision="medium"), features
    )
    torch.set_float32_matmul_precision("medium")
    global_loss, _ = param_grads(model, CachedMNRLoss(model, mini_batch_size=4), features)
    assert torch.equal(global_loss, medium_loss)


def test_a_wrong_value_names_the_setting(model):
    with pytest.raises(ValueError, match="matmul_precision"):
        CachedMNRLoss(model, matmul_precision="bf16")


def test_the_arguments_field_reaches_the_loss(model):
    from st_cached_losses import build_loss
    from st_cached_losses.training_args import CachedLossTrainingArguments

    args = CachedLossTrainingArguments(
        output_dir="unused", per_device_train_batch_size=16, mini_batch_size=4, matmul_precision="medium"
    )
    assert build_loss(model, args).get_config_dict()["matmul_precision"] == "medium"
    with pytest.raises(ValueError, match="matmul_precision"):
        CachedLossTrainingArguments(output_dir="unused", matmul_precision="low")


@pytest.mark.parametrize(
    "name",
    [
        "CachedDistillKLDivLoss",
        "CachedMarginMSELoss",
        "CachedMultiVectorDistillKLDivLoss",
        "CachedMultiVectorMarginMSELoss",
        "CachedEmbedDistillLoss",
    ],
)
def test_a_distillation_loss_refuses_matmul_precision_without_its_infonce_term(name):
    """The distillation losses' products at matmul_precision are their in-batch InfoNCE term's: with
    infonce_weight 0 nothing would honour it, so it is refused (it was accepted and ignored); with the term it
    is taken."""
    import st_cached_losses

    settings_class = getattr(st_cached_losses, name).settings_class
    with pytest.raises(ValueError, match="matmul_precision='medium' sets the in-batch InfoNCE term"):
        settings_class(matmul_precision="medium")
    assert settings_class(matmul_precision="medium", infonce_weight=0.5).matmul_precision == "medium"
    assert settings_class().matmul_precision is None
