"""CachedSigLIPLoss on a tiny random BERT, one process: the loss and every parameter gradient (the encoder's,
the learned scale's and bias's) against the naive dense sigmoid loss (tests/support/reference.py), pairs and
triplets, uneven mini-batches, both paths; dropout replayed; evaluation; Matryoshka; its settings, config and
arguments; a trainer run whose callback saves and logs the scale and bias and whose card says what was
learned."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from sentence_transformers.util import dot_score

from st_cached_losses import CachedSigLIPLoss
from tests.support.reference import reference_sigmoid
from tests.support.tiny_model import make_tiny_model, random_texts

B = 11  # rows: mini-batches of 4 do not divide it, 32 exceeds it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("siglip") / "bert", dropout=0.0)


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("siglip_dropout") / "bert", dropout=0.3, seed=1)


def columns(model, n_cols: int, b: int = B, seed: int = 0):
    return [model.preprocess(random_texts(b, seed=seed + 100 * k)) for k in range(n_cols)]


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
    )


def assert_grads_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """One global tolerance over the whole gradient vector (some entries are analytically zero)."""
    assert ref.abs().max() > 0, "vacuous comparison: reference gradient is zero"
    err = (ours - ref).norm() / ref.norm()
    assert err < rtol * 10, f"relative gradient error {err:.2e}"
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def ours_step(model, loss, feats) -> dict:
    model.zero_grad(set_to_none=True)
    loss.zero_grad(set_to_none=True)
    value = loss(feats, None)
    value.backward()
    out = {"loss": value.item(), "grads": flat_grads(model).clone()}
    if loss.learnable:
        out["logit_scale"] = float(loss.logit_scale.grad)
        out["logit_bias"] = float(loss.logit_bias.grad)
    return out


def reference_step(model, feats, scale: float, bias: float, similarity="cosine") -> dict:
    model.zero_grad(set_to_none=True)
    log_scale = torch.tensor(math.log(scale), requires_grad=True)
    b = torch.tensor(bias, requires_grad=True)
    embs = [model(dict(f))["sentence_embedding"] for f in feats]
    value = reference_sigmoid(embs[0], embs[1:], scale=log_scale.exp(), bias=b, similarity=similarity)
    value.backward()
    return {
        "loss": value.item(),
        "grads": flat_grads(model).clone(),
        "logit_scale": float(log_scale.grad),
        "logit_bias": float(b.grad),
    }


def assert_step_equal(ours: dict, ref: dict) -> None:
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert_grads_close(ours["grads"], ref["grads"])
    for name in ("logit_scale", "logit_bias"):
        if name in ours:
            assert ref[name] != 0.0
            assert ours[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("n_cols", [2, 3], ids=["pairs", "triplets"])
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("mini_batch_size", [4, 32])
@pytest.mark.parametrize("learnable", [False, True], ids=["fixed", "learnable"])
def test_loss_and_every_gradient_equal_the_reference(model, n_cols, similarity, mini_batch_size, learnable):
    feats = columns(model, n_cols)
    scale, bias = (10.0, -10.0) if similarity == "cosine" else (0.3, -2.0)
    loss = CachedSigLIPLoss(
        model,
        scale,
        bias,
        learnable,
        mini_batch_size,
        similarity_fct=similarity if similarity == "cosine" else dot_score,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the caching-off and scale-unsaved notices
        ours = ours_step(model, loss, feats)
    assert_step_equal(ours, reference_step(model, feats, scale, bias, similarity))


@pytest.mark.parametrize(
    "options",
    [{"path": "chunked", "tile_size": 3}, {"path": "tiled", "tile_size": 4}, {"memory_budget": 1024}],
    ids=["chunked", "tiled", "tiny-budget"],
)
def test_the_loss_stage_plan_never_changes_the_result(model, options):
    feats = columns(model, 3, seed=5)
    ref = reference_step(model, feats, 7.0, -3.0)
    loss = CachedSigLIPLoss(model, 7.0, -3.0, True, 4, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_step_equal(ours_step(model, loss, feats), ref)


def test_dropout_is_replayed_with_its_first_forward_masks(dropout_model):
    """With dropout on, the replayed mini-batches get the first pass's masks: the gradients equal those of
    the same step with every graph kept from the first pass (nothing replayed: plain autograd through the
    first forwards). Dropout is really on: another seed gives another loss."""
    model = dropout_model
    model.train()
    feats = columns(model, 2, b=10, seed=3)

    def cached(seed: int, **options) -> dict:
        torch.manual_seed(seed)
        loss = CachedSigLIPLoss(model, 10.0, -10.0, True, 4, sort_by_length=False, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ours_step(model, loss, feats)

    replayed = cached(0)
    kept = cached(0, graph_memory_budget="10GB")
    assert_step_equal(replayed, kept)
    assert abs(cached(13)["loss"] - replayed["loss"]) > 1e-4, "vacuous: dropout is off"
    model.eval()


def test_evaluation_without_grad_equals_the_reference(model):
    feats = columns(model, 3, seed=7)
    loss = CachedSigLIPLoss(model, 5.0, -4.0, mini_batch_size=4)
    with torch.no_grad():
        value = loss(feats, None)
        embs = [model(dict(f))["sentence_embedding"] for f in feats]
        ref = reference_sigmoid(embs[0], embs[1:], scale=5.0, bias=-4.0)
    assert value.requires_grad is False
    assert float(value) == pytest.approx(float(ref), rel=1e-5)


def test_matryoshka_weights_every_truncation_and_the_learned_parameters(model):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    feats = columns(model, 2, seed=11)
    dims, weights = [32, 8], [1.0, 0.5]
    inner = CachedSigLIPLoss(model, 10.0, -10.0, True, 4)
    loss = MatryoshkaLoss(model, inner, dims, matryoshka_weights=weights)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = loss(feats, None)
        value.backward()
    ours = {
        "loss": value.item(),
        "grads": flat_grads(model).clone(),
        "logit_scale": float(inner.logit_scale.grad),
        "logit_bias": float(inner.logit_bias.grad),
    }
    model.zero_grad(set_to_none=True)
    log_scale = torch.tensor(math.log(10.0), requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    embs = [model(dict(f))["sentence_embedding"] for f in feats]
    ref_value = sum(
        w * reference_sigmoid(embs[0][:, :d], [embs[1][:, :d]], scale=log_scale.exp(), bias=bias)
        for d, w in zip(dims, weights)
    )
    ref_value.backward()
    ref = {
        "loss": ref_value.item(),
        "grads": flat_grads(model).clone(),
        "logit_scale": float(log_scale.grad),
        "logit_bias": float(bias.grad),
    }
    assert_step_equal(ours, ref)


def test_settings_parameters_and_config(model):
    loss = CachedSigLIPLoss(model, 8.0, -6.0, learnable=True, mini_batch_size=4, tile_size=16)
    names = [n for n, _ in loss.named_parameters() if n.startswith("logit")]
    assert names == ["logit_scale", "logit_bias"]
    assert loss.learnable_scale is True and loss.scale == pytest.approx(8.0) and loss.bias == -6.0
    config = loss.get_config_dict()
    assert config == {
        "scale": pytest.approx(8.0),
        "bias": -6.0,
        "similarity_fct": "cos_sim",
        "mini_batch_size": 4,
        "mini_batch_num_tokens": None,
        "gather_across_devices": False,
        "learnable": True,
        "max_scale": 100.0,
        "tile_size": 16,
    }
    assert CachedSigLIPLoss(model, **config).get_config_dict() == config
    # the learned values are the settings' (and the config's) and assigning one sets its parameter
    with torch.no_grad():
        loss.logit_bias.fill_(-2.5)
        loss.logit_scale.fill_(math.log(4.0))
    assert loss.bias == -2.5 and loss.scale == pytest.approx(4.0) and loss.get_config_dict()["bias"] == -2.5
    loss.bias = -1.0
    assert float(loss.logit_bias.detach()) == -1.0 and loss.scale == pytest.approx(4.0)
    loss.learnable = False
    assert not [n for n, _ in loss.named_parameters() if n.startswith("logit")]
    assert "learnable" not in loss.get_config_dict() and loss.bias == -1.0
    loss.learnable_scale = True  # the view sets learnable: both parameters back
    assert loss.learnable and hasattr(loss, "logit_bias")
    assert loss.citation.count("@") == 2 and "zhai2023sigmoid" in loss.citation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bias": math.inf}, "bias must be a finite number"),
        ({"scale": 0.0}, "scale"),
        ({"learnable": 1}, "learnable must be True or False"),
        ({"learnable": True, "scale": 200.0}, "max_scale must be >= scale"),
        ({"path": "sideways"}, "path"),
    ],
)
def test_invalid_settings_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CachedSigLIPLoss(model, **kwargs)


def test_no_directions_and_a_setting_of_another_loss_says_whose(model):
    loss = CachedSigLIPLoss(model)
    with pytest.raises(ValueError, match="CachedSigLIPLoss has no setting 'directions'"):
        loss.directions = ("query_to_doc",)
    with pytest.raises(TypeError):
        CachedSigLIPLoss(model, directions=("query_to_doc",))


def test_arguments_build_it_by_name_from_yaml(model, tmp_path):
    from st_cached_losses import CachedLossArgumentParser, build_loss

    run = tmp_path / "run.yaml"
    run.write_text(
        f"output_dir: {tmp_path / 'out'}\nloss: siglip\nscale: 5.0\nsiglip_bias: -3.0\nlearnable: true\n"
        "mini_batch_size: 4\nper_device_train_batch_size: 8\n"
    )
    (args,) = CachedLossArgumentParser().parse_yaml_file(str(run))
    loss = build_loss(model, args)
    assert isinstance(loss, CachedSigLIPLoss)
    assert (loss.scale, loss.bias, loss.learnable, loss.mini_batch_size) == (5.0, -3.0, True, 4)
    # the learned parameters get the scale's learning rate, the bias too
    assert sorted(args.learning_rate_mapping) == sorted(
        [r"^(?!(?:.*\.)?model\.)(?:.*\.)?logit_scale$", r"^(?!(?:.*\.)?model\.)(?:.*\.)?logit_bias$"]
    )
    (cli,) = CachedLossArgumentParser().parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "o"), "--loss", "sigmoid", "--siglip_bias", "-3", "--learnable"]
    )
    assert cli.loss == "siglip" and cli.siglip_bias == -3.0 and cli.learnable is True
    with pytest.raises(ValueError, match="siglip_bias does not apply to loss='clip'"):
        CachedLossArgumentParser().parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path / "o"), "--loss", "clip", "--siglip_bias", "-3"]
        )
    with pytest.raises(ValueError, match="it learns its scale with learnable"):
        CachedLossArgumentParser().parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path / "o"), "--loss", "siglip", "--learnable_scale"]
        )


def test_trainer_learns_saves_logs_and_cards_the_scale_and_bias(tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    from st_cached_losses import CachedLossTrainingArguments, LossStateCallback, build_loss
    from st_cached_losses.config.model_card import add_training_section
    from st_cached_losses.losses.callbacks import STATE_FILE, STATE_KEY

    model = make_tiny_model(tmp_path / "bert")
    data = Dataset.from_dict({"anchor": random_texts(16, seed=1), "positive": random_texts(16, seed=2)})
    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path / "out"),
        loss="siglip",
        learnable=True,
        mini_batch_size=4,
        per_device_train_batch_size=8,
        num_train_epochs=1,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        scale_learning_rate=0.1,
    )
    loss = build_loss(model, args, train_dataset=data)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data, loss=loss, callbacks=[LossStateCallback(loss)]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "no LossStateCallback" in str(w.message)]  # the callback is there
    assert loss.scale != pytest.approx(10.0) and loss.bias != pytest.approx(-10.0)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("scale" in e and "bias" in e for e in logged)
    assert logged[-1]["bias"] == pytest.approx(loss.bias)
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / STATE_FILE, weights_only=True)
    assert set(saved) == {"0", "0/logit_bias"}
    assert float(saved["0/logit_bias"]) == pytest.approx(loss.bias)
    assert trainer.state.stateful_callbacks[STATE_KEY]["0/logit_bias"] == pytest.approx(loss.bias)
    # restored from the trainer state into a fresh loss
    other = CachedSigLIPLoss(model, learnable=True)
    LossStateCallback(other).load_state_dict(saved)
    assert other.bias == pytest.approx(loss.bias) and other.scale == pytest.approx(loss.scale)
    model.save_pretrained(str(tmp_path / "model"))
    card = add_training_section(tmp_path / "model", trainer).read_text()
    assert f"scale from 10 to {loss.scale:.4g}, bias from -10 to {loss.bias:.4g}" in card
    assert "zhai2023sigmoid" in card and "equivalent-loss:" not in card


def test_a_tiny_clip_model_with_images_and_captions(tmp_path):
    """Image-text, as SigLIP trains: a random CLIP loaded by sentence-transformers (images in one column,
    captions in the other, mini-batches of 2 over 5 rows), loss and every gradient against the reference."""
    import random

    from tests.support.tiny_vlm import WORDS, make_tiny_clip, random_image

    model = make_tiny_clip(tmp_path / "clip")
    rng = random.Random(0)
    images = [random_image(rng, 8 + 4 * (i % 3)) for i in range(5)]
    captions = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) for _ in range(5)]
    feats = [model.preprocess(images), model.preprocess(captions)]
    assert feats[0]["modality"] == "image" and feats[1]["modality"] == "text"
    loss = CachedSigLIPLoss(model, 10.0, -10.0, True, mini_batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ours_step(model, loss, feats)
    assert_step_equal(ours, reference_step(model, feats, 10.0, -10.0))
    vision = [p.grad for n, p in model.named_parameters() if "vision_model" in n and p.grad is not None]
    assert vision and any(g.abs().max() > 0 for g in vision), "the image tower must get gradients"


@pytest.fixture
def global_precision():
    """torch's global float32 matmul precision, set by the test and restored."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_matmul_precision_is_honoured_and_listed(model, global_precision):
    """Issue 58: the loss took matmul_precision and ignored it ("medium" bit for bit "highest", the config
    without it) and its products followed torch's global precision even when told "highest". Now "highest" is
    the default path bit for bit (under the global "highest"), also under a global "medium"; "medium" rounds
    the products to bf16 (a difference of bf16's size from the fp32 path, which is within 1e-5 of the fp64
    reference); "high" on a CPU is fp32; the config lists it when changed and rebuilds it."""
    feats = columns(model, 3, seed=7)
    ref = reference_step(model, feats, 10.0, -10.0)

    def step(**kw):
        loss = CachedSigLIPLoss(model, 10.0, -10.0, True, 4, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ours_step(model, loss, feats)

    global_precision("highest")
    default = step()
    assert_step_equal(default, ref)
    global_precision("medium")
    for precision in ("highest", "high"):
        pinned = step(matmul_precision=precision)
        assert pinned["loss"] == default["loss"] and torch.equal(pinned["grads"], default["grads"])
        assert (pinned["logit_scale"], pinned["logit_bias"]) == (
            default["logit_scale"],
            default["logit_bias"],
        )
    # the tiny model's products are too small for torch's bf16 CPU path to touch them; rows of 48 dimensions
    # are not: there "highest" holds fp32 under a global "medium" (which alone moves the loss's gradients)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(300, 48, generator=g).requires_grad_() for _ in range(3)]

    def loss_and_grads(**kw):
        value = CachedSigLIPLoss(model, **kw).compute_loss_from_embeddings(rows)
        return value.detach(), torch.autograd.grad(value, rows)

    global_precision("highest")
    exact = loss_and_grads()
    global_precision("medium")
    pinned_rows = loss_and_grads(matmul_precision="highest")
    assert torch.equal(pinned_rows[0], exact[0]) and all(map(torch.equal, pinned_rows[1], exact[1]))
    moved = loss_and_grads()  # None: torch's global precision, read at the step
    assert not all(map(torch.equal, moved[1], exact[1]))
    global_precision("highest")
    medium = step(matmul_precision="medium")
    assert not torch.equal(medium["grads"], default["grads"])
    error = float((medium["grads"] - ref["grads"]).norm() / ref["grads"].norm())
    exact_error = float((default["grads"] - ref["grads"]).norm() / ref["grads"].norm())
    assert exact_error < 1e-5 and 1e-4 < error < 5e-2, (exact_error, error)
    assert medium["loss"] == pytest.approx(ref["loss"], rel=1e-2)
    loss = CachedSigLIPLoss(model, mini_batch_size=4, matmul_precision="medium")
    config = loss.get_config_dict()
    assert config["matmul_precision"] == "medium" and loss.stage.plan.matmul_precision == "medium"
    assert CachedSigLIPLoss(model, **config).get_config_dict() == config
    assert "matmul_precision" not in CachedSigLIPLoss(model, mini_batch_size=4).get_config_dict()
    with pytest.raises(ValueError, match="matmul_precision"):
        CachedSigLIPLoss(model, matmul_precision="bf16")
