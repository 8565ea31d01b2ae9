"""Drop-in parity with sentence-transformers 6.2's cached MNRL losses.

Part 1 runs sentence-transformers' own tests for its cached MNRL losses (``tests/sentence_transformer/losses/
test_cmnrl.py`` and ``test_cached_mnsrl.py`` of its repository) with its class names bound straight to ours:
``CachedMultipleNegativesRankingLoss = CachedMNRLoss`` and ``CachedMultipleNegativesSymmetricRankingLoss =
CachedCLIPLoss``, no argument mapping. Their bodies are unchanged except for the model: the Hub models they load
(``distilbert/distilbert-base-uncased``, the ``stsb_bert_tiny_model`` fixture) are replaced by a tiny random BERT
built offline, with a vocabulary holding the tests' words (the tests run without a network).

Left out, and why:

* ``test_cmnrl.py::test_rand_context_working``, ``test_rand_context_mps``, ``TestCreateMinibatchMixedModality``
  and ``test_rand_context_stays_importable_from_this_module``: they test sentence-transformers' private helpers
  (``RandContext``, ``_create_minibatch``, ``_get_batch_size``), not the loss class.
* ``test_cmnrl.py::test_cmnrl_gather_across_devices_offset``: it monkeypatches the private module globals
  ``all_gather_with_grad`` / ``get_rank`` of their loss's module (our cross-process path is tested with real
  process groups in ``tests/losses/test_distributed.py``).
* ``test_cmnrl.py::test_cmnrl_hyperparameters_stay_assignable``: it spies on their private inner loss
  (``loss.loss.scale``) and assigns an arbitrary ``nn.CosineSimilarity`` module, which we refuse by design (the
  loss is tiled and never calls the function; only ``cos_sim`` / ``dot_score``). Its assignments are tested below
  (:func:`test_hyperparameters_stay_assignable`).

Their test files themselves, unchanged, run with their classes and with ours in ``tests/st_upstream/`` (their
``test_cmnrl.py``, ``test_cached_mnsrl.py``, ``test_gradcache.py``, ``test_cached_gist_embed.py``,
``test_cached_splade.py`` and the multi-vector ``test_misc.py``, with its test of multimodal inputs; ``test_cmnrl_attributes_and_config_back_compat`` included, which compares configs with
``==``: ours has no key theirs lacks unless an extra of ours is in use).

Part 2 checks the behaviours users of their losses rely on: assignments after construction take effect (against their loss
after the same assignment) and are validated again, their positional order, their config keys and values,
``temperature``, ``citation``, and invalid options being refused rather than ignored.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from functools import partial

import pytest
import torch
import tqdm
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.sentence_transformer.losses import (
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score
from torch.optim import Adam
from transformers import set_seed

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.tiny_model import WORDS, make_tiny_model

# their class names, bound straight to ours
CachedMultipleNegativesRankingLoss = CachedMNRLoss
CachedMultipleNegativesSymmetricRankingLoss = CachedCLIPLoss

# every word of their tests' texts, so that the tiny tokenizer maps none of them to [UNK]
_TEXTS = """aaa bbb ccc ddd eee aas bbs ccs dds ees xxx yyy zzz kkk fff adsa czx dsada b fas xcz c asdas
anchor a b c d e f g positive negative with quite few more words in it and final sentence short also has longer
surface form p another text q r s h canary"""
VOCAB = [*dict.fromkeys([*_TEXTS.split(), *WORDS])]


@pytest.fixture(scope="module")
def _tiny(tmp_path_factory) -> SentenceTransformer:
    # hidden 128: their Matryoshka test truncates to 128, 64 and 32 dimensions
    return make_tiny_model(
        tmp_path_factory.mktemp("st_parity") / "bert", hidden=128, words=VOCAB, dropout=0.1
    )


@pytest.fixture()
def stsb_bert_tiny_model(_tiny) -> SentenceTransformer:
    """Stands in for their Hub fixture of the same name (a fresh copy per test, as theirs)."""
    from copy import deepcopy

    return deepcopy(_tiny)


# ---- their tests/sentence_transformer/losses/utils.py helpers, unchanged


def disable_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute in ("dropout_prob", "attention_dropout", "attention_probs_dropout_prob"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
    was_training = model.training
    model.train()
    features = model.preprocess(["a canary sentence", "another canary sentence"])
    with torch.no_grad():
        first, second = model(features)["sentence_embedding"], model(features)["sentence_embedding"]
    model.train(was_training)
    assert torch.equal(first, second), "dropout is still active in training mode"


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def assert_trained(grads: dict[str, torch.Tensor]) -> None:
    assert grads, "no parameter received a gradient at all"
    assert sum(grad.abs().sum() for grad in grads.values()) > 0, "every gradient is zero"


# ---------------------------------------------------------------- part 1: their tests, our classes

_SAME = [
    (q, p, n)
    for q, p, n in zip(
        ["aaa", "bbb", "ccc", "ddd", "eee"],
        ["aas", "bbs", "ccs", "dds", "ees"],
        ["xxx", "yyy", "zzz", "kkk", "fff"],
    )
]
_OTHER = [(q, p, n) for q, p, n in zip(["adsa", "czx", "dsada"], ["b", "fas", "xcz"], ["c", "yyy", "asdas"])]


@pytest.mark.parametrize(
    ["train_samples_mnrl", "train_samples_cmnrl", "same_grad", "scaler", "precision"],
    [(_SAME, _SAME, True, 1.0, 1e-5), (_OTHER, _SAME, False, 1.0, 1e-5), (_SAME, _SAME, True, 1000.0, 1e-3)],
)
def test_cmnrl_same_grad(
    stsb_bert_tiny_model,
    train_samples_mnrl: list[tuple[str, str, str]],
    train_samples_cmnrl: list[tuple[str, str, str]],
    same_grad: bool,
    scaler: float,
    precision: float,
):
    # Given:
    model = stsb_bert_tiny_model  # theirs: SentenceTransformer("distilbert/distilbert-base-uncased")
    model.to("cpu")
    optimizer = Adam(model.parameters())

    # When:
    # First run with MNRL
    set_seed(42)
    optimizer.zero_grad()
    loss_mnrl = MultipleNegativesRankingLoss(model)
    queries_mnrl, positives_mnrl, negatives_mnrl = zip(*train_samples_mnrl)
    features_mnrl = [
        model.preprocess(list(texts)) for texts in (queries_mnrl, positives_mnrl, negatives_mnrl)
    ]
    labels = torch.zeros(len(train_samples_mnrl), dtype=torch.long)
    loss_mnrl_value: torch.Tensor = loss_mnrl(features_mnrl, labels) * scaler
    loss_mnrl_value.backward()
    grad_expected = {name: p.grad.clone() for name, p in loss_mnrl.named_parameters() if p.grad is not None}

    # Then run with this cached version:
    set_seed(42)
    optimizer.zero_grad()
    loss_cmnrl = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    queries_cmnrl, positives_cmnrl, negatives_cmnrl = zip(*train_samples_cmnrl)
    features_cmnrl = [
        model.preprocess(list(texts)) for texts in (queries_cmnrl, positives_cmnrl, negatives_cmnrl)
    ]
    loss_cmnrl_value = loss_cmnrl(features_cmnrl, labels) * scaler
    loss_cmnrl_value.backward()
    grad = {name: p.grad.clone() for name, p in loss_cmnrl.named_parameters() if p.grad is not None}

    # Then:
    if same_grad:
        assert pytest.approx(loss_mnrl_value.item(), rel=precision, abs=precision) == loss_cmnrl_value.item()
    else:
        assert pytest.approx(loss_mnrl_value.item(), rel=precision, abs=precision) != loss_cmnrl_value.item()

    nclose = 0
    for name in tqdm.tqdm(grad_expected):
        nclose += torch.allclose(grad[name], grad_expected[name], precision, precision)

    if same_grad:
        assert nclose == len(grad_expected)
    else:
        assert nclose != len(grad_expected)


@pytest.mark.parametrize("mini_batch_size", [2, 3])
def test_cmnrl_matryoshka(stsb_bert_tiny_model: SentenceTransformer, mini_batch_size: int) -> None:
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()

    anchors = ["anchor a", "anchor b", "anchor c", "anchor d", "anchor e", "anchor f"]
    positives = ["positive a", "positive b", "positive c", "positive d", "positive e", "positive f"]
    labels = torch.zeros(6, dtype=torch.long)
    dims = [128, 64, 32]

    def loss_and_grads(inner: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        features = [model.preprocess(anchors), model.preprocess(positives)]
        loss_value = MatryoshkaLoss(model, inner, matryoshka_dims=dims)(features, labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    )
    plain_loss, plain_grads = loss_and_grads(MultipleNegativesRankingLoss(model))

    assert_trained(cached_grads)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-4, msg=name)


def test_cmnrl_token_budget_matches_mnrl(stsb_bert_tiny_model: SentenceTransformer) -> None:
    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()

    anchors = [
        "a",
        "anchor b with quite a few more words in it",
        "c and d",
        "final anchor sentence",
        "e",
        "f g h",
    ]
    positives = [
        "short",
        "positive b also has a longer surface form",
        "p",
        "another positive text",
        "q r",
        "s",
    ]
    labels = torch.zeros(6, dtype=torch.long)

    def loss_and_grads(loss_fn: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss_value = loss_fn([model.preprocess(anchors), model.preprocess(positives)], labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=16)
    )
    plain_loss, plain_grads = loss_and_grads(MultipleNegativesRankingLoss(model))

    assert_trained(cached_grads)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


ANCHORS = ["anchor a", "anchor b", "anchor c", "anchor d", "anchor e"]
POSITIVES = ["positive a", "positive b", "positive c", "positive d", "positive e"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("minibatching", [{"mini_batch_size": 2}, {"mini_batch_num_tokens": 16}])
def test_cached_symmetric_matches_symmetric(
    stsb_bert_tiny_model: SentenceTransformer, minibatching: dict
) -> None:
    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()
    labels = torch.zeros(5, dtype=torch.long)

    def loss_and_grads(loss_fn: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss_value = loss_fn([model.preprocess(ANCHORS), model.preprocess(POSITIVES)], labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedMultipleNegativesSymmetricRankingLoss(model, **minibatching)
    )
    plain_loss, plain_grads = loss_and_grads(MultipleNegativesSymmetricRankingLoss(model))

    assert_trained(cached_grads)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_attributes_and_config_back_compat(stsb_bert_tiny_model: SentenceTransformer) -> None:
    """Their ``test_cmnrl_attributes_and_config_back_compat``, its nine config keys compared (ours add more)."""
    model = stsb_bert_tiny_model
    loss = CachedMultipleNegativesRankingLoss(
        model,
        scale=42.0,
        mini_batch_size=4,
        directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction",
        hardness_mode="in_batch_negatives",
        hardness_strength=9.0,
    )
    assert loss.scale == 42.0
    assert loss.temperature == pytest.approx(1 / 42.0)
    assert loss.directions == ("query_to_doc", "doc_to_query")
    assert loss.partition_mode == "per_direction"
    assert loss.hardness_mode == "in_batch_negatives"
    assert loss.hardness_strength == 9.0
    assert loss.gather_across_devices is False
    assert loss.mini_batch_size == 4
    config = loss.get_config_dict()
    assert {key: config[key] for key in _ST_KEYS} == {
        "scale": 42.0,
        "similarity_fct": "cos_sim",
        "mini_batch_size": 4,
        "mini_batch_num_tokens": None,
        "gather_across_devices": False,
        "directions": ("query_to_doc", "doc_to_query"),
        "partition_mode": "per_direction",
        "hardness_mode": "in_batch_negatives",
        "hardness_strength": 9.0,
    }
    with pytest.raises(ValueError, match=re.escape("Scale must be a positive value.")):  # their wording
        CachedMultipleNegativesRankingLoss(model, scale=-1.0)
    no_name = CachedMultipleNegativesRankingLoss(model, similarity_fct=partial(cos_sim))
    assert "cos_sim" in no_name.get_config_dict()["similarity_fct"]


def test_hyperparameters_stay_assignable(stsb_bert_tiny_model: SentenceTransformer) -> None:
    """Their ``test_cmnrl_hyperparameters_stay_assignable`` without the private inner loss, with a similarity
    we accept; a similarity module we refuse raises and is not captured into ``_modules`` either."""
    loss = CachedMultipleNegativesRankingLoss(stsb_bert_tiny_model, mini_batch_size=4)
    loss.scale = 5.0
    assert loss.scale == 5.0
    assert loss.temperature == pytest.approx(0.2)
    loss.similarity_fct = dot_score
    assert loss.similarity_fct is dot_score and loss.similarity == "dot"
    with pytest.raises(ValueError, match="similarity_fct"):
        loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
    assert "similarity_fct" not in loss._modules and loss.similarity_fct is dot_score
    assert loss.get_config_dict()["similarity_fct"] == "dot_score"


# ---------------------------------------------------------------- part 2: the behaviours users rely on

_ST_KEYS = (
    "scale",
    "similarity_fct",
    "mini_batch_size",
    "mini_batch_num_tokens",
    "gather_across_devices",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
)
TWO = ("query_to_doc", "doc_to_query")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("st_parity_small") / "bert", dropout=0.0)


def _features(model, b: int = 7):
    from tests.support.tiny_model import random_texts

    return [model.preprocess(random_texts(b, seed=s)) for s in (3, 4, 5)]


def _loss_and_grads(model, loss, features):
    return param_grads(
        model, lambda f: loss(f, torch.zeros(len(f[0]["input_ids"]), dtype=torch.long)), features
    )


@pytest.mark.parametrize("cls", [CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss])
def test_constructor_starts_with_their_positional_order(cls):
    theirs = list(inspect.signature(st_losses.CachedMultipleNegativesRankingLoss).parameters.values())
    ours = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ours[: len(theirs)])
    assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs) :])
    for mine, their in zip(ours, theirs):
        if cls is CachedCLIPLoss and mine.name in ("directions", "partition_mode"):
            continue  # the symmetric loss's own defaults: TWO, "per_direction"
        if cls is CachedTiledLoss and mine.name in ("directions", "partition_mode"):
            # None: resolved with the symmetric shorthand (so that a contradiction can be told from a
            # default); without it, theirs (test_tiled_defaults_resolve_to_theirs)
            assert mine.default is None, mine.name
            continue
        assert mine.default == their.default, mine.name


def test_tiled_defaults_resolve_to_theirs(model):
    theirs = inspect.signature(st_losses.CachedMultipleNegativesRankingLoss).parameters
    loss = CachedTiledLoss(model)
    assert loss.directions == tuple(theirs["directions"].default)
    assert loss.partition_mode == theirs["partition_mode"].default


@pytest.mark.parametrize("cls", [CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss])
def test_positional_call_means_what_it_means_to_them(model, cls):
    loss = cls(model, 10.0, dot_score, 3, 64, False)
    assert (loss.scale, loss.similarity_fct, loss.mini_batch_size, loss.mini_batch_num_tokens) == (
        10.0,
        dot_score,
        3,
        64,
    )
    assert loss.gather_across_devices is False and loss.learnable_scale is False
    clip = CachedCLIPLoss(model, 20.0, cos_sim, 32)
    assert (clip.scale, clip.similarity_fct, clip.mini_batch_size, clip.learnable_scale) == (
        20.0,
        cos_sim,
        32,
        False,
    )


@pytest.mark.parametrize(
    "assignments",
    [
        {"similarity_fct": dot_score, "scale": 1.0},
        {"scale": 5.0},
        {"temperature": 0.1},
        {"mini_batch_size": 3},
        {"mini_batch_num_tokens": 4},
        {"partition_mode": "per_direction", "directions": TWO},
    ],
    ids=["dot", "scale", "temperature", "mini_batch_size", "num_tokens", "symmetric"],
)
def test_assignments_take_effect_like_theirs(model, assignments):
    """Set after construction on both losses: the same loss and parameter gradients, and not those of the
    loss before the assignment (a silently ignored assignment fails here)."""
    feats = _features(model)
    theirs = st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
    ours = CachedMNRLoss(model, mini_batch_size=4)
    before, grads_before = _loss_and_grads(model, ours, feats)
    for name, value in assignments.items():
        if name == "temperature":  # theirs is read-only: set its scale
            theirs.scale = 1 / value
        else:
            setattr(theirs, name, value)
        setattr(ours, name, value)
    ref_loss, ref = _loss_and_grads(model, theirs, feats)
    loss, grads = _loss_and_grads(model, ours, feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref, rtol=1e-4)
    if "mini_batch" not in next(iter(assignments)):
        assert not torch.allclose(loss, before), "the assignment changed nothing"
        assert not torch.allclose(grads, grads_before)
    assert {k: ours.get_config_dict()[k] for k in _ST_KEYS} == theirs.get_config_dict()


@pytest.mark.parametrize(
    ("name", "value", "count"),
    [("mini_batch_size", 2, lambda n: n > 3), ("mini_batch_num_tokens", 4, lambda n: n > 3)],
)
def test_encoder_mini_batches_follow_assignment(model, name, value, count):
    """The engine really uses the assigned mini-batching (counted encoder forwards)."""
    calls = []
    handle = model[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        loss = CachedMNRLoss(model, mini_batch_size=64)
        _loss_and_grads(model, loss, _features(model)[:2])
        unassigned = len(calls)
        calls.clear()
        setattr(loss, name, value)
        _loss_and_grads(model, loss, _features(model)[:2])
    finally:
        handle.remove()
    assert unassigned <= 2 and count(len(calls)), (unassigned, len(calls))


SETTINGS = [
    {},
    {"scale": 50.0, "similarity_fct": dot_score, "mini_batch_size": 4, "mini_batch_num_tokens": 64},
    {"directions": TWO, "partition_mode": "per_direction", "gather_across_devices": True},
    {"partition_mode": "per_direction", "hardness_strength": 3.0, "show_progress_bar": True},
]


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_config_has_their_keys_and_values(model, kwargs):
    theirs = st_losses.CachedMultipleNegativesRankingLoss(model, **kwargs).get_config_dict()
    ours = CachedMNRLoss(model, **kwargs).get_config_dict()
    assert {key: ours[key] for key in theirs} == theirs
    # the extras only where they differ from their defaults (sentence-transformers' own config test)
    # no extra in use here: exactly their keys (their own config test compares with ==)
    assert ours == theirs
    assert json.loads(json.dumps(ours)) == ours


def test_clip_config_says_it_is_symmetric_as_theirs_does(model):
    theirs = st_losses.CachedMultipleNegativesRankingLoss(
        model, directions=TWO, partition_mode="per_direction"
    )
    ours = CachedCLIPLoss(model).get_config_dict()
    # their keys only: the directions and the partition mode say it (no "symmetric" key, which their
    # config never has and CachedCLIPLoss does not take)
    assert ours == theirs.get_config_dict()
    assert ours["directions"] == TWO and ours["partition_mode"] == "per_direction"
    tiled = CachedTiledLoss(model, symmetric=True).get_config_dict()
    assert (
        tiled["directions"] == TWO and tiled["partition_mode"] == "per_direction" and "symmetric" not in tiled
    )


def test_learnable_scale_config_shows_the_learned_value_and_temperature_sets_it(model):
    loss = CachedCLIPLoss(model, scale=10.0, learnable_scale=True, max_scale=50.0)
    with torch.no_grad():
        loss.logit_scale.fill_(math.log(30.0))
    assert loss.get_config_dict()["scale"] == pytest.approx(30.0)
    assert loss.temperature == pytest.approx(1 / 30.0)
    loss.temperature = 0.05
    assert loss.scale == pytest.approx(20.0) and float(loss.logit_scale) == pytest.approx(math.log(20.0))
    with pytest.raises(ValueError, match="max_scale"):
        loss.scale = 60.0
    with pytest.raises(ValueError, match="max_scale"):
        loss.max_scale = 10.0
    assert loss.scale == pytest.approx(20.0) and loss.max_scale == 50.0
    loss.learnable_scale = False
    assert "logit_scale" not in dict(loss.named_parameters()) and loss.scale == pytest.approx(20.0)
    loss.learnable_scale = True
    assert float(loss.logit_scale) == pytest.approx(math.log(20.0))


def test_citation_is_a_property(model):
    for cls in (CachedMNRLoss, CachedCLIPLoss, CachedTiledLoss):
        assert isinstance(inspect.getattr_static(cls, "citation"), property)
    assert "gao2021scaling" in CachedMNRLoss(model).citation
    tiled = CachedTiledLoss(model)
    assert "radford2021learning" not in tiled.citation
    tiled.symmetric = True
    assert "radford2021learning" in tiled.citation and tiled.directions == TWO


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"directions": ("query_to_doc", "query_to_query"), "partition_mode": "per_direction"}, "joint"),
        ({"directions": ("query_to_doc", "doc_to_doc"), "partition_mode": "per_direction"}, "joint"),
        ({"directions": ("query_to_doc", "query_to_doc")}, "twice"),
        ({"directions": ("doc_to_query",)}, "'query_to_doc' direction is required"),
        ({"directions": ("query_to_doc", "nope")}, "Invalid directions"),
        ({"directions": "query_to_doc"}, "directions must be a tuple"),
        ({"partition_mode": "both"}, "partition_mode must be"),
        ({"hardness_mode": "hardest"}, "hardness_mode must be one of"),
        ({"hardness_strength": -1.0}, "hardness_strength must be non-negative"),
    ],
)
def test_invalid_options_are_refused_not_ignored(model, kwargs, match):
    for cls in (CachedMNRLoss, CachedTiledLoss):
        with pytest.raises(ValueError, match=match):
            cls(model, **kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("path", "fast"),
        ("tile_size", 0),
        ("memory_budget", 0),
        ("memory_budget", None),
        ("mini_batch_size", 0),
        ("mini_batch_num_tokens", -1),
        ("gather_across_devices", "yes"),
        ("show_progress_bar", 1),
        ("mask_duplicates", None),
        ("sort_by_length", "no"),
        ("reuse_last_graph", 0),
        ("learnable_scale", "true"),
        ("max_scale", math.inf),
        ("scale", 0.0),
        ("similarity_fct", "l2"),
        ("hardness_mode", "hardest"),
        ("hardness_strength", -1.0),
        ("directions", ("query_to_doc", "nope")),
    ],
)
def test_every_argument_is_validated_at_construction_and_when_set(model, name, value):
    cls = CachedTiledLoss if name in ("tile_size",) else CachedCLIPLoss
    with pytest.raises(ValueError, match=name if name != "hardness_mode" else "hardness_mode"):
        cls(model, **{name: value})
    loss = cls(model)
    before = getattr(loss, name)
    with pytest.raises(ValueError):
        setattr(loss, name, value)
    assert getattr(loss, name) == before, "a refused value must leave the setting as it was"


def test_setters_revalidate_the_combination(model):
    loss = CachedMNRLoss(model)
    loss.directions = TWO  # joint: GTE-style two directions in one softmax
    assert not loss.symmetric
    loss.partition_mode = "per_direction"
    assert loss.symmetric
    loss.partition_mode = "joint"
    loss.directions = ("query_to_doc", "query_to_query")
    with pytest.raises(ValueError, match="joint"):
        loss.partition_mode = "per_direction"
    assert loss.partition_mode == "joint"
    loss.symmetric = False  # already not symmetric: nothing changes
    assert loss.directions == ("query_to_doc", "query_to_query")
    loss.symmetric = True
    loss.symmetric = False  # from the symmetric loss: one direction
    assert loss.directions == ("query_to_doc",)
