"""Padding-free (flattened) batches.

sentence-transformers 6.2 flattens text columns whenever flash attention's variable-length kernels are on
(``Transformer._can_flatten_inputs``): ``DataCollatorWithFlattening`` concatenates a column's rows into one
sequence, ``input_ids`` / ``position_ids`` / ``seq_idx`` ``(1, total)``, rows delimited by ``cu_seq_lens_q`` /
``cu_seq_lens_k`` ``(B + 1,)``, ``max_length_q`` / ``max_length_k`` the longest row, no attention mask; its
``Pooling`` pools per sequence over ``cu_seq_lens_q``. CPU torch has no flash attention, so :func:`tokenize`
switches the same collator on by hand. The model is a real tiny Qwen2 (rotary positions, last-token pooling,
the layout of decoder embedding models) whose forward honours flattened inputs on CPU: given position ids
that restart at 0 and no attention mask, transformers builds a block-diagonal mask, so each row attends only
to itself, exactly as flash attention's varlen kernel does.

Proven here: the engine slices a flattened column per sequence (the rows' tokens, with ``cu_seq_lens_q``
and every other per-sequence key rebuilt: exactly the collator's output for those rows), counts its rows
and tokens from the sequence lengths, and the cached losses (CachedMNRLoss, CachedCLIPLoss,
CachedGISTLoss, CachedMultiVectorLoss with flattened documents) on flattened columns give the loss and
parameter gradients of the padded run and of sentence-transformers' non-cached losses: mini-batches that
divide the batch and that do not, a token budget, sorting on and off, evaluation, graphs kept within a
budget, ``"auto"`` sizes, duplicate masks, a padded column beside a flattened one. On 7d62a70 every cached
run here failed: the engine read a flattened column as one row (``input_ids`` is ``(1, total)``), warned
that the batch of "1 rows" fit in one mini-batch and then raised a shape mismatch putting the B
embeddings back in place; ``mini_batch_num_tokens`` was refused (no attention mask).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sentence_transformers.sentence_transformer import losses as st_losses
from transformers import DataCollatorWithFlattening

from st_cached_losses import CachedCLIPLoss, CachedGISTLoss, CachedMNRLoss
from st_cached_losses.engine.features import (
    batch_size_of,
    input_ids_by_row,
    is_flattened,
    row_lengths,
    slice_features,
    token_counts,
)
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.functional.keys import input_hashes
from tests.losses.test_losses import assert_grads_close, flat_grads, param_grads, reference_loss_fn
from tests.support.tiny_model import WORDS, make_tiny_decoder, make_tiny_model, random_texts

B = 10  # rows: mini-batches of 3 do not divide it, of 5 do


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_decoder(tmp_path_factory.mktemp("flat") / "qwen2", seed=0)


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    """A guide with the model's tokenizer (it embeds the flattened columns as given) and one with another
    vocabulary (it re-tokenises the text it decodes from each flattened row)."""
    base = tmp_path_factory.mktemp("flat_guides")
    same = make_tiny_decoder(base / "same", seed=3, hidden=24)
    other = make_tiny_model(base / "other", seed=6, hidden=24, words=list(reversed(WORDS)))
    return same, other


def tokenize(model, texts: list[str], *, flat: bool, **kwargs) -> dict:
    """The model's features of ``texts`` (``kwargs`` to its ``preprocess``, e.g. ``task``): padded, or
    flattened as sentence-transformers flattens them when flash attention's varlen kernels are on (the
    same collator and options as its Transformer)."""
    transformer = model[0]
    transformer.data_collator = DataCollatorWithFlattening(
        return_seq_idx=True, return_flash_attn_kwargs=True, return_position_ids=True
    )
    transformer._flatten_position_offset = 0
    transformer.can_flatten_inputs = flat
    try:
        return model.preprocess(texts, **kwargs)
    finally:
        transformer.can_flatten_inputs = False


def texts(n_cols: int, seed: int = 0) -> list[list[str]]:
    return [random_texts(B, seed=seed + 31 * k, max_words=12) for k in range(n_cols)]


def both(model, cols: list[list[str]]) -> tuple[list[dict], list[dict]]:
    """The same columns padded and flattened."""
    return [tokenize(model, t, flat=False) for t in cols], [tokenize(model, t, flat=True) for t in cols]


def st_mnrl(model):
    loss = st_losses.MultipleNegativesRankingLoss(model)
    return lambda f: loss(f, None)


def test_the_model_honours_flattened_inputs(model):
    """The premise: flattened and padded features embed to the same vectors (else nothing below means
    anything), and the flattened ones are what sentence-transformers 6.2 writes."""
    padded, flat = both(model, texts(1))
    assert set(flat[0]) == {
        "input_ids",
        "position_ids",
        "seq_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "modality",
    }
    assert flat[0]["input_ids"].shape == (1, int(padded[0]["attention_mask"].sum()))
    with torch.no_grad():
        a = model(dict(padded[0]))["sentence_embedding"]
        b = model(dict(flat[0]))["sentence_embedding"]
    assert a.shape == b.shape == (B, 32)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_flattened_column_is_sliced_per_sequence(model):
    """Any rows, in any order: exactly the collator's output for those rows' texts (each row's own
    positions, ``seq_idx`` renumbered, ``cu_seq_lens`` and ``max_length`` rebuilt, dtypes kept)."""
    (col,) = texts(1)
    padded, flat = tokenize(model, col, flat=False), tokenize(model, col, flat=True)
    assert is_flattened(flat) and not is_flattened(padded)
    assert batch_size_of(flat) == B
    lengths = padded["attention_mask"].sum(1)
    torch.testing.assert_close(row_lengths(flat, B), lengths)
    torch.testing.assert_close(token_counts(flat, B), token_counts(padded, B))
    for rows in ([3, 0, 7], [9], list(range(B)), [5, 4, 3, 2, 1, 0, 9, 8, 7, 6]):
        got = slice_features(flat, torch.tensor(rows), B)
        want = tokenize(model, [col[i] for i in rows], flat=True)
        assert set(got) == set(want)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), key
            else:
                assert got[key] == value, key
        assert [col[i] for i in rows] == [
            " ".join(model[0].processor.decode(ids, skip_special_tokens=True).split())
            for ids in input_ids_by_row(got)
        ]


@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("mini_batch_size", [3, 5], ids=["mb3-not-dividing", "mb5-dividing"])
@pytest.mark.parametrize("n_cols", [2, 3], ids=["pairs", "triplets"])
def test_cached_mnr_on_flattened_equals_padded_and_st_mnrl(model, n_cols, mini_batch_size, sort_by_length):
    padded, flat = both(model, texts(n_cols, seed=n_cols))
    ref_loss, ref = param_grads(model, st_mnrl(model), padded)
    options = {"mini_batch_size": mini_batch_size, "sort_by_length": sort_by_length}
    loss_flat, ours_flat = param_grads(model, lambda f: CachedMNRLoss(model, **options)(f, None), flat)
    loss_padded, ours_padded = param_grads(model, lambda f: CachedMNRLoss(model, **options)(f, None), padded)
    torch.testing.assert_close(loss_flat, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_padded, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours_flat, ref)
    assert_grads_close(ours_flat, ours_padded)
    # and sentence-transformers' own cached loss, which also takes flattened columns
    theirs = st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    their_loss, their_grads = param_grads(model, lambda f: theirs(f, None), flat)
    torch.testing.assert_close(loss_flat, their_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours_flat, their_grads)


@pytest.mark.parametrize("sort_by_length", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("budget", [14, 40])
def test_token_budget_counts_sequence_lengths(model, budget, sort_by_length):
    """``mini_batch_num_tokens`` on a flattened column: the mini-batches of the padded column (the same
    real tokens), each within the budget (or one row), and the same loss and gradients."""
    padded, flat = both(model, texts(2, seed=7))
    cache = GradCache(mini_batch_size=1, mini_batch_num_tokens=budget, sort_by_length=sort_by_length)
    for k in range(2):
        plan = cache.plan(k, flat[k])
        assert [mb.rows.tolist() for mb in plan] == [mb.rows.tolist() for mb in cache.plan(k, padded[k])]
        assert len(plan) > 2  # the budget cuts the column
        for mb in plan:
            n = mb.features["input_ids"].shape[1]
            assert n == int(token_counts(flat[k], B)[mb.rows].sum())
            assert n <= budget or len(mb.rows) == 1
        # as many mini-batches as other processes run (a sharded wrapper): halved ones and fillers, each
        # a well-formed flattened batch of its rows
        agreed = cache.plan(k, flat[k], count=len(plan) + B)
        assert len(agreed) == len(plan) + B and sum(mb.filler for mb in agreed) > 0
        for mb in agreed:
            f = mb.features
            assert batch_size_of(f) == len(mb.rows)
            assert int(f["cu_seq_lens_q"][-1]) == f["input_ids"].shape[1] == f["position_ids"].shape[1]
            assert f["seq_idx"].max() == len(mb.rows) - 1
    ref_loss, ref = param_grads(model, st_mnrl(model), padded)
    options = {"mini_batch_num_tokens": budget, "sort_by_length": sort_by_length}
    loss, ours = param_grads(model, lambda f: CachedMNRLoss(model, **options)(f, None), flat)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


@pytest.mark.parametrize("mini_batch_size", [3, 5])
def test_cached_clip_on_flattened_equals_the_symmetric_reference(model, mini_batch_size):
    padded, flat = both(model, texts(2, seed=11))
    ref_loss, ref = param_grads(model, reference_loss_fn(model, symmetric=True), padded)
    loss_fn = CachedCLIPLoss(model, mini_batch_size=mini_batch_size)
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), flat)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


@pytest.mark.parametrize("guide", ["same-tokenizer", "other-tokenizer"])
def test_cached_gist_on_flattened_equals_gist_embed_loss(model, guides, guide):
    """The guide embeds the flattened columns as given (same tokenizer), or the text decoded from each
    flattened row (another tokenizer)."""
    guide_model = guides[0] if guide == "same-tokenizer" else guides[1]
    padded, flat = both(model, texts(3, seed=5))
    options = {"temperature": 0.05, "margin_strategy": "relative", "margin": 0.03}
    oracle = st_losses.GISTEmbedLoss(model, guide_model, **options)
    ref_loss, ref = param_grads(model, lambda f: oracle(f, None), padded)
    loss_fn = CachedGISTLoss(model, guide_model, **options, mini_batch_size=3)
    assert loss_fn.must_retokenize == (guide == "other-tokenizer")
    loss, ours = param_grads(model, lambda f: loss_fn(f, None), flat)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


def _replays(model, loss_fn, features) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Loss, parameter gradients, and the encoder forwards the backward ran (the replays)."""
    calls = [0]
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features)
    handle = model[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        loss.backward()
    finally:
        handle.remove()
    return loss.detach(), flat_grads(model).clone(), calls[0]


@pytest.mark.parametrize(
    ("options", "replays"),
    [
        ({"reuse_last_graph": False}, (12, 12)),
        ({"graph_memory_budget": "1GB"}, (0, 0)),  # every graph kept
        # some kept (the estimate of a flattened mini-batch counts its rows' tokens): 6 of 12 here
        ({"graph_memory_budget": 800_000}, (3, 9)),
        # sized from a measured probe: 4 rows, or 56 tokens, here
        ({"mini_batch_size": "auto", "mini_batch_memory_budget": 300_000}, (3, 11)),
        ({"mini_batch_num_tokens": "auto", "mini_batch_memory_budget": 300_000}, (3, 11)),
        ({"mask_duplicates": True}, (11, 11)),
    ],
    ids=["no-reuse", "graphs-all", "graphs-some", "auto-rows", "auto-tokens", "mask-duplicates"],
)
def test_engine_options_on_flattened_equal_padded(model, options, replays):
    """Options of the engine on a flattened column: the padded run's loss and gradients, and as many
    replays as it (``replays``: at least, at most; 3 columns of 4 mini-batches of 3 rows, the last graph
    kept unless ``reuse_last_graph=False``)."""
    cols = texts(3, seed=13)
    cols[1][6] = cols[1][2]  # the same positive twice: a false negative with mask_duplicates
    padded, flat = both(model, cols)
    options = {"mini_batch_size": 3, **options}
    loss_padded, ref, n_padded = _replays(model, lambda f: CachedMNRLoss(model, **options)(f, None), padded)
    loss_flat, ours, n_flat = _replays(model, lambda f: CachedMNRLoss(model, **options)(f, None), flat)
    torch.testing.assert_close(loss_flat, loss_padded, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)
    assert replays[0] <= n_flat <= replays[1], n_flat
    assert replays[0] <= n_padded <= replays[1], n_padded
    if options.get("mask_duplicates"):
        assert torch.equal(input_hashes(flat[1]), input_hashes(padded[1]))
        assert int(input_hashes(flat[1]).unique().numel()) == B - 1
    else:
        # the oracle, so that the options above cannot agree with a wrong padded run
        ref_loss, plain = param_grads(model, st_mnrl(model), padded)
        torch.testing.assert_close(loss_flat, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_close(ours, plain)


def test_evaluation_on_flattened_equals_padded(model):
    padded, flat = both(model, texts(3, seed=17))
    loss_fn = CachedMNRLoss(model, mini_batch_size=3)
    with torch.no_grad():
        ours = loss_fn(flat, None)
        ref = st_losses.MultipleNegativesRankingLoss(model)(padded, None)
    assert not ours.requires_grad
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_a_padded_column_beside_a_flattened_one(model):
    """Columns of one batch may come in different layouts (e.g. ColBERT queries padded for their
    expansion tokens, documents flattened): each is cut in its own."""
    padded, flat = both(model, texts(3, seed=19))
    mixed = [padded[0], flat[1], padded[2]]
    ref_loss, ref = param_grads(model, st_mnrl(model), padded)
    loss, ours = param_grads(model, lambda f: CachedMNRLoss(model, mini_batch_size=4)(f, None), mixed)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


@pytest.fixture(scope="module")
def multi_vector(tmp_path_factory):
    """A MultiVectorEncoder on a tiny Qwen2 (token projection, MultiVectorMask, Normalize, as the encoder
    builds it from a plain checkpoint), with the word-level tokenizer padding on the right."""
    from sentence_transformers import MultiVectorEncoder
    from transformers import BertTokenizerFast

    path = tmp_path_factory.mktemp("flat_mv") / "qwen2"
    make_tiny_decoder(path, seed=2)
    torch.manual_seed(2)
    model = MultiVectorEncoder(str(path), device="cpu")
    model[0].processor = BertTokenizerFast.from_pretrained(str(path), padding_side="right")
    return model


@pytest.mark.parametrize(
    "options", [{"mini_batch_size": 3}, {"mini_batch_num_tokens": 20}], ids=["mb3", "tokens20"]
)
def test_cached_multi_vector_on_flattened_documents(multi_vector, options):
    """Multi-vector: queries padded (sentence-transformers never flattens query-expansion queries),
    documents flattened; their MultiVectorMask re-pads each mini-batch's token embeddings. The same loss
    and gradients as sentence-transformers' non-cached MultiVectorMultipleNegativesRankingLoss on padded
    documents."""
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    from st_cached_losses import CachedMultiVectorLoss

    model = multi_vector
    cols = texts(3, seed=23)
    tasks = ("query", "document", "document")
    padded = [{**tokenize(model, t, flat=False, task=task), "task": task} for t, task in zip(cols, tasks)]
    flat = [padded[0]] + [
        {**tokenize(model, t, flat=True, task="document"), "task": "document"} for t in cols[1:]
    ]
    assert all(is_flattened(f) for f in flat[1:])
    oracle = MultiVectorMultipleNegativesRankingLoss(model)
    ref_loss, ref = param_grads(model, oracle, padded)
    loss, ours = param_grads(model, CachedMultiVectorLoss(model, **options), flat)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ours, ref)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("flat_dist") / "qwen2"
    make_tiny_decoder(path, seed=4)
    return str(path)


def _ddp_worker(rank: int, world: int, path: str, sizes: list[int], options: dict, agree: bool) -> dict:
    """One DDP step of CachedMNRLoss gathered across processes, on this process's rows, flattened."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.support.tiny_model import load_tiny_decoder

    assert torch.distributed.get_world_size() == world
    model = load_tiny_decoder(path)
    cols = texts(3, seed=29)
    start = sum(sizes[:rank])
    feats = [tokenize(model, t[start : start + sizes[rank]], flat=True) for t in cols]
    loss_fn = CachedMNRLoss(model, gather_across_devices=True, **options)
    loss_fn.cache = dataclasses.replace(loss_fn.cache, agree_mini_batches=agree)  # the engine is frozen
    loss_fn.model = DDP(model)  # what sentence-transformers' trainer does with a wrapped model
    loss = loss_fn(feats, None)
    loss.backward()
    return {"loss": float(loss), "grads": flat_grads(model)}


@pytest.mark.parametrize(
    ("options", "agree"),
    [({"mini_batch_size": 2}, False), ({"mini_batch_num_tokens": 16}, True)],
    ids=["rows", "tokens-agreed"],
)
def test_flattened_across_processes_equal_the_global_batch(decoder_dir, options, agree):
    """2 gloo processes with unequal flattened batches (4 and 6 rows), gathered: every process's
    parameter gradients are those of sentence-transformers' MNRL on the padded global batch (with
    ``agree_mini_batches`` and a token budget of 16, the process of 4 rows cuts 3 mini-batches per column
    where the other cuts 5, 4 and 5: it runs halved mini-batches and fillers to match)."""
    from tests.support.dist_utils import run_distributed
    from tests.support.tiny_model import load_tiny_decoder

    sizes = [4, 6]
    per_rank = run_distributed(_ddp_worker, 2, decoder_dir, sizes, options, agree)
    model = load_tiny_decoder(decoder_dir)
    padded = [tokenize(model, t, flat=False) for t in texts(3, seed=29)]
    ref_loss, ref = param_grads(model, st_mnrl(model), padded)
    # each process returns its share of the global loss, which DDP's mean makes the global batch's
    assert sum(r["loss"] for r in per_rank) / 2 == pytest.approx(float(ref_loss), rel=1e-5)
    for r in per_rank:
        assert_grads_close(r["grads"], ref)
