"""What the losses say to a user who sets them up wrong (issue 45): each message names the setting and the fix,
at construction rather than at the first step, and a warning points at the user's own line."""

from __future__ import annotations

import re
import warnings

import pytest
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

from st_cached_losses import (
    CachedCLIPLoss,
    CachedCrossEncoderLoss,
    CachedGISTLoss,
    CachedMNRLoss,
    CachedSigLIPLoss,
    CachedTiledLoss,
)
from st_cached_losses.engine import caller, gradcache
from tests.support.tiny_model import make_tiny_cross_encoder, make_tiny_model, random_texts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def test_gist_without_a_guide_is_self_guided_and_a_guide_without_tokenizer_is_refused(model):
    """guide=None is self-guidance (the model's own embeddings), not an error; a module without a tokenizer
    is refused in sentence-transformers' words."""
    assert CachedGISTLoss(model, None).self_guided
    loss = CachedGISTLoss(model, model)
    loss.guide = None
    assert loss.self_guided
    with pytest.raises(ValueError, match="tokenizer attribute"):  # a module without one: their words
        CachedGISTLoss(model, model[1])


def test_auto_without_a_budget_is_refused_at_construction_off_cuda(model, monkeypatch):
    """The switching guide's promise: a bad value is refused when constructed and when set, not at the first
    step; where CUDA exists the default (half its free memory) applies."""
    monkeypatch.setattr(gradcache.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"set mini_batch_memory_budget \(e.g. '2GB'\)"):
        CachedMNRLoss(model, mini_batch_size="auto")
    with pytest.raises(ValueError, match="set mini_batch_memory_budget"):
        CachedMNRLoss(model, mini_batch_size=4, mini_batch_num_tokens="auto")
    loss = CachedMNRLoss(model, mini_batch_size=4)
    with pytest.raises(ValueError, match="set mini_batch_memory_budget"):
        loss.mini_batch_size = "auto"
    assert loss.mini_batch_size == 4  # put back
    loss.update_settings(mini_batch_size="auto", mini_batch_memory_budget="1GB")  # together: fine
    with pytest.raises(ValueError, match="set mini_batch_memory_budget"):
        loss.mini_batch_memory_budget = None
    assert loss.mini_batch_memory_budget == 10**9
    monkeypatch.setattr(gradcache.torch.cuda, "is_available", lambda: True)
    assert CachedMNRLoss(model, mini_batch_size="auto").mini_batch_size == "auto"


def test_a_budget_without_auto_is_refused_as_by_the_arguments(model, tmp_path):
    """One rule of the budget for the losses and the arguments (issue 51): without "auto" mini-batches it would
    be unused, so it is refused (the losses warned, the arguments refused, in the same words)."""
    with pytest.raises(
        ValueError, match="mini_batch_memory_budget=1000000000 sizes 'auto' mini-batches only"
    ):
        CachedMNRLoss(model, mini_batch_size=4, mini_batch_memory_budget="1GB")
    reranker = make_tiny_cross_encoder(tmp_path / "ce")
    with pytest.raises(ValueError, match="it would be unused"):
        CachedCrossEncoderLoss(reranker, mini_batch_size=4, mini_batch_memory_budget="1GB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CachedMNRLoss(model, mini_batch_size="auto", mini_batch_memory_budget="1GB")


def test_the_caching_off_warning_points_at_the_line_that_calls_train(model, tmp_path):
    """The quickstart's warning (a batch that fits in one mini-batch) comes from the loss's forward, deep in
    the trainer: it names the user's trainer.train() line, not a file of transformers or ours."""
    data = Dataset.from_dict({"anchor": random_texts(2, seed=1), "positive": random_texts(2, seed=2)})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data, loss=CachedMNRLoss(model, mini_batch_size=32)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    relevant = [w for w in caught if "caching saves no memory" in str(w.message)]
    assert len(relevant) == 1 and relevant[0].filename == __file__, relevant


def test_user_stacklevel_skips_the_libraries_but_not_the_demo():
    def warn_from(module: str) -> str:
        namespace = {"__name__": module, "warnings": warnings, "caller": caller}
        exec("def f():\n    warnings.warn('x', stacklevel=caller.user_stacklevel())\n", namespace)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            namespace["f"]()
        return caught[0].filename

    assert warn_from("st_cached_losses.losses.base") == __file__  # a library frame: skipped
    assert warn_from("torch.nn.modules.module") == __file__
    assert warn_from("st_cached_losses.demo.app") == "<string>"  # the demo is a user's code: named


def test_a_small_batch_with_a_negative_bank_does_not_say_caching_saves_no_memory(model, tmp_path):
    """The bank is for small batches (a batch of 4 pairs under a mini-batch of 32): "caching saves no memory ...
    the non-cached loss ... with the same result" would be wrong there (the non-cached loss has no bank), so
    neither the loss nor the arguments say it; without the bank both do."""
    from st_cached_losses import CachedLossTrainingArguments

    data = Dataset.from_dict({"anchor": random_texts(8, seed=1), "positive": random_texts(8, seed=2)})
    for bank in (16, 0):
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to="none"
        )
        loss = CachedMNRLoss(model, mini_batch_size=32, negative_bank_size=bank)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
            CachedLossTrainingArguments(
                output_dir=str(tmp_path), per_device_train_batch_size=4, negative_bank_size=bank
            )
        said = [
            str(w.message) for w in caught if re.search("caching (saves no memory|is off)", str(w.message))
        ]
        assert len(said) == (0 if bank else 2), said
        if bank:
            assert loss.negative_bank.stats()["negative_bank_rows"] > 0  # the bank did fill


def _caching_off_said(loss, features) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss(features, None).backward()
    return [str(w.message) for w in caught if "caching is off" in str(w.message)]


@pytest.mark.parametrize(
    ("build", "non_cached"),
    [
        (lambda m: CachedMNRLoss(m), "MultipleNegativesRankingLoss"),
        (lambda m: CachedCLIPLoss(m), "MultipleNegativesRankingLoss"),
        (lambda m: CachedTiledLoss(m), "MultipleNegativesRankingLoss"),
        (lambda m: CachedGISTLoss(m, m), "GISTEmbedLoss"),
        (lambda m: CachedSigLIPLoss(m), None),
        (lambda m: CachedSigLIPLoss(m, learnable=True), None),
        (lambda m: CachedMNRLoss(m, learnable_scale=True), None),
        (lambda m: CachedCLIPLoss(m, learnable_scale=True), None),
        (lambda m: CachedMNRLoss(m, mask_duplicates=True), None),
        (lambda m: CachedMNRLoss(m, negative_bank_size=8), None),
        (lambda m: CachedGISTLoss(m, None), None),
        (lambda m: CachedGISTLoss(m, m, learnable_scale=True), None),
    ],
    ids=[
        "mnr",
        "clip",
        "tiled",
        "gist",
        "siglip",
        "siglip-learnable",
        "mnr-learnable-scale",
        "clip-learnable-scale",
        "mnr-mask-duplicates",
        "mnr-bank",
        "gist-self-guided",
        "gist-learnable",
    ],
)
def test_the_caching_off_warning_names_the_non_cached_loss_that_gives_the_same_result(
    model, build, non_cached
):
    """Issue 58: the warning told CachedSigLIPLoss users (and those of a learnable scale) that "the non-cached
    loss" gives the same result: sentence-transformers has no sigmoid loss, and none of theirs learns its
    scale. It now names sentence-transformers' loss that does give the same result, and where there is none
    (the sigmoid loss, a learned scale, duplicate masks, a bank, self-guidance) it is not given."""
    features = [model.preprocess(random_texts(4, seed=k)) for k in range(2)]
    loss = build(model)
    said = _caching_off_said(loss, features)
    if non_cached is None:
        assert said == []
    else:
        assert len(said) == 1, said
        assert (
            f"and sentence-transformers' {non_cached} (not cached) holds no more than that one mini-batch"
            in said[0]
        )
    assert type(loss).non_cached_equivalent(loss.settings) == non_cached


def test_the_arguments_caching_off_warning_follows_the_same_rule(tmp_path):
    from st_cached_losses import CachedLossTrainingArguments

    def said(**kw) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CachedLossTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, **kw)
        return [str(w.message) for w in caught if "caching is off" in str(w.message)]

    (mnr,) = said(loss="mnr")
    assert "sentence-transformers' MultipleNegativesRankingLoss (not cached)" in mnr
    (clip,) = said(loss="clip")
    assert "MultipleNegativesRankingLoss (not cached)" in clip
    for kw in ({"loss": "siglip"}, {"loss": "mnr", "learnable_scale": True}, {"loss": "gist"}):
        assert said(**kw) == [], kw


def test_embed_distill_names_embed_distill_loss_only_for_its_pointwise_term(model):
    """``CachedEmbedDistillLoss`` equals ``EmbedDistillLoss`` on its pointwise term alone; with the listwise
    or the InfoNCE term, a pointwise weight other than 1 or a live teacher, sentence-transformers has no loss
    that gives its result."""
    from st_cached_losses import CachedEmbedDistillLoss

    settings = CachedEmbedDistillLoss.settings_class
    assert CachedEmbedDistillLoss.non_cached_equivalent(settings()) == "EmbedDistillLoss"
    for changed in ({"listwise_weight": 1.0}, {"infonce_weight": 0.5}, {"pointwise_weight": 0.5}):
        assert CachedEmbedDistillLoss.non_cached_equivalent(settings(**changed)) is None, changed
    assert CachedEmbedDistillLoss.non_cached_equivalent(settings(teacher=model)) is None
