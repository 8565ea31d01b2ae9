"""CachedEmbedDistillLoss against sentence-transformers' non-cached EmbedDistillLoss (the oracle) on a tiny random
BERT: the same loss and every parameter gradient (the model's and the projection's) for each metric, with and
without a projection, one and two columns, 2-D and 3-D labels, mini-batches smaller than the batch; inside
MatryoshkaLoss; evaluation; the projection's save / load; config round trip and refusals."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer import losses as st_losses

from st_cached_losses import CachedEmbedDistillLoss
from tests.losses.test_losses import assert_grads_close, flat_grads
from tests.support.tiny_model import make_tiny_model, random_texts

B = 7  # rows: mini-batch size 3 does not divide it
D = 32  # the tiny model's width
TEACHER_D = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_embed_distill") / "bert", dropout=0.0)


def columns(model, n_cols: int, b: int = B, seed: int = 0):
    return [model.preprocess(random_texts(b, seed=seed + 100 * k)) for k in range(n_cols)]


def teacher_labels(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grads_of(model, loss, feats, labels):
    """The loss and the flat gradient vector of the model's parameters then the projection's."""
    model.zero_grad(set_to_none=True)
    if getattr(loss, "projection", None) is not None:
        loss.projection.zero_grad(set_to_none=True)
    value = loss(feats, labels)
    value.backward()
    flat = flat_grads(model)
    if getattr(loss, "projection", None) is not None:
        proj = torch.cat([p.grad.reshape(-1) for p in loss.projection.parameters()])
        assert proj.abs().max() > 0, "vacuous: the projection's gradient is zero"
        flat = torch.cat([flat, proj])
    return value.detach(), flat.clone()


def pair(model, metric, projection_dim, mini_batch_size=3, **ours_kwargs):
    """Their loss and ours with the same projection weights."""
    theirs = st_losses.EmbedDistillLoss(model, metric, projection_dim)
    ours = CachedEmbedDistillLoss(
        model, metric, projection_dim, mini_batch_size=mini_batch_size, **ours_kwargs
    )
    if projection_dim is not None:
        ours.projection.load_state_dict(theirs.projection.state_dict())
    return theirs, ours


@pytest.mark.parametrize("metric", ["cosine", "l2", "mse"])
@pytest.mark.parametrize("projection_dim", [None, TEACHER_D], ids=["no-projection", "projection"])
@pytest.mark.parametrize(
    ("n_cols", "labels_dim"), [(1, 2), (2, 3), (2, 2)], ids=["1col", "2col-3d", "2col-broadcast"]
)
@pytest.mark.parametrize("mini_batch_size", [3, 32], ids=["mb3", "one-mini-batch"])
def test_matches_embed_distill_loss(model, metric, projection_dim, n_cols, labels_dim, mini_batch_size):
    d_t = projection_dim or D
    shape = (B, d_t) if labels_dim == 2 else (B, n_cols, d_t)
    labels = teacher_labels(shape, seed=n_cols)
    feats = columns(model, n_cols)
    torch.manual_seed(0)
    theirs, ours = pair(model, metric, projection_dim, mini_batch_size)
    ref_loss, ref = grads_of(model, theirs, feats, labels)
    loss, got = grads_of(model, ours, feats, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_default_loss_is_a_positional_drop_in(model):
    """The constructor takes theirs positionally (model, distance_metric, projection_dim) with their defaults,
    and the config has their keys with their values."""
    theirs = st_losses.EmbedDistillLoss(model, "l2", 16)
    ours = CachedEmbedDistillLoss(model, "l2", 16)
    config = ours.get_config_dict()
    assert {k: config[k] for k in theirs.get_config_dict()} == theirs.get_config_dict()
    default = CachedEmbedDistillLoss(model)
    assert (
        default.distance_metric == "cosine" and default.projection_dim is None and default.projection is None
    )
    assert "kim2023embeddistill" in ours.citation and "gao2021scaling" in ours.citation


def test_matryoshka_matches(model):
    """Inside MatryoshkaLoss (which decorates calculate_loss): the same loss and gradients as MatryoshkaLoss
    around EmbedDistillLoss, which cuts labels of the model's width to each dimension."""
    feats = columns(model, 2, seed=5)
    labels = teacher_labels((B, 2, D), seed=5)
    dims, weights = [32, 16, 8], [1.0, 0.5, 2.0]
    theirs = st_losses.MatryoshkaLoss(model, st_losses.EmbedDistillLoss(model, "mse"), dims, weights)
    ours = st_losses.MatryoshkaLoss(
        model, CachedEmbedDistillLoss(model, "mse", mini_batch_size=3), dims, weights
    )
    ref_loss, ref = grads_of(model, theirs, feats, labels)
    loss, got = grads_of(model, ours, feats, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_matryoshka_with_a_projection_is_refused(model):
    ours = st_losses.MatryoshkaLoss(
        model, CachedEmbedDistillLoss(model, "cosine", TEACHER_D, mini_batch_size=3), [32, 16]
    )
    with pytest.raises(ValueError, match="cannot go through the full-width projection"):
        ours(columns(model, 1), teacher_labels((B, TEACHER_D)))


def test_evaluation_gives_the_same_loss(model):
    feats = columns(model, 2, seed=7)
    labels = teacher_labels((B, 2, TEACHER_D), seed=7)
    theirs, ours = pair(model, "cosine", TEACHER_D)
    with torch.no_grad():
        torch.testing.assert_close(ours(feats, labels), theirs(feats, labels), rtol=1e-5, atol=1e-6)


def test_compute_loss_from_embeddings_takes_their_form(model):
    """Their ``compute_loss_from_embeddings(embeddings, teacher_embeddings)``: one teacher tensor per column."""
    theirs, ours = pair(model, "l2", TEACHER_D)
    embs = [torch.randn(B, D, requires_grad=True) for _ in range(2)]
    teachers = [teacher_labels((B, TEACHER_D), seed=k) for k in range(2)]
    ref = theirs.compute_loss_from_embeddings(embs, teachers)
    ref_grads = torch.autograd.grad(ref, embs)
    got = ours.compute_loss_from_embeddings(embs, teachers)
    got_grads = torch.autograd.grad(got, embs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_projection_saves_and_loads_as_theirs(model, tmp_path):
    """Their file loads into ours and ours into theirs; a loss without a projection makes one from the file."""
    theirs = st_losses.EmbedDistillLoss(model, "cosine", TEACHER_D)
    theirs.save_projection(tmp_path / "theirs.safetensors")
    ours = CachedEmbedDistillLoss(model)
    ours.load_projection(tmp_path / "theirs.safetensors")
    assert ours.projection_dim == TEACHER_D
    torch.testing.assert_close(ours.projection.weight, theirs.projection.weight)
    ours.save_projection(tmp_path / "ours.safetensors")
    again = st_losses.EmbedDistillLoss(model, "cosine")
    again.load_projection(tmp_path / "ours.safetensors")
    torch.testing.assert_close(again.projection.bias, theirs.projection.bias)
    assert "projection.weight" in dict(ours.named_parameters())
    with pytest.raises(ValueError, match="No projection layer to save"):
        CachedEmbedDistillLoss(model).save_projection(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match="does not match the configured projection"):
        CachedEmbedDistillLoss(model, "cosine", 5).load_projection(tmp_path / "ours.safetensors")


def test_assigning_projection_dim_rebuilds_the_projection(model):
    loss = CachedEmbedDistillLoss(model, "cosine", 8)
    assert loss.projection.out_features == 8
    loss.projection_dim = 12
    assert loss.projection.out_features == 12
    loss.projection_dim = None
    assert loss.projection is None


def test_config_round_trip_and_refusals(model):
    loss = CachedEmbedDistillLoss(
        model, "mse", 16, mini_batch_size=4, listwise_weight=0.5, listwise_scale=10.0
    )
    config = loss.get_config_dict()
    assert config["listwise_weight"] == 0.5 and config["listwise_scale"] == 10.0
    assert CachedEmbedDistillLoss(model, **config).get_config_dict() == config
    with pytest.raises(ValueError, match="distance_metric must be one of"):
        CachedEmbedDistillLoss(model, "dot")
    with pytest.raises(ValueError, match="are all 0"):
        CachedEmbedDistillLoss(model, pointwise_weight=0.0)
    ours = CachedEmbedDistillLoss(model, mini_batch_size=3)
    feats = columns(model, 2)
    with pytest.raises(ValueError, match="requires pre-computed teacher embeddings"):
        ours(feats, None)
    with pytest.raises(ValueError, match=r"Number of label columns \(3\)"):
        ours(feats, teacher_labels((B, 3, D)))
    with pytest.raises(ValueError, match="set projection_dim=12"):
        ours(feats, teacher_labels((B, 12)))


def test_registered_by_name():
    from st_cached_losses.config.registry import canonical_loss

    assert canonical_loss("embed_distill") == "embed_distill"
    assert canonical_loss("EmbedDistillLoss") == "embed_distill"
    assert canonical_loss("CachedEmbedDistillLoss") == "embed_distill"


def test_built_from_yaml_and_trains_with_the_stock_trainer(model, tmp_path):
    """The arguments route: a YAML file names the loss (sentence-transformers' class name) and its settings;
    the one-column dataset passes the dataset check; the stock trainer runs two steps, the projection learns."""
    import yaml
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from transformers import HfArgumentParser

    from st_cached_losses import build_loss
    from st_cached_losses.config.factory import check_dataset_columns
    from st_cached_losses.config.training_args import CachedLossTrainingArguments

    fields = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": "none",
        "loss": "EmbedDistillLoss",
        "mini_batch_size": 3,
        "per_device_train_batch_size": 8,
        "max_steps": 2,
        "distance_metric": "mse",
        "projection_dim": TEACHER_D,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(fields))
    (args,) = HfArgumentParser(CachedLossTrainingArguments).parse_yaml_file(str(tmp_path / "run.yaml"))
    texts = random_texts(16, seed=11)
    dataset = Dataset.from_dict(
        {"sentence": texts, "label": teacher_labels((16, TEACHER_D), seed=11).tolist()}
    )
    check_dataset_columns(dataset, args)
    loss = build_loss(model, args)
    assert isinstance(loss, CachedEmbedDistillLoss) and loss.distance_metric == "mse"
    before = loss.projection.weight.detach().clone()
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    trainer.train()
    assert not torch.equal(before, loss.projection.weight.detach()), "the projection was not trained"
    model.save(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert (
        "CachedEmbedDistillLoss" in card
        and "kim2023embeddistill" in card
        and '"distance_metric": "mse"' in card
    )


# ---------------------------------------------------------------------- the live teacher (item 3 of the issue)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A teacher reading the student's tokens (same vocabulary, as many tokens: embedded from the features as
    they are) and one of another width reading fewer tokens (re-tokenised from the decoded texts)."""
    root = tmp_path_factory.mktemp("embed_distill_teachers")
    same = make_tiny_model(root / "same", seed=3, hidden=TEACHER_D * 2)
    fewer = make_tiny_model(root / "fewer", seed=4, hidden=TEACHER_D, max_seq_length=16)
    for t in (same, fewer):
        t.requires_grad_(False)
    return {"same": same, "fewer": fewer}


def precomputed(teacher, texts_by_column):
    """The labels a preprocessing pass would write: the teacher's embeddings of each column, (B, K, d_t)."""
    with torch.no_grad():
        return torch.stack(
            [teacher(teacher.preprocess(texts))["sentence_embedding"] for texts in texts_by_column], dim=1
        )


@pytest.mark.parametrize("which", ["same", "fewer"])
@pytest.mark.parametrize(
    "kwargs",
    [{"distance_metric": "cosine"}, {"distance_metric": "l2", "listwise_weight": 0.5}],
    ids=["pointwise", "pointwise+listwise"],
)
def test_live_teacher_equals_precomputed_labels(model, teachers, which, kwargs):
    """``teacher=`` embeds every column in stage 1 (mini-batch by mini-batch, no graph; re-tokenised where it
    reads fewer tokens): the same loss and gradients as the labels its preprocessing pass would give."""
    teacher = teachers[which]
    d_t = teacher.get_embedding_dimension()
    texts = [random_texts(B, seed=21 + k) for k in range(2)]
    feats = [model.preprocess(t) for t in texts]
    labels = precomputed(teacher, texts)
    with_labels = CachedEmbedDistillLoss(model, projection_dim=d_t, mini_batch_size=3, **kwargs)
    live = CachedEmbedDistillLoss(model, projection_dim=d_t, mini_batch_size=3, teacher=teacher, **kwargs)
    live.projection.load_state_dict(with_labels.projection.state_dict())
    assert live.stage.teacher.retokenize == (which == "fewer")
    ref_loss, ref = grads_of(model, with_labels, feats, labels)
    loss, got = grads_of(model, live, feats, None)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)
    assert all(p.grad is None for p in teacher.parameters()), "the teacher got a gradient"
    with torch.no_grad():  # evaluation embeds with the teacher too
        torch.testing.assert_close(live(feats, None), with_labels(feats, labels), rtol=1e-5, atol=1e-6)


def test_live_teacher_with_labels_is_refused(model, teachers):
    live = CachedEmbedDistillLoss(
        model, projection_dim=TEACHER_D * 2, teacher=teachers["same"], mini_batch_size=3
    )
    with pytest.raises(ValueError, match="got both a teacher model and labels"):
        live(columns(model, 1), teacher_labels((B, TEACHER_D * 2)))
    assert "teacher" in live.get_config_dict()


# ---------------------------------------------------------------------- the listwise term (item 2 of the issue)


def naive_combined(
    model,
    theirs,
    feats,
    labels,
    pointwise_weight,
    listwise_weight,
    scale,
    teacher_scale,
    dims=None,
    infonce=0.0,
):
    """``pointwise_weight`` x their EmbedDistillLoss + ``listwise_weight`` x the dense listwise reference, on
    the model's embeddings with autograd (``dims``: the Matryoshka widths, weight 1 each, the teacher's rows
    at full width for the listwise term; ``infonce``: the weight of the dense InfoNCE of the anchors against every
    candidate at scale 20)."""
    from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

    from tests.support.reference import reference_infonce, reference_listwise_kl

    embs = [model(dict(f))["sentence_embedding"] for f in feats]
    teachers = list(labels.unbind(1))
    total = 0.0
    for dim in dims or [None]:
        e = [shrink(x, dim) for x in embs] if dim else embs
        t = [x[..., :dim] for x in teachers] if dim and labels.shape[-1] == D else teachers
        value = pointwise_weight * theirs.compute_loss_from_embeddings(e, t) if pointwise_weight else 0.0
        listwise = reference_listwise_kl(
            e[0],
            torch.cat(e[1:]),
            teachers[0],
            torch.cat(teachers[1:]),
            scale=scale,
            teacher_scale=teacher_scale,
        )
        total = total + value + listwise_weight * listwise
        if infonce:
            total = total + infonce * reference_infonce(e[0], e[1:], scale=20.0, similarity="cosine")
    return total


@pytest.mark.parametrize(
    ("n_cols", "projection_dim", "weights", "tile"),
    [
        (2, None, (1.0, 0.5, 0.0), 3),
        (3, TEACHER_D, (1.0, 2.0, 0.0), 4),
        (3, None, (0.0, 1.0, 0.0), 5),
        (2, TEACHER_D, (0.3, 1.0, 0.0), None),
        (3, None, (0.0, 1.0, 0.5), 4),
    ],
    ids=[
        "pairs-pointwise+listwise",
        "hard-negative-projection",
        "listwise-alone",
        "default-tile",
        "listwise+infonce",
    ],
)
def test_listwise_term_matches_the_dense_reference(model, n_cols, projection_dim, weights, tile):
    """pointwise_weight x EmbedDistillLoss + listwise_weight x the dense float64-checked reference, with
    hard-negative columns, tiles that do not divide the rows, the teacher of another width than the student
    (the listwise term needs no projection) and the teacher's scale apart from the student's."""
    pw, lw, iw = weights
    d_t = projection_dim or D
    labels = teacher_labels((B, n_cols, d_t), seed=40 + n_cols)
    feats = columns(model, n_cols, seed=40)
    theirs, ours = pair(
        model,
        "cosine",
        projection_dim,
        pointwise_weight=pw,
        listwise_weight=lw,
        listwise_scale=20.0,
        listwise_teacher_scale=50.0,
        infonce_weight=iw,
        tile_size=tile,
    )
    if not pw and projection_dim is None:
        # the listwise term alone takes a teacher of any width
        labels = teacher_labels((B, n_cols, TEACHER_D), seed=41)
    ref_loss, ref = grads_of(
        model, lambda f, y: naive_combined(model, theirs, f, y, pw, lw, 20.0, 50.0, infonce=iw), feats, labels
    )
    if projection_dim is not None and pw:
        ref = torch.cat([ref, torch.cat([p.grad.reshape(-1) for p in theirs.projection.parameters()])])
    loss, got = grads_of(model, ours, feats, labels)
    if projection_dim is not None and not pw:
        got = got[: ref.numel()]
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_listwise_inside_matryoshka(model):
    """Inside MatryoshkaLoss every width's listwise term ranks with the truncated student rows and the
    teacher's full rows; the pointwise term cuts labels of the model's width as theirs."""
    dims = [32, 16, 8]
    labels = teacher_labels((B, 3, D), seed=50)
    feats = columns(model, 3, seed=50)
    theirs = st_losses.EmbedDistillLoss(model, "l2")
    ours = st_losses.MatryoshkaLoss(
        model, CachedEmbedDistillLoss(model, "l2", mini_batch_size=3, listwise_weight=0.7, tile_size=4), dims
    )
    ref_loss, ref = grads_of(
        model,
        lambda f, y: naive_combined(model, theirs, f, y, 1.0, 0.7, 20.0, 20.0, dims=dims),
        feats,
        labels,
    )
    loss, got = grads_of(model, ours, feats, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_listwise_needs_two_columns(model):
    ours = CachedEmbedDistillLoss(model, listwise_weight=1.0, mini_batch_size=3)
    with pytest.raises(ValueError, match="needs at least two text columns"):
        ours(columns(model, 1), teacher_labels((B, D)))


def test_teacher_model_field_loads_the_teacher(model, teachers, tmp_path):
    """``teacher_model`` (a path) gives the loss a frozen teacher, loaded on the model's device; the other
    fields set the terms."""
    from st_cached_losses import build_loss
    from st_cached_losses.config.training_args import CachedLossTrainingArguments

    teachers["fewer"].save(str(tmp_path / "teacher"))
    args = CachedLossTrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        loss="embed_distill",
        teacher_model=str(tmp_path / "teacher"),
        projection_dim=TEACHER_D,
        listwise_weight=0.5,
        listwise_teacher_scale=30.0,
        mini_batch_size=3,
    )
    loss = build_loss(model, args)
    assert loss.teacher is not None and not any(p.requires_grad for p in loss.teacher.parameters())
    assert (loss.listwise_weight, loss.listwise_teacher_scale, loss.projection_dim) == (0.5, 30.0, TEACHER_D)
    value = loss(columns(model, 2), None)
    assert torch.isfinite(value)


@pytest.mark.parametrize(
    "engine",
    [{"mini_batch_num_tokens": 40}, {"mini_batch_size": "auto", "mini_batch_memory_budget": "64MiB"}],
    ids=["token-budget", "auto"],
)
def test_engine_options_give_the_same_result(model, engine):
    """A token budget per mini-batch and ``"auto"`` sizes change the memory, not the loss or the gradients."""
    labels = teacher_labels((B, 2, TEACHER_D), seed=60)
    feats = columns(model, 2, seed=60)
    theirs = st_losses.EmbedDistillLoss(model, "l2", TEACHER_D)
    ours = CachedEmbedDistillLoss(model, "l2", TEACHER_D, show_progress_bar=True, **engine)
    ours.projection.load_state_dict(theirs.projection.state_dict())
    ref_loss, ref = grads_of(model, theirs, feats, labels)
    loss, got = grads_of(model, ours, feats, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)
