"""The losses' negative bank (``negative_bank_size``) on a tiny random BERT: size 0 is the loss without the
option bit for bit (and so is a bank's first, empty step); with entries, the loss and the parameter
gradients equal the naive reference that concatenates the stored embeddings as extra negative columns;
the bank keeps the newest rows, never a step's own; the max-age rule; the settings' checks."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.losses.negative_bank import NegativeBank
from tests.losses.test_losses import assert_grads_close, columns, flat_grads
from tests.support.reference import reference_infonce
from tests.support.tiny_model import make_tiny_model

B = 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def _step(model, loss_fn, features):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features, None)
    loss.backward()
    return loss.detach(), flat_grads(model).clone()


def _embed(model, features):
    return [model(dict(f))["sentence_embedding"] for f in features]


LOSSES = [(CachedMNRLoss, {}), (CachedCLIPLoss, {}), (CachedTiledLoss, {"tile_size": 3})]


@pytest.mark.parametrize(("cls", "kw"), LOSSES, ids=["mnr", "clip", "tiled"])
def test_size_zero_and_the_first_step_are_bit_identical(model, cls, kw):
    plain = cls(model, mini_batch_size=3, **kw)
    zero = cls(model, mini_batch_size=3, negative_bank_size=0, **kw)
    banked = cls(model, mini_batch_size=3, negative_bank_size=16, **kw)
    for seed in (0, 1):  # the bank's first step is empty: no term is added
        feats = columns(model, 3, B, seed=seed)
        loss, grads = _step(model, plain, feats)
        loss0, grads0 = _step(model, zero, feats)
        assert torch.equal(loss, loss0) and torch.equal(grads, grads0)
        if seed == 0:
            loss1, grads1 = _step(model, banked, feats)
            assert torch.equal(loss, loss1) and torch.equal(grads, grads1)
    assert zero.negative_bank.stats()["negative_bank_rows"] == 0
    assert zero.get_config_dict() == plain.get_config_dict()
    assert plain.citation == zero.citation != banked.citation


@pytest.mark.parametrize(
    ("cls", "kw", "symmetric", "size"),
    [
        (CachedMNRLoss, {}, False, 5),
        (CachedCLIPLoss, {}, True, 100),
        (CachedTiledLoss, {"tile_size": 3}, True, 9),
    ],
    ids=["mnr-5", "clip-100", "tiled-sym-9"],
)
def test_bank_equals_extra_negative_columns(model, cls, kw, symmetric, size):
    """Three steps (no optimizer step between them, so the stored embeddings are the model's): the third
    scores the newest ``size`` candidate rows of the first two (row by row: a row's positive, then its
    hard negative) and, symmetric, their newest ``size`` anchors."""
    if cls is CachedTiledLoss:
        kw = {**kw, "symmetric": True}
    loss_fn = cls(model, mini_batch_size=3, negative_bank_size=size, **kw)
    steps = [columns(model, 3, B, seed=s) for s in (0, 1, 2)]
    for feats in steps[:2]:
        _step(model, loss_fn, feats)
    with torch.no_grad():
        past = [_embed(model, f) for f in steps[:2]]
    cands = torch.cat([torch.stack(e[1:], dim=1).flatten(0, 1) for e in past])[-size:]
    anchors = torch.cat([e[0] for e in past])[-size:]
    assert loss_fn.negative_bank.stats()["negative_bank_rows"] == min(size, 2 * 2 * B)
    loss, grads = _step(model, loss_fn, steps[2])

    def reference(features):
        e = _embed(model, features)
        return reference_infonce(
            e[0],
            e[1:],
            symmetric=symmetric,
            bank_candidates=cands,
            bank_anchors=anchors if symmetric else None,
        )

    model.zero_grad(set_to_none=True)
    ref_loss = reference(steps[2])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, flat_grads(model))
    # not vacuous: the bank changes the loss
    plain = reference_infonce(*(lambda e: (e[0], e[1:]))(_embed(model, steps[2])), symmetric=symmetric)
    assert abs(float(plain.detach()) - float(ref_loss.detach())) > 1e-3


def test_evaluation_neither_reads_nor_fills_the_bank(model):
    loss_fn = CachedMNRLoss(model, mini_batch_size=3, negative_bank_size=50)
    plain = CachedMNRLoss(model, mini_batch_size=3)
    _step(model, loss_fn, columns(model, 2, B, seed=0))
    held = loss_fn.negative_bank.stats()
    feats = columns(model, 2, B, seed=1)
    with torch.no_grad():
        assert torch.equal(loss_fn(feats, None), plain(feats, None))
    assert loss_fn.negative_bank.stats() == held


def test_max_age_drops_entries_of_an_older_model():
    """Entries added at step t have age 1 at step t + 1; those older than max_age are dropped when a step
    begins, before it scores; the size keeps the newest."""
    bank = NegativeBank(size=10, max_age=2)
    d = 4
    for step in range(1, 5):
        bank.begin_step()
        view = bank.view(torch.zeros(1, d), with_anchors=False)
        # at step s the bank holds the rows of steps s - 2 and s - 1 (3 rows each: 1 row x 3 columns)
        assert view.candidates.shape[0] == 3 * min(step - 1, 2)
        if step > 1:
            assert set(view.candidates[:, 0].tolist()) == {float(s) for s in range(max(1, step - 2), step)}
        rows = torch.full((1, d), float(step))
        bank.push(rows, [rows, rows, rows], with_anchors=False)
    stats = bank.stats()  # steps 2, 3 and 4 (ages 2, 1 and 0): nothing expires until a step begins
    assert (stats["negative_bank_rows"], stats["negative_bank_oldest"], stats["negative_bank_age"]) == (
        9,
        2,
        1,
    )
    bank.begin_step()  # step 5: step 2's rows are 3 steps old
    assert (bank.stats()["negative_bank_rows"], bank.stats()["negative_bank_age"]) == (6, 1.5)
    bank.begin_step()
    bank.begin_step()
    assert bank.stats()["negative_bank_rows"] == 0  # the model moved on: every entry is stale
    small = NegativeBank(size=2)
    small.push(torch.zeros(3, d), [torch.arange(3.0)[:, None].expand(3, d)], with_anchors=True)
    assert small.view(torch.zeros(1, d), True).candidates[:, 0].tolist() == [1.0, 2.0]
    assert small.view(torch.zeros(1, d), True).anchors.shape == (2, d)
    assert small.view(torch.zeros(1, 3), True).candidates.shape == (0, 3)  # another width: a bank of its own


def test_max_age_through_the_loss(model):
    loss_fn = CachedMNRLoss(model, mini_batch_size=3, negative_bank_size=1000, negative_bank_max_age=1)
    for seed in range(3):
        _step(model, loss_fn, columns(model, 2, B, seed=seed))
        # a step scores the previous step's rows only, then adds its own
        assert loss_fn.negative_bank.stats()["negative_bank_rows"] == (B if seed == 0 else 2 * B)
    loss_fn.negative_bank_max_age = None
    assert loss_fn.negative_bank.max_age is None
    loss_fn.negative_bank_size = 3
    assert loss_fn.negative_bank.stats()["negative_bank_rows"] == 3
    loss_fn.negative_bank_size = 0
    assert loss_fn.negative_bank.stats()["negative_bank_rows"] == 0


def test_state_dict_round_trip(model):
    """The bank is in the loss's state dict (its module's extra state, issue 51): a loss loaded from another's
    state dict scores the same negatives; a state dict without it (saved before the bank was there) loads
    strictly, the bank as it is."""
    loss_fn = CachedCLIPLoss(model, mini_batch_size=3, negative_bank_size=9)
    for seed in range(2):
        _step(model, loss_fn, columns(model, 2, B, seed=seed))
    state = loss_fn.state_dict()
    assert "negative_bank._extra_state" in state
    assert state["negative_bank._extra_state"]["step"] == 2
    other = CachedCLIPLoss(model, mini_batch_size=3, negative_bank_size=9)
    other.load_state_dict(state)
    assert other.negative_bank.stats() == loss_fn.negative_bank.stats()
    feats = columns(model, 2, B, seed=5)
    assert torch.equal(_step(model, loss_fn, feats)[1], _step(model, other, feats)[1])
    older = {k: v for k, v in state.items() if k != "negative_bank._extra_state"}
    fresh = CachedCLIPLoss(model, mini_batch_size=3, negative_bank_size=9)
    fresh.load_state_dict(older)  # strict: no missing key
    assert fresh.negative_bank.stats()["negative_bank_rows"] == 0


def test_settings_are_checked(model):
    with pytest.raises(ValueError, match="negative_bank_size must be an integer >= 0"):
        CachedMNRLoss(model, negative_bank_size=-1)
    with pytest.raises(ValueError, match="negative_bank_max_age must be a positive integer"):
        CachedMNRLoss(model, negative_bank_size=4, negative_bank_max_age=0)
    with pytest.raises(ValueError, match="cannot be used together"):
        CachedMNRLoss(model, negative_bank_size=4, mask_duplicates=True)
    loss_fn = CachedMNRLoss(model, mask_duplicates=True)
    with pytest.raises(ValueError, match="cannot be used together"):
        loss_fn.negative_bank_size = 4
    with pytest.raises(ValueError, match="in_batch_negatives=False cannot be used together"):
        CachedMNRLoss(model, negative_bank_size=4, in_batch_negatives=False)
    loss_fn = CachedMNRLoss(model, negative_bank_size=4)
    with pytest.raises(ValueError, match="in_batch_negatives=False cannot be used together"):
        loss_fn.in_batch_negatives = False
    config = CachedCLIPLoss(model, negative_bank_size=4, negative_bank_max_age=2).get_config_dict()
    assert config["negative_bank_size"] == 4 and config["negative_bank_max_age"] == 2


def test_trainer_checkpoint_and_resume_restore_the_bank(tmp_path, caplog):
    """An interrupted run resumed from its checkpoint equals the uninterrupted one (parameters and the
    bank), the bank's size and age are logged; a checkpoint without the bank file resumes with an empty
    bank and a warning."""
    from sentence_transformers import SentenceTransformerTrainer
    from transformers import TrainerCallback

    from st_cached_losses import LossStateCallback
    from st_cached_losses.losses.callbacks import BANK_FILE
    from tests.losses.test_trainer import flat_params, make_args, make_dataset

    class StopAt(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= self.step:
                control.should_training_stop = True

    def run(out, stop_at=None, resume=False):
        model = make_tiny_model(tmp_path / f"model_{out.name}", dropout=0.0)
        loss = CachedCLIPLoss(model, mini_batch_size=3, negative_bank_size=12, negative_bank_max_age=3)
        args = make_args(out, max_steps=4, learning_rate=5e-2, save_strategy="steps", save_steps=2)
        callbacks = [LossStateCallback(loss)] + ([StopAt(stop_at)] if stop_at else [])
        trainer = SentenceTransformerTrainer(
            model=model, args=args, train_dataset=make_dataset(64), loss=loss, callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=resume or None)
        return trainer, loss, model

    full_trainer, full_loss, full_model = run(tmp_path / "full")
    logs = [log for log in full_trainer.state.log_history if "loss" in log]
    assert [log["negative_bank_rows"] for log in logs] == [8, 12, 12, 12]  # after each step: 8 rows a step
    assert logs[-1]["negative_bank_oldest"] == 1.0  # the newest 12 of steps 3 and 4 (ages 1 and 0)
    out = tmp_path / "interrupted"
    run(out, stop_at=2)
    assert (out / "checkpoint-2" / BANK_FILE.format(0)).is_file()
    _, resumed_loss, resumed_model = run(out, resume=True)
    torch.testing.assert_close(flat_params(resumed_model), flat_params(full_model), rtol=1e-5, atol=1e-6)
    assert resumed_loss.negative_bank.stats() == full_loss.negative_bank.stats()
    for a, b in zip(
        resumed_loss.negative_bank.get_extra_state()["entries"].values(),
        full_loss.negative_bank.get_extra_state()["entries"].values(),
    ):
        torch.testing.assert_close(a["rows"], b["rows"], rtol=1e-5, atol=1e-6)
        assert torch.equal(a["added"], b["added"])
    # without the bank file the bank restarts empty, with a warning, and the run differs
    (out / "checkpoint-2" / BANK_FILE.format(0)).unlink()
    with caplog.at_level("WARNING", logger="st_cached_losses"):
        _, _, no_bank_model = run(out, resume=str(out / "checkpoint-2"))
    assert "holds no negative bank" in caplog.text
    assert not torch.allclose(flat_params(no_bank_model), flat_params(full_model), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mini_batch", [3, 8], ids=["cached", "one-mini-batch"])
def test_pairs_bank_equals_extra_columns_with_a_mini_batch_at_or_above_the_batch(model, mini_batch):
    """(anchor, positive) pairs only, as ``benchmarks/teacher_bank_quality.py`` trains (batch 8, mini-batch
    8: every column in one mini-batch, nothing cached): the third step scores the newest positives of the
    first two like extra negative columns, in the loss and the parameter gradients."""
    loss_fn = CachedMNRLoss(model, mini_batch_size=mini_batch, negative_bank_size=5)
    steps = [columns(model, 2, B, seed=s) for s in (0, 1, 2)]
    for feats in steps[:2]:
        _step(model, loss_fn, feats)
    with torch.no_grad():
        cands = torch.cat([_embed(model, f)[1] for f in steps[:2]])[-5:]
    loss, grads = _step(model, loss_fn, steps[2])
    model.zero_grad(set_to_none=True)
    e = _embed(model, steps[2])
    ref_loss = reference_infonce(e[0], e[1:], bank_candidates=cands)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, flat_grads(model))
    assert abs(float(reference_infonce(e[0], e[1:]).detach()) - float(ref_loss.detach())) > 1e-3
