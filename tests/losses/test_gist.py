"""CachedGISTLoss against sentence-transformers' GISTEmbedLoss (the oracle): loss and parameter gradients
of the trained model on a tiny BERT, with a guide of the same or of another tokenizer, both margin
strategies, contrast flags off, hard negatives, duplicate positives, mini-batches that do not divide the
batch; across 2 gloo processes (equal batches: against their gathered loss; unequal: ring equal to
gather); and the checks at construction."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

from st_cached_losses import CachedGISTLoss
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.dist_utils import run_distributed
from tests.support.st_version import ST_6_3, ST_VERSION
from tests.support.tiny_model import WORDS, make_tiny_model, random_texts

B = 9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("gist")
    model = make_tiny_model(base / "model", dropout=0.0, seed=0)
    guide = make_tiny_model(base / "guide", dropout=0.0, seed=5, hidden=24)
    # another vocabulary (other ids for the same words): the guide must re-tokenise the texts
    other = make_tiny_model(base / "other", dropout=0.0, seed=6, words=list(reversed(WORDS)))
    return model, guide, other


def texts(n_cols: int, seed: int = 0, duplicate: bool = True) -> list[list[str]]:
    cols = [random_texts(B, seed=seed + 17 * k, max_words=8) for k in range(n_cols)]
    if duplicate:
        cols[1][5] = cols[1][2]  # the same positive in two rows
        cols[0][7] = cols[1][3]  # an anchor equal to another row's positive
    return cols


# the tiny random guide rates every pair 0.77 ... 1.0: a margin of 0.03 removes some negatives, not all
CASES = list(itertools.product(["absolute", "relative"], [0.0, 0.03], [True, False], [True, False]))


@pytest.mark.parametrize(("strategy", "margin", "anchors", "positives"), CASES)
def test_equals_gist_embed_loss(models, strategy, margin, anchors, positives):
    model, guide, _ = models
    options = {
        "temperature": 0.05,
        "margin_strategy": strategy,
        "margin": margin,
        "contrast_anchors": anchors,
        "contrast_positives": positives,
    }
    for n_cols in (2, 3):
        feats = [model.preprocess(t) for t in texts(n_cols, seed=n_cols)]
        ref_loss, ref = param_grads(model, lambda f: GISTEmbedLoss(model, guide, **options)(f, None), feats)
        ours_fn = CachedGISTLoss(model, guide, **options, mini_batch_size=4)
        loss, ours = param_grads(model, lambda f, fn=ours_fn: fn(f, None), feats)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
        assert float(loss) > 0.1, "vacuous: the guide removed every negative"
        assert_grads_close(ours, ref)


@pytest.mark.parametrize("path", ["chunked", "tiled"])
def test_guide_with_another_tokenizer_and_token_budget(models, path):
    model, _, other = models
    ours_fn = CachedGISTLoss(model, other, 0.05, mini_batch_num_tokens=20, path=path, tile_size=4)
    assert ours_fn.must_retokenize
    ref_fn = GISTEmbedLoss(model, other, 0.05)
    assert ref_fn.must_retokenize
    feats = [model.preprocess(t) for t in texts(2, seed=9)]
    ref_loss, ref = param_grads(model, lambda f: ref_fn(f, None), feats)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)


def test_guide_is_never_trained_and_config_is_theirs(models):
    model, guide, _ = models
    loss = CachedGISTLoss(model, guide, mini_batch_size=4)
    before = [p.detach().clone() for p in guide.parameters()]
    guide.zero_grad(set_to_none=True)
    loss([model.preprocess(t) for t in texts(2)], None).backward()
    assert all(p.grad is None for p in guide.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, guide.parameters()))
    config = loss.get_config_dict()
    ref = GISTEmbedLoss(model, guide).get_config_dict()
    assert {k: v for k, v in config.items() if k in ref} == ref
    assert "solatorio2024gistembed" in loss.citation
    loss.temperature = 0.1
    assert loss.scale == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin_strategy": "percent"}, "margin_strategy"),
        ({"margin": float("nan")}, "margin"),
        ({"temperature": 0.0}, "temperature"),
        ({"contrast_anchors": "yes"}, "contrast_anchors"),
        ({"mini_batch_size": 0}, "mini_batch_size"),
    ],
)
def test_bad_arguments_raise_at_construction(models, kwargs, match):
    model, guide, _ = models
    with pytest.raises(ValueError, match=match):
        CachedGISTLoss(model, guide, **kwargs)


def test_guide_needs_a_known_size_under_gather(models):
    model = models[0]

    class NoSize(torch.nn.Module):
        tokenizer = model.tokenizer

        def get_embedding_dimension(self):
            return None

    with pytest.raises(ValueError, match="guide: with gather_across_devices=True"):
        CachedGISTLoss(model, NoSize(), gather_across_devices=True)


def test_calculate_loss_without_guide_embeddings_says_how(models):
    model, guide, _ = models
    loss = CachedGISTLoss(model, guide)
    with pytest.raises(ValueError, match="guide's embeddings"):
        loss.calculate_loss([[torch.randn(3, 32)], [torch.randn(3, 32)]])


def test_self_guidance_equals_gist_embed_loss(models):
    """guide=model, as sentence-transformers' own GIST tests use it: the guide's embeddings without a graph."""
    model = models[0]
    feats = [model.preprocess(t) for t in texts(3, seed=4)]
    ref_loss, ref = param_grads(
        model, lambda f: GISTEmbedLoss(model, model, 0.05, margin=0.02)(f, None), feats
    )
    ours_fn = CachedGISTLoss(model, model, 0.05, 4, margin=0.02)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert ref.abs().max() > 0
    assert_grads_close(ours, ref)


def test_positional_order_is_cached_gist_embed_losses(models):
    import inspect

    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    theirs = list(inspect.signature(CachedGISTEmbedLoss).parameters.values())
    ours = list(inspect.signature(CachedGISTLoss).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs) :])
    # the same defaults, but the guide: theirs is required, ours defaults to None (self-guided)
    assert all(m.default == t.default for m, t in zip(ours, theirs) if m.name != "guide")
    assert ours[1].name == "guide" and ours[1].default is None
    model, guide, _ = models
    feats = [model.preprocess(t) for t in texts(2, seed=6)]
    positional = CachedGISTLoss(model, guide, 0.05, 3, None, False, "relative", 0.02, False)
    keywords = CachedGISTLoss(
        model, guide, temperature=0.05, mini_batch_size=3, margin_strategy="relative", margin=0.02,
        contrast_anchors=False,
    )  # fmt: skip
    assert positional.get_config_dict() == keywords.get_config_dict()
    with torch.no_grad():
        assert float(positional(feats, None)) == float(keywords(feats, None))


UNUSED = ["directions", "partition_mode", "symmetric", "similarity_fct", "hardness_mode", "hardness_strength",
          "mask_duplicates"]  # fmt: skip


def test_gist_has_none_of_the_settings_it_does_not_use(models):
    """GIST's guide, not these options, decides which negatives count: the loss has none of them (its
    constructor does not take them, and no class it is built on gives them to it)."""
    import inspect

    model, guide, _ = models
    loss = CachedGISTLoss(model, guide)
    for name in UNUSED:
        assert not hasattr(loss, name), name
        assert name not in inspect.signature(CachedGISTLoss).parameters
        with pytest.raises(AttributeError, match=name):
            getattr(loss, name)


def _settable() -> list[str]:
    """Every public setting of CachedGISTLoss (its settings' names, its properties with a setter), besides
    those it refuses."""
    import inspect

    names = set(CachedGISTLoss.settings_class.names())
    names |= {
        n for n, m in inspect.getmembers(CachedGISTLoss) if isinstance(m, property) and m.fset is not None
    }
    return sorted(n for n in names if n not in UNUSED and not n.startswith("_"))


@pytest.mark.parametrize("learnable", [False, True], ids=["fixed_scale", "learnable_scale"])
def test_assigning_the_current_value_changes_nothing(models, learnable):
    model, guide, _ = models
    feats = [model.preprocess(t) for t in texts(3, seed=8)]

    def value(loss):
        with torch.no_grad():
            return float(loss(feats, None))

    loss = CachedGISTLoss(model, guide, 0.05, 4, margin=0.02, tile_size=3)
    loss.learnable_scale = learnable
    names = [*_settable(), "guide"]
    assert {"temperature", "scale", "learnable_scale", "max_scale", "path", "memory_budget"} <= set(names)
    snapshot = {n: getattr(loss, n) for n in names}
    before, config, retokenize = value(loss), loss.get_config_dict(), loss.must_retokenize
    for name in names:
        setattr(loss, name, getattr(loss, name))
        assert loss.get_config_dict() == config, name
        assert {n: getattr(loss, n) for n in names} == snapshot, name
    assert loss.must_retokenize == retokenize
    assert value(loss) == before


def test_each_setting_gist_uses_changes_the_loss_or_config(models):
    model, guide, other = models
    feats = [model.preprocess(t) for t in texts(3, seed=8)]

    def value(loss):
        with torch.no_grad():
            return float(loss(feats, None))

    def fresh():
        return CachedGISTLoss(model, guide, 0.05, 4, margin=0.02)

    # the loss and the config: scale, margins, contrasts, the guide
    changes_value = {
        "temperature": 0.1, "scale": 7.0, "margin": 0.05, "margin_strategy": "relative",
        "contrast_anchors": False, "contrast_positives": False, "guide": other,
    }  # fmt: skip
    for name, new in changes_value.items():
        loss = fresh()
        base_value, base_config = value(loss), loss.get_config_dict()
        setattr(loss, name, new)
        assert loss.get_config_dict() != base_config, name
        assert value(loss) != pytest.approx(base_value, rel=1e-9), name
    # the config (the same loss by design: the encoder's batching, a process group's gather, the scale's
    # parametrisation, whose gradient is checked in test_learnable_scale_gradient_is_gist_embed_losses)
    changes_config = {
        "mini_batch_size": 2, "mini_batch_num_tokens": 30, "gather_across_devices": True,
        "learnable_scale": True,
    }  # fmt: skip
    for name, new in changes_config.items():
        loss = fresh()
        base_config = loss.get_config_dict()
        setattr(loss, name, new)
        assert loss.get_config_dict() != base_config, name
    loss = fresh()
    loss.learnable_scale = True
    base_config = loss.get_config_dict()
    loss.max_scale = 123.0
    assert loss.get_config_dict() != base_config and loss.get_config_dict()["max_scale"] == 123.0
    # the engine (the same loss by design): each reaches the GradCache that runs the encoder
    engine = {
        "show_progress_bar": True, "sort_by_length": False, "reuse_last_graph": False,
        "keep_params_unsharded": True, "graph_memory_budget": 2**20, "mini_batch_memory_budget": 2**21,
    }  # fmt: skip
    for name, new in engine.items():
        loss = fresh()
        if name == "mini_batch_memory_budget":  # it sizes "auto" mini-batches only (refused without them)
            loss.update_settings(mini_batch_size="auto", mini_batch_memory_budget=new)
        else:
            setattr(loss, name, new)
        assert getattr(loss.cache, name) == new, name
    assert value(loss) == pytest.approx(value(fresh()), rel=1e-6)


def test_path_settings_reach_the_core(models, monkeypatch):
    """path / tile_size / memory_budget choose the loss-stage algorithm: each reaches the core's call."""
    import st_cached_losses.losses.stages.infonce as base

    model, guide, _ = models
    feats = [model.preprocess(t) for t in texts(2, seed=8)]
    seen: list[dict] = []
    real = base.loss_and_grad

    def spy(*args, **kwargs):
        options = args[
            3
        ]  # the core's options (InfoNCEOptions), built once by the stage from the loss's terms
        seen.append({**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "loss_and_grad", spy)
    loss = CachedGISTLoss(model, guide, 0.05, 4)
    with torch.no_grad():
        first = loss(feats, None)
    loss.path, loss.tile_size, loss.memory_budget = "tiled", 3, 12345
    with torch.no_grad():
        second = loss(feats, None)
    assert (seen[0]["path"], seen[0]["tile_size"]) == ("auto", None)
    assert (seen[1]["path"], seen[1]["tile_size"], seen[1]["memory_budget"]) == ("tiled", 3, 12345)
    assert seen[1]["ring"] and seen[1]["guide"] is not None and seen[1]["similarity"] == "cosine"
    assert float(first) == pytest.approx(float(second), rel=1e-5)


def test_assigning_a_guide_decides_retokenizing_again(models):
    """loss.guide = another model: checked as at construction, and re-tokenising follows the new guide."""
    model, guide, other = models
    feats = [model.preprocess(t) for t in texts(2, seed=10)]
    loss = CachedGISTLoss(model, guide, 0.05, 4)
    assert not loss.must_retokenize
    loss.guide = other
    assert loss.must_retokenize and loss.get_config_dict()["guide"] is other
    ref_loss, ref = param_grads(model, lambda f: GISTEmbedLoss(model, other, 0.05)(f, None), feats)
    ours_loss, ours = param_grads(model, lambda f: loss(f, None), feats)
    assert float(ours_loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_grads_close(ours, ref)
    loss.guide = model  # self-guidance: the same tokens
    assert not loss.must_retokenize
    with pytest.raises(ValueError, match="tokenizer attribute"):
        loss.guide = torch.nn.Linear(2, 2)
    assert loss.guide is model


def test_gather_assignment_checks_the_guide_as_construction(models):
    model = models[0]

    class NoSize(torch.nn.Module):
        tokenizer = model.tokenizer

        def get_embedding_dimension(self):
            return None

    loss = CachedGISTLoss(model, NoSize())
    with pytest.raises(ValueError, match="guide: with gather_across_devices=True"):
        loss.gather_across_devices = True
    assert loss.gather_across_devices is False
    loss = CachedGISTLoss(model, models[1], gather_across_devices=True)
    with pytest.raises(ValueError, match="guide: with gather_across_devices=True"):
        loss.guide = NoSize()
    assert loss.guide is models[1]


def test_learnable_scale_gradient_is_gist_embed_losses(models):
    """GIST honours learnable_scale: d loss / d log(scale) is that of GISTEmbedLoss's value (central
    differences in float64), and the model's gradient that of GISTEmbedLoss at the same scale."""
    import math

    model, guide, _ = models
    for n_cols in (2, 3):
        feats = [model.preprocess(t) for t in texts(n_cols, seed=3)]
        loss = CachedGISTLoss(model, guide, 0.05, 4, margin=0.02)
        loss.learnable_scale = True
        ours_loss, ours = param_grads(model, lambda f, fn=loss: fn(f, None), feats)
        grad_log_scale = float(loss.logit_scale.grad)
        ref_loss, ref = param_grads(
            model, lambda f: GISTEmbedLoss(model, guide, 0.05, margin=0.02)(f, None), feats
        )
        assert float(ours_loss) == pytest.approx(float(ref_loss), rel=1e-5)
        assert_grads_close(ours, ref)
        values = []
        model.double(), guide.double()
        try:
            for step in (1e-4, -1e-4):
                temperature = 1.0 / math.exp(math.log(20.0) + step)
                with torch.no_grad():
                    values.append(float(GISTEmbedLoss(model, guide, temperature, margin=0.02)(feats, None)))
        finally:
            model.float(), guide.float()
        assert grad_log_scale != 0
        assert grad_log_scale == pytest.approx((values[0] - values[1]) / 2e-4, rel=1e-3)


# --------------------------------------------------------------------------- two processes


def _ddp_other_tokenizer_worker(rank: int, world: int, paths: list[str], sizes: list[int]):
    """The review's crash: GIST under DDP with a guide of another tokenizer (read from .model each step)."""
    from sentence_transformers import SentenceTransformer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = SentenceTransformer(paths[0], device="cpu")
    model[0].auto_model.pooler = None
    other = SentenceTransformer(paths[2], device="cpu")
    loss_fn = CachedGISTLoss(model, other, 0.05, 2, contrast_anchors=False, gather_across_devices=True)
    ddp = DDP(model)
    loss_fn.model = ddp  # what the trainer does
    start = sum(sizes[:rank])
    feats = [model.preprocess(c[start : start + sizes[rank]]) for c in texts(3, seed=21)]
    ddp.zero_grad(set_to_none=True)
    loss = loss_fn(feats, None)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"loss": float(loss.detach()), "grads": grads}


def test_ddp_with_a_guide_of_another_tokenizer_equals_one_process(saved, models):
    per_rank = run_distributed(_ddp_other_tokenizer_worker, 2, saved, [5, 3], timeout=180)
    model, _, other = models
    model[0].auto_model.pooler = None
    feats = [model.preprocess(c[:8]) for c in texts(3, seed=21)]  # the 5 + 3 rows of the processes
    ref_fn = GISTEmbedLoss(model, other, 0.05, contrast_anchors=False)
    assert ref_fn.must_retokenize
    ref_loss, ref = param_grads(model, lambda f: ref_fn(f, None), feats)
    assert float(ref_loss) > 0.1, "vacuous: the guide removed every negative"
    assert _mean(per_rank, "loss") == pytest.approx(float(ref_loss), rel=1e-5)
    for r in per_rank:  # DDP's average: every process holds the global batch's gradient
        assert_grads_close(r["grads"], ref)


def _gist_worker(rank: int, world: int, paths: list[str], sizes: list[int], kind: str, margin: float = 0.1):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(paths[0], device="cpu")
    guide = SentenceTransformer(paths[1], device="cpu")
    start = sum(sizes[:rank])
    cols = [c[start : start + sizes[rank]] for c in texts(3, seed=21)]
    feats = [model.preprocess(t) for t in cols]
    if kind == "theirs":
        loss_fn = GISTEmbedLoss(model, guide, 0.05, margin=margin, gather_across_devices=True)
    else:
        loss_fn = CachedGISTLoss(
            model, guide, 0.05, margin=margin, mini_batch_size=2, gather_across_devices=True,
            path="tiled" if kind == "ring" else "auto", tile_size=3,
        )  # fmt: skip
    model.zero_grad(set_to_none=True)
    loss = loss_fn(feats, None)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"loss": float(loss), "grads": grads}


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("gist_saved")
    paths = [str(base / "model"), str(base / "guide"), str(base / "other")]
    for model, path in zip(models, paths):
        model.save(path)
    return paths


def _mean(per_rank, key):
    return sum(r[key] for r in per_rank) / len(per_rank)


def test_two_processes_equal_their_gathered_loss(saved):
    """Equal batches (their gathered loss assumes them): the mean over processes of loss and gradients."""
    theirs = run_distributed(_gist_worker, 2, saved, [4, 4], "theirs", timeout=180)
    ours = run_distributed(_gist_worker, 2, saved, [4, 4], "gather", timeout=180)
    assert _mean(ours, "loss") == pytest.approx(_mean(theirs, "loss"), rel=1e-5)
    assert_grads_close(_mean(ours, "grads"), _mean(theirs, "grads"))


@pytest.mark.skipif(not ST_6_3, reason=f"6.3's GIST rule (no row its own negative); {ST_VERSION} installed")
@pytest.mark.parametrize("kind", ["gather", "ring"])
def test_two_processes_own_rows_are_not_negatives(saved, kind):
    """A negative margin (the guide's mask keeps a row's own anchor-anchor / positive-positive entries): ours
    across 2 processes equals 6.3's gathered GISTEmbedLoss, which removes them (6.2's kept them)."""
    theirs = run_distributed(_gist_worker, 2, saved, [4, 4], "theirs", -0.1, timeout=180)
    ours = run_distributed(_gist_worker, 2, saved, [4, 4], kind, -0.1, timeout=180)
    assert _mean(ours, "loss") == pytest.approx(_mean(theirs, "loss"), rel=1e-5)
    assert_grads_close(_mean(ours, "grads"), _mean(theirs, "grads"))


def test_unequal_batches_ring_equals_gather(saved):
    gather = run_distributed(_gist_worker, 2, saved, [6, 2], "gather", timeout=180)
    ring = run_distributed(_gist_worker, 2, saved, [6, 2], "ring", timeout=180)
    assert _mean(ring, "loss") == pytest.approx(_mean(gather, "loss"), rel=1e-6)
    assert_grads_close(_mean(ring, "grads"), _mean(gather, "grads"), rtol=1e-6)
