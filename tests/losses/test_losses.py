"""CachedMNRLoss / CachedCLIPLoss on a tiny random BERT: parameter gradients against the naive
reference and against sentence-transformers' own losses, dropout replay, and the engine's shortcuts."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.util import cos_sim, dot_score

from st_cached_losses import CachedCLIPLoss, CachedMNRLoss, CachedTiledLoss
from st_cached_losses.engine.gradcache import GradCache, RandState
from tests.support.reference import reference_infonce
from tests.support.tiny_model import make_tiny_model, random_texts

B = 11  # rows: mini-batch sizes 4 and 5 do not divide it, 32 exceeds it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dropout") / "bert", dropout=0.3, seed=1)


def columns(model, n_cols: int, b: int = B, seed: int = 0):
    texts = [random_texts(b, seed=seed + 100 * k) for k in range(n_cols)]
    return [model.preprocess(t) for t in texts]


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
    )


def param_grads(model, loss_fn, features, multiplier: float = 1.0):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features)
    (loss * multiplier).backward()
    return loss.detach(), flat_grads(model).clone()


def reference_loss_fn(model, symmetric: bool, similarity: str = "cosine", scale: float = 20.0):
    def fn(features):
        embs = [model(dict(f))["sentence_embedding"] for f in features]
        return reference_infonce(embs[0], embs[1:], scale=scale, similarity=similarity, symmetric=symmetric)

    return fn


def assert_grads_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """One global tolerance over the whole gradient vector (some entries are analytically zero)."""
    assert ref.abs().max() > 0, "vacuous comparison: reference gradient is zero"
    err = (ours - ref).norm() / ref.norm()
    assert err < rtol * 10, f"relative gradient error {err:.2e}"
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


LOSSES = [(CachedMNRLoss, False), (CachedCLIPLoss, True)]


@pytest.mark.parametrize(("cls", "symmetric"), LOSSES, ids=["mnr", "clip"])
@pytest.mark.parametrize("n_cols", [2, 3, 5], ids=["pairs", "triplets", "3neg"])
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("mini_batch_size", [4, 32])
def test_parameter_gradients_match_reference(model, cls, symmetric, n_cols, similarity, mini_batch_size):
    feats = columns(model, n_cols)
    scale = 20.0 if similarity == "cosine" else 0.5
    ref_loss, ref = param_grads(model, reference_loss_fn(model, symmetric, similarity, scale), feats)
    loss_fn = cls(model, scale=scale, similarity_fct=similarity, mini_batch_size=mini_batch_size)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


@pytest.mark.parametrize("mini_batch_size", [5, 64])
@pytest.mark.parametrize("n_cols", [2, 4])
def test_mnr_matches_sentence_transformers_mnrl(model, mini_batch_size, n_cols):
    """An outside oracle: sentence-transformers' own MultipleNegativesRankingLoss."""
    feats = columns(model, n_cols, seed=7)
    st_loss = st_losses.MultipleNegativesRankingLoss(model, scale=20.0, similarity_fct=cos_sim)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = CachedMNRLoss(model, scale=20.0, similarity_fct=cos_sim, mini_batch_size=mini_batch_size)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


def test_clip_matches_sentence_transformers_symmetric_directions(model):
    feats = columns(model, 2, seed=9)
    st_loss = st_losses.MultipleNegativesRankingLoss(
        model, scale=20.0, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    ours_fn = CachedCLIPLoss(model, scale=20.0, mini_batch_size=3)
    loss, ours = param_grads(model, lambda f: ours_fn(f, None), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


def test_dot_score_is_a_gemm_tile_and_other_functions_are_scored_as_given(model):
    assert CachedMNRLoss(model, similarity_fct=dot_score).similarity == "dot"
    fn = lambda a, b: a @ b.T  # noqa: E731
    loss = CachedMNRLoss(model, similarity_fct=fn)
    assert loss.similarity is fn and loss.get_config_dict()["similarity_fct"] == "<lambda>"
    with pytest.raises(ValueError, match="similarity"):
        CachedMNRLoss(model, similarity_fct="jaccard")


class _Recorder:
    """Records every sentence embedding the model produces, in order."""

    def __init__(self, model):
        self.outputs: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(
            lambda m, i, o: self.outputs.append(o["sentence_embedding"].detach().clone())
        )

    def close(self):
        self.handle.remove()


def _stage_and_replay_outputs(model, feats, replay_rng: bool):
    loss_fn = CachedMNRLoss(model, mini_batch_size=4, reuse_last_graph=False, sort_by_length=False)
    model.train()
    rec = _Recorder(model)
    patch = contextlib.nullcontext()
    if not replay_rng:
        patch = pytest.MonkeyPatch.context()
    with patch as mp:
        if mp is not None:
            mp.setattr(RandState, "replay", lambda self: contextlib.nullcontext())
        loss = loss_fn(feats, None)
        n_stage1 = len(rec.outputs)
        loss.backward()
    rec.close()
    return rec.outputs[:n_stage1], rec.outputs[n_stage1:]


def test_dropout_is_active_and_replayed_with_the_same_masks(dropout_model):
    feats = columns(dropout_model, 2, b=10, seed=3)
    dropout_model.train()
    with torch.no_grad():
        a = dropout_model(dict(feats[0]))["sentence_embedding"]
        b = dropout_model(dict(feats[0]))["sentence_embedding"]
    assert not torch.allclose(a, b), "canary: dropout must be active for this test to mean anything"
    stage1, replay = _stage_and_replay_outputs(dropout_model, feats, replay_rng=True)
    assert len(stage1) == len(replay) == 6  # 3 mini-batches per column (4 + 4 + 2 rows)
    for s, r in zip(stage1, replay):
        torch.testing.assert_close(s, r, rtol=0, atol=1e-6)
    # and without restoring the RNG the replayed masks differ: the test above can fail
    stage1, replay = _stage_and_replay_outputs(dropout_model, feats, replay_rng=False)
    assert any(not torch.allclose(s, r) for s, r in zip(stage1, replay))


@pytest.mark.parametrize(("cls", "symmetric"), LOSSES, ids=["mnr", "clip"])
def test_grad_output_scaling(model, cls, symmetric):
    feats = columns(model, 3)
    loss_fn = cls(model, mini_batch_size=4)
    _, g1 = param_grads(model, lambda f: loss_fn(f, None), feats)
    _, g3 = param_grads(model, lambda f: loss_fn(f, None), feats, multiplier=3.5)
    assert_grads_close(g3, 3.5 * g1)


def test_two_forwards_before_one_backward(model):
    f1, f2 = columns(model, 2, seed=1), columns(model, 3, seed=2)
    loss_fn = CachedCLIPLoss(model, mini_batch_size=4)
    _, g1 = param_grads(model, lambda f: loss_fn(f, None), f1)
    _, g2 = param_grads(model, lambda f: loss_fn(f, None), f2)
    model.zero_grad(set_to_none=True)
    (loss_fn(f1, None) + 2 * loss_fn(f2, None)).backward()
    assert_grads_close(flat_grads(model), g1 + 2 * g2)


@pytest.mark.parametrize(("cls", "symmetric"), LOSSES, ids=["mnr", "clip"])
def test_evaluation_without_grad_matches_reference(model, cls, symmetric):
    feats = columns(model, 3)
    loss_fn = cls(model, mini_batch_size=4)
    model.eval()
    with torch.no_grad():
        ours = loss_fn(feats, None)
        ref = reference_loss_fn(model, symmetric)(feats)
    assert not ours.requires_grad
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options", [{"reuse_last_graph": False}, {"sort_by_length": False}, {"mini_batch_num_tokens": 40}]
)
def test_engine_options_give_the_same_gradients(model, options):
    feats = columns(model, 3)
    _, plain = param_grads(model, reference_loss_fn(model, False), feats)
    loss_fn = CachedMNRLoss(model, mini_batch_size=4, **options)
    _, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    assert_grads_close(ours, plain)


def _budget_features(lengths: list[int], width: int = 10) -> dict:
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return {"input_ids": mask.clone(), "attention_mask": mask}


def test_token_budget_and_sorting_plan():
    """sentence-transformers' meaning: a budget of real tokens, mini_batch_size unused (here 1), rows
    packed greedily (longest first when sorting), a row longer than the budget alone."""
    cache = GradCache(mini_batch_size=1, mini_batch_num_tokens=11)
    lengths = torch.tensor([2, 10, 3, 6, 1, 4])
    feats = _budget_features(lengths.tolist())
    plan = cache.plan(0, feats)
    # real tokens: 10 | 6 + 4 | 3 + 2 + 1 (a padded-token budget would have cut 6 | 4 + 3 | 2 + 1: 2 x 6 > 11)
    assert [mb.rows.tolist() for mb in plan] == [[1], [3, 5], [2, 0, 4]]
    seen = torch.cat([mb.rows for mb in plan]).tolist()
    assert seen == torch.argsort(lengths, descending=True, stable=True).tolist()
    for mb in plan:
        # trailing padding trimmed to the mini-batch's longest row
        assert mb.features["attention_mask"].shape[1] == int(lengths[mb.rows].max())
        assert int(lengths[mb.rows].sum()) <= 11 or len(mb.rows) == 1
    # a row longer than the budget is a mini-batch of its own
    assert [mb.rows.tolist() for mb in GradCache(mini_batch_num_tokens=5).plan(0, feats)] == [
        [1],
        [3],
        [5],
        [2, 0],
        [4],
    ]


@pytest.mark.parametrize("budget", [1, 4, 7, 12, 16, 40, 1000])
def test_token_budget_unsorted_equals_sentence_transformers_ranges(budget):
    """Without sorting, the mini-batches are exactly sentence-transformers' (their ``_minibatch_ranges``)."""
    from sentence_transformers.base.losses.gradcache import _minibatch_ranges

    feats = _budget_features([2, 10, 3, 6, 1, 4, 4, 9, 1, 1, 7])
    theirs = _minibatch_ranges(feats, mini_batch_size=3, mini_batch_num_tokens=budget)
    plan = GradCache(mini_batch_size=3, mini_batch_num_tokens=budget, sort_by_length=False).plan(0, feats)
    assert [(int(mb.rows[0]), int(mb.rows[-1]) + 1) for mb in plan] == theirs
    assert torch.cat([mb.rows for mb in plan]).tolist() == list(range(11))


def test_token_budget_fits_in_one_and_needs_an_attention_mask():
    feats = _budget_features([3, 4, 5])
    # 12 real tokens: within a budget of 12 whatever mini_batch_size says, not within 11
    assert GradCache(mini_batch_size=1, mini_batch_num_tokens=12).fits_in_one([feats])
    assert not GradCache(mini_batch_size=64, mini_batch_num_tokens=11).fits_in_one([feats])
    no_mask = {"input_ids": feats["input_ids"]}
    with pytest.raises(ValueError, match="mini_batch_num_tokens=12 needs each row's token count"):
        GradCache(mini_batch_num_tokens=12).plan(0, no_mask)
    assert len(GradCache(mini_batch_size=2).plan(0, no_mask)) == 2


def test_fits_in_one_means_the_whole_batch_every_column_together():
    """Caching is off only when all the columns' rows (or tokens) together fit in one mini-batch: columns
    that each fit but not together are cached (issue 44: 33 distillation columns at mini_batch_size >= B
    held every column's graph, the non-cached loss's memory)."""
    col = _budget_features([3, 4])  # 2 rows, 7 real tokens, 4 wide
    assert GradCache(mini_batch_size=4).fits_in_one([col, col])
    assert not GradCache(mini_batch_size=3).fits_in_one([col, col])  # each column fits, not both
    assert not GradCache(mini_batch_size=2).fits_in_one([col] * 33)
    # a token budget: real tokens summed over the columns (14)
    assert GradCache(mini_batch_num_tokens=14).fits_in_one([col, col])
    assert not GradCache(mini_batch_num_tokens=13).fits_in_one([col, col])
    # a lone row is one mini-batch whatever its length; two columns of one long row each are not
    row = _budget_features([9])
    assert GradCache(mini_batch_num_tokens=5).fits_in_one([row])
    assert not GradCache(mini_batch_num_tokens=5).fits_in_one([row, row])
    # an "auto" budget: padded tokens (each column's rows as wide as its widest: 2 x 4) summed, 16 (not
    # the 14 real ones)
    auto = GradCache(mini_batch_num_tokens="auto", mini_batch_memory_budget=1)
    auto.auto.size = 16
    assert auto.fits_in_one([col, col])
    auto.auto.size = 15
    assert not auto.fits_in_one([col, col])
    # agreed counts (a sharded wrapper: every process decides alike): one column in one mini-batch only
    assert GradCache(mini_batch_size=64).fits_in_one([col], counts=[1])
    assert not GradCache(mini_batch_size=64).fits_in_one([col, col], counts=[1, 1])
    assert not GradCache(mini_batch_size=64).fits_in_one([col], counts=[2])


def _count_forwards(model):
    """A forward hook counting ``model``'s forwards with and without grad mode; returns (counts, handle)."""
    calls = {"grad": 0, "no_grad": 0}

    def hook(*_):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    return calls, model.register_forward_hook(hook)


@pytest.mark.parametrize(
    ("b", "mini", "cached"),
    [(2, 8, False), (4, 4, True), (4, 7, True)],
    ids=["whole-batch-fits", "B=mini", "B<mini<2B"],
)
def test_a_pair_batch_is_cached_unless_both_columns_fit_together(model, b, mini, cached):
    """2 columns x 2 rows at mini_batch_size 8: the plain autograd path (every forward with its graph, no
    replay). B <= mini_batch_size < 2B: cached, one column's graph at a time (the first column's stage-1
    graph dropped at once and replayed in backward, the last one's kept), as sentence-transformers' cached
    loss: 3 forwards. Exact either way."""
    feats = columns(model, 2, b=b, seed=21)
    ref_loss, ref = param_grads(model, reference_loss_fn(model, symmetric=False), feats)
    calls, handle = _count_forwards(model)
    try:
        loss, got = param_grads(model, CachedMNRLoss(model, mini_batch_size=mini), feats)
    finally:
        handle.remove()
    # (a column's last stage-1 forward runs with a graph, to tell whether its encoder is frozen)
    assert calls == ({"grad": 3, "no_grad": 0} if cached else {"grad": 2, "no_grad": 0})
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(got, ref)


def test_token_budget_ignores_mini_batch_size_and_stays_exact(model):
    """The budget alone sets the mini-batches (mini_batch_size=1 would be one row each): exact gradients."""
    feats = columns(model, 3)
    _, plain = param_grads(model, reference_loss_fn(model, False), feats)
    loss_fn = CachedMNRLoss(model, mini_batch_size=1, mini_batch_num_tokens=30)
    calls = []
    handle = model[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        _, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    finally:
        handle.remove()
    assert_grads_close(ours, plain)
    plans = [loss_fn.cache.plan(k, f) for k, f in enumerate(feats)]
    assert all(1 < len(p) < B for p in plans), [len(p) for p in plans]
    tokens = [f["attention_mask"].sum(1) for f in feats]
    for plan, t in zip(plans, tokens):
        assert all(int(t[mb.rows].sum()) <= 30 or len(mb.rows) == 1 for mb in plan)
    # stage 1 once per mini-batch, the replays but the kept last one
    n = sum(len(p) for p in plans)
    assert len(calls) == 2 * n - 1, (len(calls), n)


def test_frozen_column_is_not_replayed(model, tmp_path):
    """A Router whose document encoder is frozen: that column is embedded once, never replayed."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Router

    query_model = make_tiny_model(tmp_path / "q", seed=3)
    doc_model = make_tiny_model(tmp_path / "d", seed=4)
    q_tr, d_tr = query_model[0], doc_model[0]
    for p in d_tr.parameters():
        p.requires_grad_(False)
    router = Router.for_query_document(query_modules=[q_tr], document_modules=[d_tr])
    router_model = SentenceTransformer(
        modules=[router, Pooling(q_tr.get_embedding_dimension())], device="cpu"
    )
    texts = [random_texts(10, seed=s) for s in (1, 2)]
    feats = [
        router_model.preprocess(texts[0], task="query"),
        router_model.preprocess(texts[1], task="document"),
    ]
    _, ref = param_grads(router_model, reference_loss_fn(router_model, False), feats)
    loss_fn = CachedMNRLoss(router_model, mini_batch_size=4)
    rec = _Recorder(router_model)
    _, ours = param_grads(router_model, lambda f: loss_fn(f, None), feats)
    rec.close()
    assert_grads_close(ours, ref)
    # stage 1: 3 + 3 mini-batches; replay: the query column's 3 minus the kept last graph... the
    # kept graph belongs to the last column (documents, frozen), so all 3 query mini-batches replay
    assert len(rec.outputs) == 6 + 3


def test_bad_input(model):
    loss_fn = CachedMNRLoss(model, mini_batch_size=4)
    with pytest.raises(ValueError, match="at least two"):
        loss_fn(columns(model, 1), None)
    a = model.preprocess(random_texts(5, seed=1))
    p = model.preprocess(random_texts(6, seed=2))
    with pytest.raises(ValueError, match="same number of rows"):
        loss_fn([a, p], None)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="mini_batch_size"):
            CachedMNRLoss(model, mini_batch_size=bad)
    with pytest.raises(ValueError, match="scale"):
        CachedMNRLoss(model, scale=0.0)


def test_static_embedding_refused():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    static = SentenceTransformer(modules=[StaticEmbedding(tok, embedding_dim=8)], device="cpu")
    with pytest.raises(ValueError, match="StaticEmbedding"):
        CachedMNRLoss(static)


def test_input_hashes_ignore_padding_and_side():
    from st_cached_losses.functional.keys import input_hashes

    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 6, 8, 0, 0]])
    mask = (ids != 0).long()
    keys = input_hashes({"input_ids": ids, "attention_mask": mask})
    short = input_hashes({"input_ids": ids[:1, :3], "attention_mask": mask[:1, :3]})
    assert keys[0] == keys[1] == keys[2] == short[0]
    assert keys[3] != keys[0]


@pytest.mark.parametrize(("cls", "symmetric"), LOSSES, ids=["mnr", "clip"])
def test_mask_duplicates_matches_masked_reference(model, cls, symmetric):
    from st_cached_losses.functional.keys import input_hashes

    texts = [random_texts(9, seed=40 + k) for k in range(3)]
    texts[1][5] = texts[1][0]  # a duplicate positive
    texts[2][3] = texts[1][0]  # a hard negative equal to row 0's positive
    texts[0][7] = texts[0][2]  # a duplicate anchor (symmetric direction)
    feats = [model.preprocess(t) for t in texts]
    keys = [input_hashes(f) for f in feats]

    def ref_fn(f):
        embs = [model(dict(x))["sentence_embedding"] for x in f]
        return reference_infonce(
            embs[0], embs[1:], symmetric=symmetric, anchor_keys=keys[0], candidate_keys=keys[1:]
        )

    ref_loss, ref = param_grads(model, ref_fn, feats)
    loss_fn = cls(model, mini_batch_size=4, mask_duplicates=True)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)
    unmasked = reference_loss_fn(model, symmetric)(feats)
    assert abs(unmasked.item() - ref_loss.item()) > 1e-3, "the test data must contain duplicates"


def test_clamped_learnable_scale_recovers_through_an_optimizer_step(tmp_path):
    """A scale above ``max_scale`` is used at the limit, with the gradient it has there, and one SGD
    step on a loss that wants a smaller scale brings it back below the limit."""
    from st_cached_losses import CachedCLIPLoss

    model = make_tiny_model(tmp_path / "m")
    loss = CachedCLIPLoss(model, scale=20.0, learnable_scale=True, max_scale=50.0, mini_batch_size=2)
    with torch.no_grad():
        loss.logit_scale.fill_(math.log(60.0))
    assert loss.scale == pytest.approx(50.0)
    texts = [random_texts(6, seed=1), random_texts(6, seed=2)]  # unrelated pairs: a lower scale fits better
    feats = [model.preprocess(t) for t in texts]
    value = loss(feats, None)
    value.backward()
    grad = float(loss.logit_scale.grad)
    assert grad > 0, "the loss must pull the scale down, and its gradient must not vanish at the limit"
    # the gradient is the one of the unclamped loss at s = 50
    embs = [model(dict(f))["sentence_embedding"] for f in feats]
    s = torch.tensor(50.0, requires_grad=True)
    reference_infonce(embs[0], embs[1:], scale=s, symmetric=True).backward()
    assert grad == pytest.approx(float(s.grad) * 50.0, rel=1e-3)
    torch.optim.SGD([loss.logit_scale], lr=1e-2).step()
    assert loss.scale < 50.0 and float(loss.logit_scale) < math.log(50.0)


def test_second_backward_says_already_back_propagated(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    loss = CachedMNRLoss(model, mini_batch_size=2)
    value = loss([model.preprocess(random_texts(5, seed=s)) for s in (1, 2)], None)
    value.backward()
    with pytest.raises(RuntimeError, match="already back-propagated"):
        value.backward()


def _left_padded_columns(model, b: int = 12):
    texts = [random_texts(b, seed=40 + k, min_words=1, max_words=25) for k in range(2)]
    feats = [model.preprocess(t) for t in texts]
    mask = feats[0]["attention_mask"]
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all(), "the columns must be left-padded"
    return feats


@pytest.mark.parametrize("mini_batch_size", [1, 4, 12])
def test_left_padding_absolute_positions_independent_of_mini_batch(tmp_path_factory, mini_batch_size):
    """BERT numbers positions from the first (padding) token: a left-padded row keeps the padding it
    came with, so every mini-batch size gives sentence-transformers' non-cached result."""
    from st_cached_losses.engine.features import position_shift_invariant

    model = make_tiny_model(tmp_path_factory.mktemp("left") / "bert")
    model[0].tokenizer.padding_side = "left"
    model.eval()
    assert not position_shift_invariant(model)
    feats = _left_padded_columns(model)
    st_loss = st_losses.MultipleNegativesRankingLoss(model)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    loss, ours = param_grads(
        model, lambda f: CachedMNRLoss(model, mini_batch_size=mini_batch_size)(f, None), feats
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


def test_left_padding_rotary_decoder_trims_and_stays_exact(tmp_path_factory):
    """Rotary positions only see differences: leading padding is cut (fewer positions embedded) and the
    result still equals the non-cached loss."""
    from st_cached_losses.engine.features import position_shift_invariant
    from st_cached_losses.engine.gradcache import GradCache
    from tests.support.tiny_model import make_tiny_decoder

    model = make_tiny_decoder(tmp_path_factory.mktemp("dec") / "qwen2")
    model.eval()
    assert position_shift_invariant(model)
    feats = _left_padded_columns(model)
    width = feats[0]["attention_mask"].shape[1]
    shortest = GradCache(mini_batch_size=4).plan(0, feats[0])[-1].features["attention_mask"].shape[1]
    assert shortest < width, "the shortest rows' mini-batch must not carry the longest row's padding"
    st_loss = st_losses.MultipleNegativesRankingLoss(model)
    ref_loss, ref = param_grads(model, lambda f: st_loss(f, None), feats)
    for size in (1, 4):
        loss, ours = param_grads(
            model, lambda f, size=size: CachedMNRLoss(model, mini_batch_size=size)(f, None), feats
        )
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_close(ours, ref)


def test_scale_accepts_real_scalars_and_counts_refuse_booleans(model):
    import numpy as np

    for scale in (torch.tensor(20.0), np.float32(20.0), np.int64(20), 20):
        assert CachedMNRLoss(model, scale=scale).scale == pytest.approx(20.0)
    for bad in ("20", True, float("nan"), -1.0, torch.ones(2)):
        with pytest.raises(ValueError, match="scale"):
            CachedMNRLoss(model, scale=bad)
    for name in ("mini_batch_size", "mini_batch_num_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            CachedMNRLoss(model, **{name: True})


def _masked_symmetric(make_kwargs):
    def make(model):
        from st_cached_losses import CachedTiledLoss

        cls = CachedTiledLoss if "symmetric" in make_kwargs else CachedCLIPLoss
        return cls(model, mini_batch_size=4, mask_duplicates=True, **make_kwargs)

    return make


@pytest.mark.parametrize(
    "make",
    [
        _masked_symmetric({"path": "chunked"}),
        _masked_symmetric({"path": "tiled"}),
        _masked_symmetric({"symmetric": True, "tile_size": 3}),
    ],
    ids=["clip-chunked", "clip-tiled", "tiled-symmetric"],
)
def test_shared_positive_masked_in_both_directions(model, make):
    """Rows 0 and 1 share their positive text: d0_1 is not a negative of q_0 (nor d0_0 of q_1), and q_1 is
    not a negative of d0_0 (nor q_0 of d0_1), as in the reference with both directions masked."""
    from st_cached_losses.functional.keys import input_hashes

    texts = [random_texts(9, seed=60 + k) for k in range(2)]
    texts[1][1] = texts[1][0]
    feats = [model.preprocess(t) for t in texts]
    keys = [input_hashes(f) for f in feats]
    assert len(set(keys[0].tolist())) == 9 and len(set(keys[1].tolist())) == 8, "one shared positive only"

    def ref_fn(f):
        embs = [model(dict(x))["sentence_embedding"] for x in f]
        return reference_infonce(
            embs[0], embs[1], symmetric=True, anchor_keys=keys[0], candidate_keys=keys[1:]
        )

    ref_loss, ref = param_grads(model, ref_fn, feats)
    loss_fn = make(model)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), feats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)
    with torch.no_grad():
        # evaluation: the core's autograd entry, without a graph
        torch.testing.assert_close(loss_fn(feats, None), ref_loss, rtol=1e-5, atol=1e-6)
        # non-vacuous: with the positive -> anchors direction left unmasked the loss is another one
        embs = [model(dict(x))["sentence_embedding"] for x in feats]
        forward = reference_infonce(embs[0], embs[1], anchor_keys=keys[0], candidate_keys=keys[1:])
        one_direction = (forward + reference_infonce(embs[1], embs[0])) / 2
    assert abs(one_direction.item() - ref_loss.item()) > 1e-3


def test_loss_warns_once_when_caching_is_off(model):
    """A batch that fits in one mini-batch saves nothing: the loss says so (once), at the caller's line."""
    import warnings

    loss_fn = CachedMNRLoss(model, mini_batch_size=32)
    feats = columns(model, 2)  # B = 11 rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn(feats, None).backward()
        loss_fn(feats, None).backward()
    relevant = [w for w in caught if "caching saves no memory" in str(w.message)]
    assert len(relevant) == 1 and relevant[0].filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CachedMNRLoss(model, mini_batch_size=4)(feats, None).backward()
    assert not [w for w in caught if "caching saves no memory" in str(w.message)]


@pytest.mark.parametrize("cls", [CachedCLIPLoss, CachedTiledLoss])
def test_calculate_loss_called_directly_gives_the_learnable_scale_its_gradient(model, cls):
    """``calculate_loss(reps, with_backward=True)`` outside a step (no ``step``): the embeddings' ``.grad``
    and, through the returned loss, ``logit_scale.grad`` equal autograd's through the same loss."""
    loss = cls(model, learnable_scale=True, scale=10.0)
    torch.manual_seed(0)
    embeddings = [torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8)]
    ref_reps = [[e.clone().requires_grad_()] for e in embeddings]
    loss.calculate_loss(ref_reps).backward()
    ref_scale_grad = loss.logit_scale.grad.clone()
    loss.logit_scale.grad = None
    reps = [[e.clone().requires_grad_()] for e in embeddings]
    value = loss.calculate_loss(reps, with_backward=True)
    assert loss.logit_scale.grad is None  # not yet: through the returned loss
    value.backward()
    torch.testing.assert_close(loss.logit_scale.grad, ref_scale_grad, rtol=1e-5, atol=1e-7)
    assert float(ref_scale_grad) != 0.0
    for r, ref in zip(reps, ref_reps):
        torch.testing.assert_close(r[0].grad, ref[0].grad, rtol=1e-5, atol=1e-7)
