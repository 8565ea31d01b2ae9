"""A loss's settings are one frozen object, checked as a whole when built and when replaced: assigning any
setting its current value changes nothing (loss, config, every other setting), a contradiction raises however
it is spelled and in whatever order the settings are assigned, at construction and at assignment."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import st_cached_losses
from tests.support.tiny_model import make_tiny_model, random_texts

ALL_FOUR = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    base = tmp_path_factory.mktemp("settings_model")
    make_tiny_model(base / "bert").save(str(base / "st"))
    model = SentenceTransformer(str(base / "st"), device="cpu")
    model.eval()
    return model


def _settable(loss) -> list[str]:
    """Every public setting of the loss: the names of its settings object (but read-only views) and its
    attributes with a setter."""
    views = loss.settings_class.views()
    names = {n for n in loss.settings_class.names() if n not in views or views[n].fchanges is not None}
    names |= {n for n, m in inspect.getmembers(type(loss)) if isinstance(m, property) and m.fset is not None}
    return sorted(n for n in names if not n.startswith("_"))


def _loss_value(loss, model) -> float:
    feats = [model.preprocess(random_texts(5, seed=k)) for k in range(3)]
    feats[1]["input_ids"][-1] = feats[1]["input_ids"][0]  # a duplicate positive: mask_duplicates shows
    feats[1]["attention_mask"][-1] = feats[1]["attention_mask"][0]
    with torch.no_grad():
        return loss(feats, None).item()


def _snapshot(loss) -> dict:
    return {name: getattr(loss, name) for name in _settable(loss)}


LOSSES = {
    "mnr_four_joint": ("CachedMNRLoss", {"directions": ALL_FOUR}),
    "mnr_hardness": ("CachedMNRLoss", {"hardness_mode": "all_negatives", "hardness_strength": 2.0}),
    "mnr_masked": ("CachedMNRLoss", {"mask_duplicates": True}),
    "clip_joint": ("CachedCLIPLoss", {"partition_mode": "joint"}),
    "clip_learnable": ("CachedCLIPLoss", {"learnable_scale": True, "scale": 13.7}),
    "tiled_symmetric": ("CachedTiledLoss", {"symmetric": True, "tile_size": 3, "scale": 7.3}),
    "tiled_four": ("CachedTiledLoss", {"directions": ALL_FOUR, "learnable_scale": True}),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_assigning_the_current_value_changes_nothing(model, name):
    cls_name, kwargs = LOSSES[name]
    loss = getattr(st_cached_losses, cls_name)(model, mini_batch_size=2, **kwargs)
    settable = _settable(loss)
    assert {"scale", "temperature", "directions", "symmetric", "mini_batch_size"} <= set(settable)
    before_value, before_config, before = _loss_value(loss, model), loss.get_config_dict(), _snapshot(loss)
    for setting in settable:
        setattr(loss, setting, getattr(loss, setting))
        assert _snapshot(loss) == before, f"{name}: assigning {setting} its own value changed a setting"
        assert loss.get_config_dict() == before_config, f"{name}: {setting}"
    if loss.learnable_scale:
        assert loss.logit_scale.item() == pytest.approx(torch.tensor(before["scale"]).log().item(), abs=1e-6)
    assert _loss_value(loss, model) == before_value


def test_symmetric_false_keeps_other_directions(model):
    """The review's case: ``loss.symmetric = loss.symmetric`` reset four directions to one."""
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2, directions=ALL_FOUR)
    assert loss.symmetric is False
    loss.symmetric = False
    assert loss.directions == ALL_FOUR
    loss.symmetric = True
    assert loss.directions == ("query_to_doc", "doc_to_query") and loss.partition_mode == "per_direction"


def test_symmetric_assignment_is_checked_against_duplicate_masking(model):
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2, mask_duplicates=True)
    loss.symmetric = True  # the symmetric loss masks duplicates too
    assert loss.symmetric and loss.mask_duplicates


JOINT_TWO = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "joint"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"symmetric": True, "partition_mode": "joint"},
        {"symmetric": True, **JOINT_TWO},
        {"symmetric": True, "directions": ALL_FOUR},
        {"symmetric": True, "directions": ("query_to_doc",)},
        {"symmetric": False, "directions": ("query_to_doc", "doc_to_query")},
    ],
    ids=["sym-joint", "sym-two-joint", "sym-four", "sym-one", "nosym-two"],
)
def test_tiled_contradictions_raise_however_spelled(model, kwargs):
    with pytest.raises(ValueError, match="symmetric"):
        st_cached_losses.CachedTiledLoss(model, mini_batch_size=2, **kwargs)


def test_tiled_symmetric_spellings_agree(model):
    """symmetric=True alone, with per_direction, and with both directions: the CLIP loss; both directions
    joint without symmetric: the joint loss, and its config says so."""
    clip = [
        st_cached_losses.CachedTiledLoss(model, mini_batch_size=2, tile_size=2, **kw)
        for kw in (
            {"symmetric": True},
            {"symmetric": True, "partition_mode": "per_direction"},
            {"symmetric": True, "directions": ("doc_to_query", "query_to_doc")},
            {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        )
    ]
    values = [_loss_value(loss, model) for loss in clip]
    assert all(v == pytest.approx(values[0], rel=1e-6) for v in values)
    assert all(
        loss.symmetric and loss.get_config_dict()["partition_mode"] == "per_direction" for loss in clip
    )
    joint = st_cached_losses.CachedTiledLoss(model, mini_batch_size=2, tile_size=2, **JOINT_TWO)
    assert joint.get_config_dict()["partition_mode"] == "joint" and not joint.symmetric
    assert _loss_value(joint, model) != pytest.approx(values[0], rel=1e-3)
    reference = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2, **JOINT_TWO)
    assert _loss_value(joint, model) == pytest.approx(_loss_value(reference, model), rel=1e-6)


def test_the_tiled_loss_path_is_read_only(model):
    """``CachedTiledLoss`` is always tiled: another ``path`` is refused naming the losses that take it."""
    loss = st_cached_losses.CachedTiledLoss(model, mini_batch_size=2)
    loss.path = "tiled"  # its own value: accepted, nothing changes
    with pytest.raises(
        ValueError, match=r"CachedTiledLoss.path is 'tiled' and cannot be changed.*path='chunked'"
    ):
        loss.path = "chunked"
    assert loss.path == "tiled"


def test_an_engine_setting_builds_a_new_frozen_engine(model):
    """A loss's engine setting changes the engine by building a new one (its configuration is frozen): the
    loss reads the new value, the old engine is unchanged, the run state goes along and a change of a size
    forgets what "auto" chose."""
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4)
    engine, auto = loss.cache, loss.cache.auto
    loss.sort_by_length = False
    assert loss.cache is not engine and loss.cache.sort_by_length is False and engine.sort_by_length is True
    assert loss.cache.auto is auto
    same = loss.cache
    loss.sort_by_length = False  # the current value: the same engine
    assert loss.cache is same
    auto.size = 3
    loss.mini_batch_size = 8
    assert (loss.mini_batch_size, loss.cache.mini_batch_size, auto.size) == (8, 8, None)
    with pytest.raises(ValueError, match="mini_batch_size must be a positive integer"):
        loss.mini_batch_size = 0
    assert loss.cache.mini_batch_size == 8


def test_settings_are_one_frozen_object_replaced_by_an_assignment(model):
    """The settings object is never changed: an assignment builds a new one (checked as a whole); a refused
    assignment leaves the old one; several settings change at once with ``update_settings``."""
    import dataclasses

    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2)
    before = loss.settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.scale = 5.0
    loss.scale = 5.0
    assert loss.settings is not before and before.scale == 20.0 and loss.settings.scale == 5.0
    with pytest.raises(ValueError, match="Scale must be a positive value"):
        loss.scale = -1.0
    assert loss.scale == 5.0
    loss.update_settings(directions=("query_to_doc", "query_to_query"), partition_mode="joint")
    assert loss.directions == ("query_to_doc", "query_to_query")
    assert loss.get_config_dict()["directions"] == ("query_to_doc", "query_to_query")


def test_a_check_does_not_depend_on_the_order_of_assignment(model):
    """The issue's case: a distillation loss built with an InfoNCE term refuses a similarity without an
    in-batch form whether it is given to the constructor or assigned afterwards (it was accepted when
    assigned, and the next step crashed); the other order is refused too."""
    from sentence_transformers.util import pairwise_euclidean_sim

    with pytest.raises(ValueError, match=r"infonce_weight=0\.5 needs an in-batch score"):
        st_cached_losses.CachedDistillKLDivLoss(model, pairwise_euclidean_sim, infonce_weight=0.5)
    loss = st_cached_losses.CachedDistillKLDivLoss(model, infonce_weight=0.5, mini_batch_size=2)
    with pytest.raises(ValueError, match=r"infonce_weight=0\.5 needs an in-batch score"):
        loss.similarity_fct = pairwise_euclidean_sim
    assert loss.infonce_weight == 0.5 and loss.settings.similarity_fct is not pairwise_euclidean_sim
    plain = st_cached_losses.CachedDistillKLDivLoss(model, pairwise_euclidean_sim, mini_batch_size=2)
    with pytest.raises(ValueError, match=r"infonce_weight=0\.5 needs an in-batch score"):
        plain.infonce_weight = 0.5
    plain.update_settings(similarity_fct="pairwise_cos_sim", infonce_weight=0.5)  # valid together
    assert plain.infonce_weight == 0.5


def test_one_budget_rule_for_the_losses_and_the_arguments(model):
    """A memory budget without "auto" mini-batches would be unused: refused by the loss (it warned) as by the
    arguments, in the same words; from "auto" to fixed sizes, both change at once."""
    from st_cached_losses import CachedLossTrainingArguments

    words = r"mini_batch_memory_budget=.* sizes 'auto' mini-batches only, and mini_batch_size=4 is fixed"
    with pytest.raises(ValueError, match=words):
        st_cached_losses.CachedMNRLoss(model, mini_batch_size=4, mini_batch_memory_budget="1GB")
    with pytest.raises(ValueError, match=words):
        CachedLossTrainingArguments(output_dir="o", mini_batch_size=4, mini_batch_memory_budget="1GB")
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size="auto", mini_batch_memory_budget="1GB")
    with pytest.raises(ValueError, match=words):
        loss.mini_batch_size = 4
    loss.update_settings(mini_batch_size=4, mini_batch_memory_budget=None)
    assert (loss.mini_batch_size, loss.mini_batch_memory_budget, loss.cache.mini_batch_size) == (4, None, 4)


def test_every_invalid_setting_is_named_at_once(model):
    # the fields' own checks all run before one error names every bad setting, whatever their order
    with pytest.raises(ValueError, match="2 settings are invalid") as info:
        st_cached_losses.CachedMNRLoss(model, mask_duplicates=1, gather_across_devices="yes")
    assert "mask_duplicates" in str(info.value) and "gather_across_devices" in str(info.value)
    loss = st_cached_losses.CachedMNRLoss(model)
    with pytest.raises(ValueError, match="2 settings are invalid"):
        loss.update_settings(gather_across_devices="yes", mask_duplicates=1)
    assert loss.mask_duplicates is False and loss.gather_across_devices is False
    # one bad setting: its own error, as it is
    with pytest.raises(ValueError, match=r"^mask_duplicates must be True or False"):
        st_cached_losses.CachedMNRLoss(model, mask_duplicates=1)


@pytest.mark.parametrize("cls_name", ["CachedMNRLoss", "CachedGISTLoss", "CachedSigLIPLoss"])
def test_a_learned_scale_is_state_not_a_setting(model, cls_name):
    """Issue 59: the settings keep the value given; the loss's attribute, its views and its config read the
    learned one; assigning the given value again still sets the parameter; turning learning off keeps the
    learned value; the settings object is read without being rebuilt."""
    cls = getattr(st_cached_losses, cls_name)
    kwargs = {"guide": None} if cls_name == "CachedGISTLoss" else {}
    learn = "learnable" if cls_name == "CachedSigLIPLoss" else "learnable_scale"
    loss = cls(model, **kwargs, **{learn: True})
    given = loss.settings
    start = given.scale
    with torch.no_grad():
        loss.logit_scale.fill_(math.log(start * 0.5))
    assert loss.settings is given and loss.settings.scale == start
    assert loss.scale == pytest.approx(start * 0.5) and loss.temperature == pytest.approx(1 / (start * 0.5))
    key = "temperature" if cls_name == "CachedGISTLoss" else "scale"
    config = loss.get_config_dict()
    assert config[key] == pytest.approx(start * 0.5 if key == "scale" else 1 / (start * 0.5))
    rebuilt = cls(model, **{k: v for k, v in config.items() if k not in kwargs}, **kwargs)
    assert rebuilt.scale == pytest.approx(loss.scale)
    loss.scale = start  # the setting's own value: the parameter follows
    assert float(loss.logit_scale.exp()) == pytest.approx(start)
    with torch.no_grad():
        loss.logit_scale.fill_(math.log(start * 0.25))
    setattr(loss, learn, False)
    assert "logit_scale" not in dict(loss.named_parameters())
    assert loss.scale == pytest.approx(start * 0.25) and loss.settings.scale == pytest.approx(start * 0.25)


def test_a_learned_bias_is_state_not_a_setting(model):
    loss = st_cached_losses.CachedSigLIPLoss(model, bias=-10.0, learnable=True)
    with torch.no_grad():
        loss.logit_bias.fill_(-4.0)
    assert loss.settings.bias == -10.0 and loss.bias == -4.0 and loss.get_config_dict()["bias"] == -4.0
    loss.bias = -10.0
    assert float(loss.logit_bias) == -10.0
    with torch.no_grad():
        loss.logit_bias.fill_(-3.0)
    loss.learnable = False
    assert "logit_bias" not in dict(loss.named_parameters()) and loss.bias == -3.0


def _settings_classes() -> list[type]:
    from st_cached_losses.losses import registry

    return sorted({cls.settings_class for cls in registry.losses().values()}, key=lambda c: c.__name__)


@pytest.mark.parametrize("settings_class", _settings_classes(), ids=lambda c: c.__name__)
def test_the_config_is_derived_from_the_declarations(settings_class):
    """Issue 59: no settings class writes ``config()`` itself; its keys are settings of its loss (fields or
    views), each listed once, and every ``"changed"`` field a constructor takes is an extra, not a key."""
    from st_cached_losses.losses.settings import Settings

    for klass in settings_class.__mro__:
        if klass is not Settings and issubclass(klass, Settings):
            assert "config" not in vars(klass), f"{klass.__name__} writes config() by hand"
    keys = settings_class.key_names()
    assert len(set(keys)) == len(keys)
    assert set(keys) <= set(settings_class.names()), set(keys) - set(settings_class.names())
    assert not set(keys) & set(settings_class.extra_names())
    assert not set(settings_class.extra_names()) & settings_class.not_arguments


def test_a_config_form_and_a_similarity_name_are_what_the_config_writes(tmp_path):
    """The forms the declarations give: the reranker's activation as its class path, the multi-vector
    scoring chunk following an ``"auto"`` mini-batch as None, a similarity by its name; with an extra in use it
    follows sentence-transformers' keys."""
    from sentence_transformers.util import dot_score

    import st_cached_losses as s
    from tests.support.tiny_model import make_tiny_cross_encoder, make_tiny_model, make_tiny_multi_vector

    reranker = s.CachedCrossEncoderLoss(
        make_tiny_cross_encoder(tmp_path / "ce"), activation_fn=torch.nn.Tanh()
    )
    assert reranker.get_config_dict()["activation_fn"] == "torch.nn.modules.activation.Tanh"
    mv = s.CachedMultiVectorLoss(
        make_tiny_multi_vector(tmp_path / "mv"), mini_batch_size="auto", mini_batch_memory_budget="1GiB"
    )
    assert mv.get_config_dict()["score_mini_batch_size"] is None
    mnr = s.CachedMNRLoss(make_tiny_model(tmp_path / "d"), similarity_fct=dot_score, mask_duplicates=True)
    config = mnr.get_config_dict()
    assert config["similarity_fct"] == "dot_score"
    assert list(config)[-1] == "mask_duplicates" and list(config)[:2] == ["scale", "similarity_fct"]
