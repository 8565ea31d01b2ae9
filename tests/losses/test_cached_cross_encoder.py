"""CachedCrossEncoderLoss against sentence-transformers' non-cached cross-encoder
MultipleNegativesRankingLoss: the same seeded step gives the same loss and parameter gradients (one global
tolerance over the whole gradient vector, gradients non-zero) for pairs and hard negatives, every
``num_negatives``, mini-batches that do and do not divide the pairs, a token budget, a prompt, two
forwards before one backward, gradient accumulation and evaluation under ``torch.no_grad``; dropout is
replayed (the same masks), not disabled; the signature, config and checks are theirs."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from sentence_transformers.cross_encoder import CrossEncoder
from sentence_transformers.cross_encoder.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

from st_cached_losses import CachedCrossEncoderLoss
from st_cached_losses.engine.features import InputsOnDemand, slice_features
from st_cached_losses.losses import cached_cross_encoder
from st_cached_losses.losses.cached_cross_encoder import in_batch_negatives
from tests.support.tiny_model import make_tiny_cross_encoder, random_texts

B = 6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("cross_encoder")
    make_tiny_cross_encoder(base / "plain")
    make_tiny_cross_encoder(base / "dropout", dropout=0.2)
    return {"plain": str(base / "plain"), "dropout": str(base / "dropout")}


def load(path: str) -> CrossEncoder:
    model = CrossEncoder(path, device="cpu", max_length=64)
    model.train()
    return model


def columns(n_cols: int, seed: int = 0, rows: int = B) -> list[list[str]]:
    # queries short, documents of widely varied length (as reranking data is)
    return [random_texts(rows, seed=seed + 17 * k, max_words=4 if k == 0 else 30) for k in range(n_cols)]


def flat_grads(model: CrossEncoder) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def step(model: CrossEncoder, loss_fn, inputs, seed: int = 12, **kwargs) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    value = loss_fn(inputs, None, **kwargs)
    value.backward()
    return value.item(), flat_grads(model)


def assert_same(
    ours: tuple[float, torch.Tensor], theirs: tuple[float, torch.Tensor], rtol: float = 2e-5
) -> None:
    (loss, grads), (ref_loss, ref_grads) = ours, theirs
    scale = ref_grads.abs().max().item()
    assert scale > 0, "vacuous: the reference gradient is zero"
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    err = (grads - ref_grads).abs().max().item()
    assert err <= rtol * scale, f"max gradient error {err:.2e} > {rtol * scale:.2e}"


CASES = [
    # (text columns, num_negatives, mini_batch_size): pairs = B * (1 + k + hard negatives)
    (2, 4, 5),  # 30 pairs: divides
    (2, 4, 7),  # does not divide
    (2, 1, 4),  # 12 pairs: divides
    (2, 1, 5),
    (2, None, 8),  # every other positive: 6 * 6 = 36 pairs
    (3, 4, 7),  # one hard-negative column: 36 pairs
    (4, 1, 5),  # two hard-negative columns: 24 pairs
    (3, None, 9),  # every other candidate of both columns: 6 * (1 + 10 + 1) = 72 pairs
]


@pytest.mark.parametrize(
    "tokenize_chunk", [64, 5], ids=["masks-measured-at-once", "masks-measured-in-chunks"]
)
@pytest.mark.parametrize(("n_cols", "num_negatives", "mini_batch_size"), CASES)
def test_equals_non_cached_loss(
    model_dirs, n_cols, num_negatives, mini_batch_size, tokenize_chunk, monkeypatch
):
    monkeypatch.setattr(cached_cross_encoder, "TOKENIZE_CHUNK", tokenize_chunk)
    model = load(model_dirs["plain"])
    inputs = columns(n_cols)
    ours = step(model, CachedCrossEncoderLoss(model, num_negatives, mini_batch_size=mini_batch_size), inputs)
    theirs = step(model, MultipleNegativesRankingLoss(model, num_negatives), inputs)
    assert_same(ours, theirs)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_pairs_are_tokenized_per_mini_batch_as_the_whole_batch_would_be(
    model_dirs, monkeypatch, padding_side
):
    """The step's column holds the pairs' attention mask (measured a chunk at a time) and tokenizes a
    mini-batch's pairs when it runs: the same inputs as slicing the whole batch tokenized at once, for
    any rows, with and without leading padding cut, with a prompt."""
    monkeypatch.setattr(cached_cross_encoder, "TOKENIZE_CHUNK", 7)
    model = load(model_dirs["plain"])
    model.tokenizer.padding_side = padding_side
    loss_fn = CachedCrossEncoderLoss(model, None)
    torch.manual_seed(0)
    pairs = loss_fn.pairs(columns(3))
    n = len(pairs)
    widths = {len(model.preprocess(pairs[i : i + 7])["input_ids"][0]) for i in range(0, n, 7)}
    assert len(widths) > 1, "vacuous: every chunk pads to the same width"
    picks = [
        torch.arange(n),
        torch.tensor([3, 0, 11]),
        torch.randperm(n, generator=torch.Generator().manual_seed(1))[:9],
    ]
    for prompt in (None, "w150 w151 "):
        at_once = dict(model.preprocess(pairs, prompt=prompt))
        column = loss_fn.features(pairs, prompt, None)
        assert isinstance(column, InputsOnDemand)
        assert torch.equal(column["attention_mask"], at_once["attention_mask"].bool())
        for rows in picks:
            for trim_leading in (True, False):
                want = slice_features(at_once, rows, n, trim_leading=trim_leading)
                got = slice_features(column, rows, n, trim_leading=trim_leading)
                assert got.keys() == want.keys()
                for key, value in want.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(got[key], value), (key, rows.tolist(), trim_leading)
                    else:
                        assert got[key] == value, key


def test_equals_their_cached_loss_and_leaves_the_generator_as_theirs(model_dirs):
    """Also their cached loss, and the CPU generator ends the step where theirs does (the next draw
    of a seeded run is the same)."""
    model = load(model_dirs["plain"])
    inputs = columns(3)
    ours = step(model, CachedCrossEncoderLoss(model, mini_batch_size=4), inputs)
    after_ours = torch.rand(3)
    theirs = step(model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), inputs)
    after_theirs = torch.rand(3)
    assert_same(ours, theirs)
    assert torch.equal(after_ours, after_theirs)


def test_token_budget(model_dirs):
    model = load(model_dirs["plain"])
    inputs = columns(3)
    loss_fn = CachedCrossEncoderLoss(model, mini_batch_num_tokens=60, mini_batch_size=1000)
    theirs = step(model, MultipleNegativesRankingLoss(model), inputs)
    assert_same(step(model, loss_fn, inputs), theirs)
    # the budget really cut the pairs into several mini-batches (else nothing was cached)
    features = loss_fn.features(loss_fn.pairs(inputs), None, None)
    assert len(loss_fn.cache.plan(0, features)) > 3


def test_prompt_is_carried_into_the_replay(model_dirs):
    """A prompt changes every pair's tokens: the cached scores, the replay and the reference must all
    read it (a replay without it would back-propagate other inputs' graphs)."""
    model = load(model_dirs["plain"])
    inputs = columns(2)
    prompt = "w150 w151 w152 "
    ours = step(model, CachedCrossEncoderLoss(model, mini_batch_size=4), inputs, prompt=prompt)
    theirs = step(model, MultipleNegativesRankingLoss(model), inputs, prompt=prompt)
    assert_same(ours, theirs)
    without = step(model, MultipleNegativesRankingLoss(model), inputs)
    assert abs(without[0] - theirs[0]) > 1e-4, "vacuous: the prompt changes nothing"


def test_dropout_is_replayed(model_dirs):
    """With dropout on, the replayed mini-batches get their first forward's masks: the gradients equal
    those of the same step with every graph kept from the first pass (nothing replayed). Dropout is really
    on: two seeds give two losses for the same pairs."""
    model = load(model_dirs["dropout"])
    inputs = columns(2)
    replayed = step(model, CachedCrossEncoderLoss(model, None, mini_batch_size=5), inputs)
    kept = step(
        model, CachedCrossEncoderLoss(model, None, mini_batch_size=5, graph_memory_budget="10GB"), inputs
    )
    assert_same(replayed, kept, rtol=1e-6)
    other_seed = step(model, CachedCrossEncoderLoss(model, None, mini_batch_size=5), inputs, seed=13)
    assert abs(other_seed[0] - replayed[0]) > 1e-4, "vacuous: dropout is off"


def test_two_forwards_before_one_backward(model_dirs):
    model = load(model_dirs["plain"])
    first, second = columns(3, seed=1), columns(3, seed=2)
    loss_fn = CachedCrossEncoderLoss(model, 2, mini_batch_size=4)
    theirs = MultipleNegativesRankingLoss(model, 2)

    def both(fn) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        a = fn(first, None)
        b = fn(second, None)
        (a + 2 * b).backward()
        return (a + 2 * b).item(), flat_grads(model)

    assert_same(both(loss_fn), both(theirs))


def test_gradient_accumulation(model_dirs):
    """Two scaled backwards accumulate into .grad as the non-cached loss's do."""
    model = load(model_dirs["plain"])
    batches = [columns(2, seed=3), columns(2, seed=4, rows=4)]

    def accumulate(fn) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        total = 0.0
        for inputs in batches:
            value = fn(inputs, None) / len(batches)
            value.backward()
            total += value.item()
        return total, flat_grads(model)

    assert_same(
        accumulate(CachedCrossEncoderLoss(model, mini_batch_size=3)),
        accumulate(MultipleNegativesRankingLoss(model)),
    )


def test_no_grad_evaluation(model_dirs):
    model = load(model_dirs["plain"])
    model.eval()
    inputs = columns(3)
    with torch.no_grad():
        torch.manual_seed(12)
        ours = CachedCrossEncoderLoss(model, mini_batch_size=4)(inputs, None)
        torch.manual_seed(12)
        theirs = MultipleNegativesRankingLoss(model)(inputs, None)
    assert ours.grad_fn is None and not ours.requires_grad
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


def test_single_mini_batch_is_the_plain_autograd_step(model_dirs):
    """A batch that fits in one mini-batch is not cached (the graph is kept), and still exact."""
    model = load(model_dirs["plain"])
    inputs = columns(2, rows=3)
    ours = step(model, CachedCrossEncoderLoss(model, mini_batch_size=64), inputs)
    assert_same(ours, step(model, MultipleNegativesRankingLoss(model), inputs))


def test_in_batch_negatives_are_theirs():
    """The same draws as sentence-transformers' sampler, and never the query's own row."""
    model_free = MultipleNegativesRankingLoss.__new__(MultipleNegativesRankingLoss)
    texts = [[f"p{i}" for i in range(5)], [f"n{i}" for i in range(5)]]
    flat = texts[0] + texts[1]
    for k in (1, 3, None, 100):
        model_free.num_negatives = k
        torch.manual_seed(3)
        theirs = list(model_free.get_in_batch_negatives(["q"] * 5, texts))
        torch.manual_seed(3)
        ours = in_batch_negatives(5, 2, k)
        assert [[flat[j] for j in col.tolist()] for col in ours.T] == theirs
        rows = torch.arange(5).unsqueeze(1)
        assert not ((ours % 5) == rows).any()


def test_signature_config_and_checks(model_dirs):
    model = load(model_dirs["plain"])
    ours, theirs = (
        inspect.signature(CachedCrossEncoderLoss),
        inspect.signature(CachedMultipleNegativesRankingLoss),
    )
    positional = [p for p in ours.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == list(theirs.parameters)
    for p in positional[1:]:
        default, their_default = p.default, theirs.parameters[p.name].default
        if isinstance(default, torch.nn.Module):
            assert type(default) is type(their_default)
        else:
            assert default == their_default, p.name
    loss = CachedCrossEncoderLoss(model, 3, 5.0, None, 7)
    assert (
        loss.get_config_dict() == CachedMultipleNegativesRankingLoss(model, 3, 5.0, None, 7).get_config_dict()
    )
    assert (
        CachedCrossEncoderLoss(model).get_config_dict()
        == CachedMultipleNegativesRankingLoss(model).get_config_dict()
    )
    assert "gao2021scaling" in loss.citation and "henderson2017efficient" in loss.citation
    loss.mini_batch_size = 3
    assert loss.cache.mini_batch_size == 3
    with pytest.raises(ValueError, match="num_negatives"):
        loss.num_negatives = 0
    with pytest.raises(ValueError, match="mini_batch_size"):
        CachedCrossEncoderLoss(model, mini_batch_size=0)
    with pytest.raises(ValueError, match="at least two text columns"):
        loss([["only queries"]], None)
    with pytest.raises(ValueError, match="empty batch"):
        loss([[], []], None)
    with pytest.raises(ValueError, match="one entry per query"):
        loss([["w1", "w2"], ["w3"]], None)


def test_refuses_other_models(model_dirs, tmp_path: Path):
    from tests.support.tiny_model import make_tiny_model

    # a SentenceTransformer, and a CrossEncoder with two labels
    with pytest.raises(ValueError, match="CrossEncoder"):
        CachedCrossEncoderLoss(make_tiny_model(tmp_path / "st"))
    two_labels = make_tiny_cross_encoder(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="1 output label"):
        CachedCrossEncoderLoss(two_labels)


def test_auto_mini_batches_and_kept_graphs(model_dirs):
    """``mini_batch_size="auto"`` (sized from a memory budget on the batch's longest pairs) and graphs kept
    within ``graph_memory_budget`` change the memory, never the result."""
    model = load(model_dirs["plain"])
    inputs = columns(3)
    theirs = step(model, MultipleNegativesRankingLoss(model), inputs)
    auto = CachedCrossEncoderLoss(model, mini_batch_size="auto", mini_batch_memory_budget="300KB")
    assert_same(step(model, auto, inputs), theirs)
    assert auto.cache.auto_size is not None and 1 <= auto.cache.auto_size < 36  # several mini-batches
    kept = CachedCrossEncoderLoss(model, mini_batch_size=5, graph_memory_budget="1MB")
    assert_same(step(model, kept, inputs), theirs)


def test_a_learnable_activation_gets_its_exact_gradient(model_dirs):
    """``activation_fn=nn.PReLU()``: the activation runs in the loss stage over the cached raw scores, so its
    parameter gets the non-cached loss's gradient (it got none), and the model's gradients stay exact."""
    model = load(model_dirs["plain"])
    inputs = columns(3)
    results = []
    for loss_cls, kwargs in (
        (MultipleNegativesRankingLoss, {}),
        (CachedCrossEncoderLoss, {"mini_batch_size": 7}),
    ):
        torch.manual_seed(0)
        activation = torch.nn.PReLU(init=0.3)
        loss_fn = loss_cls(model, 4, 10.0, activation, **kwargs)
        value, grads = step(model, loss_fn, inputs)
        assert activation.weight.grad is not None, f"{loss_cls.__name__}: the activation got no gradient"
        results.append((value, grads, activation.weight.grad.clone()))
    (value, grads, act), (ref_value, ref_grads, ref_act) = results[1], results[0]
    assert_same((value, grads), (ref_value, ref_grads))
    assert ref_act.abs().max() > 0
    torch.testing.assert_close(act, ref_act, rtol=2e-5, atol=0)


@pytest.mark.parametrize(("n_cols", "num_negatives", "mini_batch_size"), [(2, 4, 7), (3, None, 9), (4, 1, 5)])
def test_left_padding_with_absolute_positions_equals_the_non_cached_loss(
    model_dirs, n_cols, num_negatives, mini_batch_size
):
    """A left-padding tokenizer on a model with absolute positions: a pair's positions depend on its
    padding, which the non-cached loss makes per candidate column (B pairs tokenized together). Ours pads each
    pair to its own column's widest (one engine column per candidate column); it padded every pair to the
    step's widest (loss 2.1215 against their 2.2565 in the issue's case)."""
    model = load(model_dirs["plain"])
    model.tokenizer.padding_side = "left"
    inputs = columns(n_cols)
    loss_fn = CachedCrossEncoderLoss(model, num_negatives, mini_batch_size=mini_batch_size)
    torch.manual_seed(0)
    pairs = loss_fn.pairs(inputs)
    engine_columns = loss_fn.columns(pairs, B, None, None)
    widths = {c["attention_mask"].shape[1] for c in engine_columns}
    assert len(engine_columns) == len(pairs) // B and len(widths) > 1, "vacuous: every column is as wide"
    ours = step(model, loss_fn, inputs)
    theirs = step(model, MultipleNegativesRankingLoss(model, num_negatives), inputs)
    assert_same(ours, theirs)


def flat_reranker(path: Path):
    """A reranker built from a feature-extraction Transformer (a tiny Qwen2, rotary positions), last-token
    Pooling and a Dense scores head, as sentence-transformers builds one; its Transformer can flatten its
    inputs on the CPU as it does under flash attention (see tests/engine/test_flattened.py)."""
    from sentence_transformers.sentence_transformer.modules import Dense
    from transformers import DataCollatorWithFlattening

    from tests.support.tiny_model import make_tiny_decoder

    encoder = make_tiny_decoder(path, seed=0)
    transformer, pooling = encoder[0], encoder[1]
    torch.manual_seed(1)
    head = Dense(
        32, 1, activation_function=torch.nn.Identity(), module_input_name="sentence_embedding",
        module_output_name="scores",
    )  # fmt: skip
    with torch.no_grad():
        head.linear.weight.mul_(8.0)  # scores that differ, as a trained reranker's do
    model = CrossEncoder(modules=[transformer, pooling, head], device="cpu")
    transformer.data_collator = DataCollatorWithFlattening(
        return_seq_idx=True, return_flash_attn_kwargs=True, return_position_ids=True
    )
    transformer._flatten_position_offset = 0
    model.train()
    return model


def test_flattened_reranker_inputs_equal_the_padded_run(tmp_path: Path):
    """Padding-free (flattened) pairs, which sentence-transformers makes under flash attention: the same loss
    and gradients as the padded run of their non-cached loss (ours raised KeyError: 'attention_mask')."""
    model = flat_reranker(tmp_path / "qwen2")
    transformer = model[0]
    inputs = columns(3)
    theirs = step(model, MultipleNegativesRankingLoss(model), inputs)  # padded
    transformer.can_flatten_inputs = True
    try:
        loss_fn = CachedCrossEncoderLoss(model, mini_batch_size=7)
        assert "cu_seq_lens_q" in loss_fn.columns(loss_fn.pairs(inputs), B, None, None)[0]
        ours = step(model, loss_fn, inputs)
        tokens = CachedCrossEncoderLoss(model, mini_batch_num_tokens=60, mini_batch_size=1000)
        with_budget = step(model, tokens, inputs)
        with torch.no_grad():
            torch.manual_seed(12)
            evaluated = loss_fn(inputs, None).item()
    finally:
        transformer.can_flatten_inputs = False
    assert_same(ours, theirs, rtol=1e-4)
    assert_same(with_budget, theirs, rtol=1e-4)
    assert evaluated == pytest.approx(theirs[0], rel=1e-5)
