"""The losses in the stock SentenceTransformerTrainer: a few steps each with the features users combine
(Matryoshka, prompts, Router, bf16, gradient checkpointing, accumulation, evaluation, NO_DUPLICATES,
a dict of losses, a learnable scale across resume_from_checkpoint) and the model card."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.sampler import BatchSamplers
from sentence_transformers.sentence_transformer import losses as st_losses
from transformers import TrainerCallback

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss
from st_cached_losses.losses.callbacks import STATE_FILE
from tests.support.tiny_model import make_tiny_model, random_texts

LOSSES = {"mnr": CachedMNRLoss, "clip": CachedCLIPLoss}


def make_dataset(n: int, n_cols: int = 2, seed: int = 0) -> Dataset:
    names = ["anchor", "positive"] + [f"negative_{i}" for i in range(n_cols - 2)]
    return Dataset.from_dict({name: random_texts(n, seed=seed + 17 * k) for k, name in enumerate(names)})


def make_args(out: Path, **kwargs) -> SentenceTransformerTrainingArguments:
    defaults = {
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "disable_tqdm": True,
        "dataloader_drop_last": True,
    }
    defaults.update(kwargs)
    return SentenceTransformerTrainingArguments(**defaults)


def train_losses(trainer: SentenceTransformerTrainer) -> list[float]:
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", list(LOSSES))
def test_training_with_eval_and_model_card(tmp_path, name):
    model = make_tiny_model(tmp_path / "model")
    loss = LOSSES[name](model, mini_batch_size=3)
    trainer = SentenceTransformerTrainer(
        model=model,
        args=make_args(tmp_path / "out", eval_strategy="steps", eval_steps=2),
        train_dataset=make_dataset(32),
        eval_dataset=make_dataset(16, seed=5),
        loss=loss,
    )
    before = flat_params(model).clone()
    losses = train_losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, flat_params(model)), "training must change the parameters"
    evals = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    assert evals and all(v > 0 for v in evals)

    model.save_pretrained(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert type(loss).__name__ in card
    assert '"mini_batch_size": 3' in card
    assert "gao2021scaling" in card
    if name == "clip":
        assert "radford2021learning" in card
    else:
        assert "henderson2017efficient" in card


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_matches_non_cached_loss_step_by_step(tmp_path, accumulation):
    """Same data, same seed, dropout 0: our cached loss trains exactly like sentence-transformers'
    MultipleNegativesRankingLoss (per-step losses and final parameters), with gradient accumulation."""
    results = []
    for which in ("ours", "theirs"):
        model = make_tiny_model(tmp_path / which)
        loss = (
            CachedMNRLoss(model, mini_batch_size=3)
            if which == "ours"
            else st_losses.MultipleNegativesRankingLoss(model)
        )
        args = make_args(tmp_path / f"out_{which}", gradient_accumulation_steps=accumulation, max_steps=3)
        trainer = SentenceTransformerTrainer(
            model=model, args=args, train_dataset=make_dataset(64), loss=loss
        )
        results.append((train_losses(trainer), flat_params(model)))
    (ours, p_ours), (theirs, p_theirs) = results
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)
    # the updates, with one tolerance over the whole vector: Adam divides by the root of the squared
    # gradient, so an analytically zero gradient (BERT's attention key bias) turns rounding noise into
    # an update of the learning rate's size, in either implementation
    p_init = flat_params(make_tiny_model(tmp_path / "init"))
    ours_update, theirs_update = p_ours - p_init, p_theirs - p_init
    assert theirs_update.abs().max() > 0
    rel = ((ours_update - theirs_update).norm() / theirs_update.norm()).item()
    assert rel < 1e-3, f"relative difference of the parameter updates {rel:.2e}"


def test_matryoshka_wrapping_matches_non_cached(tmp_path):
    feats_texts = [random_texts(10, seed=s) for s in (1, 2, 3)]
    grads = []
    for cached in (True, False):
        model = make_tiny_model(tmp_path / f"m{cached}")
        inner = (
            CachedMNRLoss(model, mini_batch_size=4)
            if cached
            else st_losses.MultipleNegativesRankingLoss(model)
        )
        loss = st_losses.MatryoshkaLoss(model, inner, matryoshka_dims=[32, 16, 8])
        model.zero_grad()
        value = loss([model.preprocess(t) for t in feats_texts], None)
        value.backward()
        grads.append(
            (value.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        )
    (v_ours, g_ours), (v_ref, g_ref) = grads
    torch.testing.assert_close(v_ours, v_ref, rtol=1e-5, atol=1e-6)
    assert g_ref.abs().max() > 0
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-5 * g_ref.abs().max().item())
    # and inside the trainer
    model = make_tiny_model(tmp_path / "trained")
    loss = st_losses.MatryoshkaLoss(model, CachedCLIPLoss(model, mini_batch_size=3), matryoshka_dims=[32, 8])
    trainer = SentenceTransformerTrainer(
        model=model, args=make_args(tmp_path / "out"), train_dataset=make_dataset(32), loss=loss
    )
    assert len(train_losses(trainer)) == 3


@pytest.mark.filterwarnings("ignore:CachedCLIPLoss trains a learnable scale")
def test_matryoshka_weights_the_learnable_scale_gradient(tmp_path):
    """Inside MatryoshkaLoss, a learnable scale's gradient is the weighted sum over dimensions, like the
    embeddings' (dense reference with autograd on the same logit_scale)."""
    from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

    from tests.support.reference import reference_infonce

    feats_texts = [random_texts(10, seed=s) for s in (4, 5)]
    dims, weights = [32, 16, 8], [1.0, 0.5, 0.25]
    model = make_tiny_model(tmp_path / "m")
    inner = CachedCLIPLoss(model, scale=10.0, learnable_scale=True, mini_batch_size=3)
    loss = st_losses.MatryoshkaLoss(model, inner, matryoshka_dims=dims, matryoshka_weights=weights)
    value = loss([model.preprocess(t) for t in feats_texts], None)
    value.backward()
    ours_scale = inner.logit_scale.grad.clone()
    ours_params = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    model.zero_grad()
    logit_scale = torch.nn.Parameter(torch.tensor(10.0).log())
    embs = [model(model.preprocess(t))["sentence_embedding"] for t in feats_texts]
    ref = sum(
        w
        * reference_infonce(shrink(embs[0], d), [shrink(embs[1], d)], scale=logit_scale.exp(), symmetric=True)
        for d, w in zip(dims, weights)
    )
    ref.backward()
    ref_params = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(value.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert logit_scale.grad.abs() > 1e-4  # a gradient worth comparing
    torch.testing.assert_close(ours_scale, logit_scale.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours_params, ref_params, rtol=1e-4, atol=1e-5 * ref_params.abs().max().item())


@pytest.mark.parametrize(
    "options",
    [
        {"prompts": {"anchor": "query: ", "positive": "passage: "}},
        {"bf16": True},
        {"gradient_checkpointing": True},
        {"batch_sampler": BatchSamplers.NO_DUPLICATES},
    ],
    ids=["prompts", "bf16", "gradient_checkpointing", "no_duplicates"],
)
def test_trainer_options(tmp_path, options):
    model = make_tiny_model(tmp_path / "model")
    loss = CachedMNRLoss(model, mini_batch_size=3, show_progress_bar=True)
    args = make_args(tmp_path / "out", **options)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=make_dataset(40, n_cols=3), loss=loss
    )
    losses = train_losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_bf16_autocast_replay_is_exact(tmp_path):
    """Under CPU bf16 autocast the replayed forwards run under the same autocast as stage 1 (else the
    cached gradients would meet differently rounded activations) and the cache stays fp32."""
    model = make_tiny_model(tmp_path / "m")
    texts = [random_texts(10, seed=s) for s in (1, 2)]
    grads = []
    for mb in (4, 64):  # cached vs a single mini-batch (no caching)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = CachedMNRLoss(model, mini_batch_size=mb, sort_by_length=False)(
                [model.preprocess(t) for t in texts]
            )
        assert value.dtype == torch.float32
        value.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[1].abs().max() > 0
    rel = (grads[0] - grads[1]).norm() / grads[1].norm()
    assert rel < 2e-2, f"bf16 cached vs uncached relative gradient error {rel:.2e}"


def test_router_model_in_trainer(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Router

    q = make_tiny_model(tmp_path / "q", seed=1)[0]
    d = make_tiny_model(tmp_path / "d", seed=2)[0]
    router = Router.for_query_document(query_modules=[q], document_modules=[d])
    model = SentenceTransformer(modules=[router, Pooling(q.get_embedding_dimension())], device="cpu")
    args = make_args(tmp_path / "out", router_mapping={"anchor": "query", "positive": "document"})
    loss = CachedCLIPLoss(model, mini_batch_size=3)
    q_before = torch.cat([p.detach().flatten().clone() for p in q.parameters()])
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=make_dataset(32), loss=loss)
    assert len(train_losses(trainer)) == 3
    assert not torch.equal(q_before, torch.cat([p.detach().flatten() for p in q.parameters()]))


def test_dict_of_losses(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    loss = {
        "pairs": CachedMNRLoss(model, mini_batch_size=3),
        "triplets": CachedCLIPLoss(model, mini_batch_size=3),
    }
    train = DatasetDict({"pairs": make_dataset(24), "triplets": make_dataset(24, n_cols=3, seed=3)})
    trainer = SentenceTransformerTrainer(
        model=model, args=make_args(tmp_path / "out", max_steps=4), train_dataset=train, loss=loss
    )
    assert len(train_losses(trainer)) == 4


def test_learnable_scale_is_trained_logged_saved_and_resumed(tmp_path):
    from st_cached_losses import LossStateCallback

    class StopAt(TrainerCallback):
        """Interrupts training after a step, as a crash would, with the schedule of the full run."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= self.step:
                control.should_training_stop = True

    def run(out: Path, stop_at: int | None = None, resume: bool = False):
        model = make_tiny_model(tmp_path / f"model_{out.name}")
        loss = CachedCLIPLoss(model, scale=10.0, learnable_scale=True, mini_batch_size=3)
        args = make_args(out, max_steps=4, learning_rate=5e-2, save_strategy="steps", save_steps=2)
        callbacks = [LossStateCallback(loss)] + ([StopAt(stop_at)] if stop_at else [])
        trainer = SentenceTransformerTrainer(
            model=model, args=args, train_dataset=make_dataset(64), loss=loss, callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=resume or None)
        return trainer, loss, model

    full_trainer, full_loss, full_model = run(tmp_path / "full")
    assert full_loss.scale != pytest.approx(10.0), "the optimizer must update the scale"
    logged = [log["scale"] for log in full_trainer.state.log_history if "loss" in log]
    assert len(logged) == 4 and logged[-1] == pytest.approx(full_loss.scale)

    out = tmp_path / "interrupted"
    _, stopped_loss, _ = run(out, stop_at=2)
    assert (out / "checkpoint-2" / STATE_FILE).is_file()
    assert stopped_loss.scale != pytest.approx(full_loss.scale)
    _, resumed_loss, resumed_model = run(out, resume=True)
    assert resumed_loss.scale == pytest.approx(full_loss.scale, rel=1e-5)
    torch.testing.assert_close(flat_params(resumed_model), flat_params(full_model), rtol=1e-5, atol=1e-6)


def test_learnable_scale_is_clamped(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    loss = CachedCLIPLoss(model, scale=50.0, learnable_scale=True, max_scale=60.0)
    with torch.no_grad():
        loss.logit_scale.fill_(10.0)
    assert loss.scale == 60.0
    with pytest.raises(ValueError, match="max_scale"):
        CachedCLIPLoss(model, scale=50.0, learnable_scale=True, max_scale=40.0)


def test_one_column_dataset_fails_with_clear_message(tmp_path, caplog):
    model = make_tiny_model(tmp_path / "model")
    data = Dataset.from_dict({"anchor": random_texts(16, seed=0)})
    trainer = SentenceTransformerTrainer(
        model=model, args=make_args(tmp_path / "out"), train_dataset=data, loss=CachedMNRLoss(model)
    )
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="at least two text columns"):
        trainer.train()


def test_config_dict_is_json(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    config = CachedCLIPLoss(model, learnable_scale=True, mini_batch_num_tokens=512).get_config_dict()
    assert json.loads(json.dumps(config)) == config
    assert config["learnable_scale"] is True and config["mini_batch_num_tokens"] == 512


# ---------------------------------------------------------------- resuming the learnable scale elsewhere


class _StopAt(TrainerCallback):
    """Interrupts training after a step, as a crash would, with the schedule of the full run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _scale_run(
    out: Path,
    *,
    stop_at: int | None = None,
    resume: Path | None = None,
    callback: bool = True,
    model=None,
    loss=None,
):
    """A 4-step run with a learnable scale saving at steps 2 and 4 (the scale moves enough to tell a
    restored scale from a restarted one), optionally interrupted, resumed, or without the callback."""
    from st_cached_losses import LossStateCallback

    model = model if model is not None else make_tiny_model(out.parent / f"model_{out.name}")
    if loss is None:
        loss = CachedCLIPLoss(model, scale=10.0, learnable_scale=True, mini_batch_size=3)
    args = make_args(out, max_steps=4, learning_rate=5e-2, save_strategy="steps", save_steps=2)
    callbacks = ([_StopAt(stop_at)] if stop_at else []) + ([LossStateCallback(loss)] if callback else [])
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=make_dataset(64), loss=loss, callbacks=callbacks or None
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer, loss, model


def _strip_state_entry(checkpoint: Path) -> None:
    """Make ``checkpoint`` look saved by an earlier st_cached_losses: no scale in trainer_state.json."""
    from st_cached_losses.losses.callbacks import STATE_KEY

    path = checkpoint / "trainer_state.json"
    state = json.loads(path.read_text())
    del state["stateful_callbacks"][STATE_KEY]
    path.write_text(json.dumps(state))


@pytest.fixture(scope="module")
def scale_runs(tmp_path_factory):
    """An uninterrupted run and one interrupted after step 2, both saving checkpoint-2; the resume tests
    compare with the first."""
    root = tmp_path_factory.mktemp("scale_runs")
    _, full_loss, full_model = _scale_run(root / "full")
    _, stopped_loss, _ = _scale_run(root / "stopped", stop_at=2)
    assert full_loss.scale != pytest.approx(10.0) and stopped_loss.scale != pytest.approx(full_loss.scale)
    return {
        "root": root,
        "scale": full_loss.scale,
        "params": flat_params(full_model).clone(),
        "full_checkpoint": root / "full" / "checkpoint-2",
        "stopped_checkpoint": root / "stopped" / "checkpoint-2",
    }


def _assert_matches_uninterrupted(scale_runs, loss, model) -> None:
    assert loss.scale == pytest.approx(scale_runs["scale"], rel=1e-6)
    torch.testing.assert_close(flat_params(model), scale_runs["params"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("source", ["full_checkpoint", "stopped_checkpoint"])
def test_learnable_scale_resumes_from_a_checkpoint_in_another_folder(tmp_path, scale_runs, source):
    """Resuming from another run's checkpoint-2 with an explicit LossStateCallback restores the scale from
    that checkpoint (the callback once looked in its own output_dir/checkpoint-2 and restored none)."""
    from st_cached_losses import LossStateCallback

    out = tmp_path / "resumed"
    trainer, loss, model = _scale_run(out, resume=scale_runs[source])
    assert not (out / "checkpoint-2").exists(), "the scale cannot have come from output_dir"
    assert sum(isinstance(cb, LossStateCallback) for cb in trainer.callback_handler.callbacks) == 1
    _assert_matches_uninterrupted(scale_runs, loss, model)
    # the resumed run's own checkpoint carries the scale on
    assert (out / "checkpoint-4" / STATE_FILE).is_file()
    logged = [log["scale"] for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 4 and logged[-1] == pytest.approx(loss.scale)


def test_same_loss_handed_to_a_second_trainer_resumes_its_scale(tmp_path, scale_runs):
    """A notebook resume: the interrupted run's model and loss given to a new trainer with a new
    callback, which restores the checkpoint's scale over whatever the loss holds."""
    _, loss, model = _scale_run(tmp_path / "first", stop_at=2)
    with torch.no_grad():
        loss.logit_scale.fill_(torch.tensor(10.0).log())
    _scale_run(tmp_path / "second", resume=tmp_path / "first" / "checkpoint-2", model=model, loss=loss)
    _assert_matches_uninterrupted(scale_runs, loss, model)


def test_learnable_scale_without_the_callback_warns_once_and_is_not_saved(tmp_path):
    """No frame walking: a trainer built without LossStateCallback does not get one behind its back. The
    loss says once, naming the missing argument, that its scale is neither saved nor restored; a later
    trainer with the callback saves it, and a third one without it warns again (the callback is active
    only during its own run)."""
    import warnings as _warnings

    from st_cached_losses import LossStateCallback

    def unsaved_warnings(record):
        return [w for w in record if "no LossStateCallback covering it is active" in str(w.message)]

    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        trainer, loss, model = _scale_run(tmp_path / "bare", callback=False)
    assert len(unsaved_warnings(record)) == 1, "once per loss, not once per step"
    message = str(unsaved_warnings(record)[0].message)
    assert "CachedCLIPLoss" in message and "callbacks=[LossStateCallback(loss)]" in message
    assert unsaved_warnings(record)[0].filename.endswith("trainer.py"), "points at the line calling the loss"
    assert not any(isinstance(cb, LossStateCallback) for cb in trainer.callback_handler.callbacks)
    assert not (tmp_path / "bare" / "checkpoint-2" / STATE_FILE).exists()
    assert "scale" not in trainer.state.log_history[0]

    from st_cached_losses.losses import callbacks as callbacks_module

    callbacks_module._WARNED.discard(loss)
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        _scale_run(tmp_path / "with", model=model, loss=loss)
    assert not unsaved_warnings(record)
    assert (tmp_path / "with" / "checkpoint-2" / STATE_FILE).is_file()
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        _scale_run(tmp_path / "again", model=model, loss=loss, callback=False)
    assert len(unsaved_warnings(record)) == 1


def test_resume_without_saved_scale_warns_and_old_checkpoints_are_read(tmp_path, scale_runs, caplog):
    """A checkpoint without the trainer-state entry (as saved by an earlier st_cached_losses) is read
    from its scale file when it is provably the resumed one (output_dir/checkpoint-<step>); else the
    run warns, naming the step, rather than restarting the scale silently, and another run's
    checkpoint-2 in output_dir is not mistaken for it."""
    import shutil

    # the old layout, resumed in place
    legacy = tmp_path / "legacy"
    shutil.copytree(scale_runs["stopped_checkpoint"], legacy / "checkpoint-2")
    _strip_state_entry(legacy / "checkpoint-2")
    with caplog.at_level(logging.WARNING, logger="st_cached_losses"):
        _, loss, model = _scale_run(legacy, resume=legacy / "checkpoint-2")
    assert not [r for r in caplog.records if "holds no learnable scale" in r.getMessage()]
    _assert_matches_uninterrupted(scale_runs, loss, model)

    # no scale anywhere, and a decoy of another run at output_dir/checkpoint-2
    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(scale_runs["stopped_checkpoint"], bare)
    _strip_state_entry(bare)
    (bare / STATE_FILE).unlink()
    decoy = tmp_path / "other" / "checkpoint-2"
    shutil.copytree(scale_runs["full_checkpoint"], decoy)
    decoy_state = json.loads((decoy / "trainer_state.json").read_text())
    decoy_state["log_history"][0]["loss"] += 1.0
    (decoy / "trainer_state.json").write_text(json.dumps(decoy_state))
    torch.save({"0": torch.tensor(3.0).log()}, decoy / STATE_FILE)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="st_cached_losses"):
        _, loss, _ = _scale_run(tmp_path / "other", resume=bare)
    warnings = [r.getMessage() for r in caplog.records if "holds no learnable scale" in r.getMessage()]
    assert len(warnings) == 1 and "resumed at step 2" in warnings[0] and "logit_scale" in warnings[0]
    assert loss.scale != pytest.approx(scale_runs["scale"], rel=1e-3)
    assert loss.scale > 5.0, "the decoy's scale (3.0) must not be restored"
