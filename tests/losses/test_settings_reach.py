"""Every setting a loss accepts reaches a part of it: its stage, its engine, or its own state (a learned scale's
parameter and clamp, the negative bank). For every registered loss and every field of its settings, a loss
built with the field moved off its default differs from the loss built without it in what those parts hold, or
the loss refuses the value when it is built (a setting that no part of this loss uses in this configuration,
e.g. the loss stage's plan where the loss has no chunked stage). "Accepted and ignored" (``CachedSigLIPLoss``
once dropped ``matmul_precision`` so) fails here, for a loss added later too: every registered name is walked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import pytest
import torch
from sentence_transformers.sparse_encoder.losses import (
    FlopsLoss,
    SparseDistillKLDivLoss,
    SparseMarginMSELoss,
    SparseMultipleNegativesRankingLoss,
)

import st_cached_losses as s
from st_cached_losses.losses import registry
from st_cached_losses.losses.settings import EngineSettings, Settings
from tests.support.tiny_model import (
    make_tiny_cross_encoder,
    make_tiny_model,
    make_tiny_multi_vector,
    make_tiny_splade,
)

TWO = ("query_to_doc", "doc_to_query")
THREE = ("query_to_doc", "query_to_query", "doc_to_query")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reach")
    return {
        "dense": make_tiny_model(root / "dense"),
        "other": make_tiny_model(root / "other", seed=1),
        "splade": make_tiny_splade(root / "splade"),
        "multi_vector": make_tiny_multi_vector(root / "mv"),
        "cross_encoder": make_tiny_cross_encoder(root / "ce"),
    }


def _builder(name: str, models: dict[str, Any]) -> Any:
    """``build(**settings)``: the registered loss ``name`` on a tiny model of its kind, with its required
    arguments."""
    dense, splade = models["dense"], models["splade"]
    sparse_bases = {
        "sparse": SparseMultipleNegativesRankingLoss,
        "sparse_distill_kl": SparseDistillKLDivLoss,
        "sparse_margin_mse": SparseMarginMSELoss,
    }
    if name in sparse_bases:
        base = sparse_bases[name]

        def sparse(**kw: Any) -> Any:
            kw.setdefault("loss", base(splade))
            kw.setdefault("document_regularizer_weight", 3e-5)
            return s.CachedSparseLoss(splade, **kw)

        return sparse
    cls = registry.losses()[name]
    model = {
        "multi_vector": models["multi_vector"],
        "multi_vector_distill_kl": models["multi_vector"],
        "multi_vector_margin_mse": models["multi_vector"],
        "cross_encoder": models["cross_encoder"],
    }.get(name, dense)
    if name == "gist":
        return lambda **kw: cls(model, **{"guide": None, **kw})
    return functools.partial(cls, model)


def _alternatives(name: str, models: dict[str, Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Per field: a valid value other than the default, and the settings it needs beside it (``max_scale`` is
    read only with a learned scale)."""
    splade = models["splade"]
    similarity = {
        "multi_vector": "meanmaxsim",
        "multi_vector_distill_kl": "meanmaxsim",
        "multi_vector_margin_mse": "meanmaxsim",
        "distill_kl": "pairwise_cos_sim",
        "margin_mse": "pairwise_cos_sim",
    }.get(name, "dot")
    learn = {"learnable": True} if name == "siglip" else {"learnable_scale": True}
    return {
        "mini_batch_size": (3, {}),
        "mini_batch_num_tokens": (64, {}),
        "show_progress_bar": (True, {}),
        "sort_by_length": (False, {}),
        "reuse_last_graph": (False, {}),
        "keep_params_unsharded": (True, {}),
        "graph_memory_budget": ("1MiB", {}),
        "mini_batch_memory_budget": ("1GiB", {"mini_batch_size": "auto", "mini_batch_memory_budget": "2GiB"}),
        "path": ("tiled", {}),
        "tile_size": (7, {}),
        "memory_budget": ("1MiB", {}),
        "matmul_precision": ("high", {}),
        "scale": (7.0, {}),
        "learnable_scale": (True, {}),
        "learnable": (True, {}),
        "max_scale": (150.0, learn),
        "similarity_fct": (similarity, {}),
        "gather_across_devices": (True, {}),
        "directions": (THREE, {"partition_mode": "joint"}) if name == "clip" else (TWO, {}),
        "partition_mode": ("joint", {}) if name == "clip" else ("per_direction", {"directions": TWO}),
        "hardness_mode": ("all_negatives", {"hardness_strength": 1.0}),
        "hardness_strength": (2.0, {"hardness_mode": "all_negatives"}),
        "in_batch_negatives": (False, {}),
        "mask_duplicates": (True, {}),
        "false_negative_filter": ("relative", {}),
        "false_negative_margin": (0.9, {"false_negative_filter": "relative"}),
        "negative_bank_size": (4, {}),
        "negative_bank_max_age": (3, {"negative_bank_size": 4}),
        "guide": (models["other"], {}),
        "temperature": (0.5, {}),
        "margin_strategy": ("relative", {}),
        "margin": (0.1, {}),
        "contrast_anchors": (False, {}),
        "contrast_positives": (False, {}),
        "loss": (SparseMultipleNegativesRankingLoss(splade, scale=7.0), {}),
        "document_regularizer_weight": (1e-3, {}),
        "query_regularizer_weight": (5e-5, {}),
        "document_regularizer": (FlopsLoss(splade), {}),
        "query_regularizer": (FlopsLoss(splade), {"query_regularizer_weight": 5e-5}),
        "document_regularizer_threshold": (10, {}),
        "query_regularizer_threshold": (10, {"query_regularizer_weight": 5e-5}),
        "use_document_regularizer_only": (True, {}),
        "score_mini_batch_size": (3, {}),
        "num_negatives": (2, {}),
        "activation_fn": (torch.nn.Tanh(), {}),
        "infonce_weight": (0.5, {}),
        "infonce_scale": (10.0, {"infonce_weight": 0.5}),
        "student_temperature": (2.0, {}),
        "teacher_temperature": (2.0, {}),
        "bias": (-3.0, {}),
        "distance_metric": ("l2", {}),
        "projection_dim": (12, {}),
        "teacher": (models["other"], {}),
        "pointwise_weight": (0.5, {}),
        "listwise_weight": (0.5, {}),
        "listwise_scale": (10.0, {"listwise_weight": 0.5}),
        "listwise_teacher_scale": (10.0, {"listwise_weight": 0.5}),
    }


def _describe(value: Any) -> Any:
    """What a part of a loss holds, comparable: dataclasses field by field, a partial by its function and
    arguments; a settings object (which a stage may keep for its messages) counts for nothing."""
    if isinstance(value, Settings):
        return "<settings>"
    if isinstance(value, functools.partial):
        return (
            value.func.__qualname__,
            [_describe(a) for a in value.args],
            {k: _describe(v) for k, v in value.keywords.items()},
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)},
        )
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, torch.nn.Module):  # by what it holds (two instances alike are alike)
        return repr(value), [round(p.sum().item(), 6) for p in value.parameters()]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return repr(value)


def _parts(loss: Any) -> Any:
    """What the loss's parts hold: the stage, the engine's fields, the loss's own tensors (its model's aside),
    and what it hands the stage at a step (a learned scale, clamped at ``max_scale``)."""
    if "logit_scale" in loss._parameters:
        with torch.no_grad():  # past any clamp: the clamp shows
            loss.logit_scale.fill_(math.log(1000.0))
    own = {
        k: _describe(v)
        for k, v in loss.state_dict().items()
        if not k.startswith(("model.", "guide.", "teacher."))
    }
    engine = {n: getattr(loss.cache, n) for n in EngineSettings.engine_fields}
    inputs = {k: v.tolist() for k, v in loss.stage_inputs().items()}
    modules = {k: _describe(m) for k, m in loss._modules.items() if k != "model"}
    # what the loss reads itself at a step: a reranker's pairs (its in-batch negatives' draw)
    torch.manual_seed(0)
    pairs = (
        loss.pairs([[f"q{i}" for i in range(6)], [f"d{i}" for i in range(6)]])
        if hasattr(loss, "pairs")
        else None
    )
    return _describe(loss.stage), repr(engine), own, inputs, modules, pairs


CASES = [
    (name, field)
    for name, cls in registry.losses().items()
    for field in cls.settings_class.field_names()
    if field not in cls.settings_class.not_arguments
]


@pytest.mark.parametrize(("name", "field"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_every_accepted_setting_reaches_a_part_or_is_refused(models, name, field):
    build = _builder(name, models)
    alternatives = _alternatives(name, models)
    assert field in alternatives, f"no alternative value for {field!r}: add one to _alternatives"
    value, needs = alternatives[field]
    base = build(**needs)
    assert getattr(base.settings, field) != value or field in needs, (
        f"{name}: {field}={value!r} is its default"
    )
    try:
        moved = build(**{**needs, field: value})
    except ValueError as exc:  # refused: the message names the setting
        assert field in str(exc), f"{name}: {field}={value!r} refused without naming it: {exc}"
        assert "does not reach its stage" not in str(exc), f"{name}: build_stage drops {field}: {exc}"
        return
    assert _parts(moved) != _parts(base), (
        f"{name} accepts {field}={value!r} and no part of it changes (stage, engine, own state): accepted and "
        "ignored"
    )


def test_the_walk_covers_every_registered_loss():
    assert {name for name, _ in CASES} == set(registry.losses())
    assert len(CASES) > 200
