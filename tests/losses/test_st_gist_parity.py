"""sentence-transformers' own ``CachedGISTEmbedLoss`` tests (its repository's
``tests/sentence_transformer/losses/test_cached_gist_embed.py``) that use only the public API, run with
their class name bound to ours: ``CachedGISTEmbedLoss = CachedGISTLoss``. Their bodies are kept; the
adaptations, each for something that cannot run offline or is not in the installed package:

* their ``stsb_bert_tiny_model`` fixture downloads a model: a tiny random BERT (hidden 128, so that their
  Matryoshka dims 128 / 64 / 32 apply) whose vocabulary holds every word of their texts stands in;
* their ``static_embedding`` fixture downloads a tokenizer: a StaticEmbedding on the tiny BERT's tokenizer;
* ``test_accepts_a_tokenizer_without_a_vocab_attribute``: its precondition (the slow GPT2 tokenizer has no
  ``.vocab``) is false in the installed transformers 5.23, for their own loss too: that one assertion dropped;
* ``tests.sentence_transformer.losses.utils`` (``assert_trained``, ``disable_dropout``, ``gradients``) is
  not installed with the package: small equivalents below.

Excluded, because they drive private internals rather than the public API:
``test_gather_rank1_positive_not_masked_with_margin``, ``test_gather_rank1_margin_zero_baseline``,
``test_positive_mask_protects_ce_target_column`` (they monkeypatch the module's ``all_gather_with_grad`` /
``get_rank``, build the object with ``__new__`` and call ``calculate_loss(reps, reps_guided)``, their
private signature); ``test_relative_margin_negative_positive_score_suppresses_closer_negative`` (the same,
capturing their ``cross_entropy_loss`` attribute; our equivalent, the relative margin against
GISTEmbedLoss, is in tests/losses/test_gist.py); ``test_cached_gist_replays_dropout_in_the_backward_pass``
(spies on their ``embed_minibatch`` method; our dropout-replay canaries are in tests/losses/test_losses.py and
tests/engine/test_graph_budget.py).
"""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

from st_cached_losses import CachedGISTLoss as CachedGISTEmbedLoss
from tests.support.tiny_model import make_tiny_model

_THEIR_TEXTS = [
    "anchor a", "anchor b", "anchor c", "anchor d", "anchor e", "positive a", "positive b", "positive c",
    "positive d", "positive e", "negative a", "negative b", "negative c", "negative d", "negative e",
    "a", "anchor b with quite a few more words in it", "c and d", "final anchor sentence", "e", "short",
    "positive b also has a longer surface form", "p", "another positive text", "q r",
]  # fmt: skip
_WORDS = sorted({w for text in _THEIR_TEXTS for w in text.split()})


@pytest.fixture(scope="module")
def stsb_bert_tiny_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("their_tiny") / "bert", hidden=128, dropout=0.1, seed=3, words=_WORDS
    )


@pytest.fixture
def static_embedding(stsb_bert_tiny_model):
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    return StaticEmbedding(stsb_bert_tiny_model.tokenizer, embedding_dim=16)


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_trained(grads: dict[str, torch.Tensor]) -> None:
    assert grads and any(g.abs().sum() > 0 for g in grads.values()), "no parameter received a gradient"


def _tokenizer_without_vocab_attribute(tmp_path):
    """A real slow tokenizer that exposes `get_vocab()` but has no `.vocab` attribute."""
    import json

    from transformers.models.gpt2.tokenization_gpt2 import GPT2Tokenizer

    (tmp_path / "vocab.json").write_text(json.dumps({"<unk>": 0, "the": 1, "cat": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n\u0120 t\n")
    return GPT2Tokenizer(
        vocab_file=str(tmp_path / "vocab.json"),
        merges_file=str(tmp_path / "merges.txt"),
        unk_token="<unk>",
    )


class _ModelWithTokenizer(torch.nn.Module):
    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.max_seq_length = 128
        self.linear = torch.nn.Linear(2, 2)

    def __getitem__(self, index):
        return self.linear


@pytest.mark.parametrize("loss_class", [GISTEmbedLoss, CachedGISTEmbedLoss])
def test_accepts_a_tokenizer_without_a_vocab_attribute(loss_class, tmp_path) -> None:
    tokenizer = _tokenizer_without_vocab_attribute(tmp_path)
    # their precondition `tokenizer.vocab` raising AttributeError does not hold in transformers 5.23 (the
    # slow GPT2 tokenizer has a .vocab there; it fails for their GISTEmbedLoss alike): dropped

    model = _ModelWithTokenizer(tokenizer)
    guide = _ModelWithTokenizer(tokenizer)

    loss = loss_class(model, guide)

    assert loss.must_retokenize is False


def test_cached_gist_two_forwards_before_one_backward(stsb_bert_tiny_model) -> None:
    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()

    anchors = ["anchor a", "anchor b", "anchor c", "anchor d", "anchor e"]
    positives = ["positive a", "positive b", "positive c", "positive d", "positive e"]
    first = [model.preprocess(anchors[:3]), model.preprocess(positives[:3])]
    second = [model.preprocess(anchors[2:]), model.preprocess(positives[2:])]
    labels = torch.zeros(3, dtype=torch.long)

    def make_loss() -> CachedGISTEmbedLoss:
        return CachedGISTEmbedLoss(model, guide=model, mini_batch_size=2)

    model.zero_grad()
    shared = make_loss()
    (shared(first, labels) + shared(second, labels)).backward()
    shared_grads = gradients(model)

    model.zero_grad()
    (make_loss()(first, labels) + make_loss()(second, labels)).backward()
    reference_grads = gradients(model)

    assert_trained(shared_grads)
    for name, grad in shared_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("num_columns", [2, 3])
@pytest.mark.parametrize("mini_batch_size", [2, 3])
def test_cached_gist_matches_gist(stsb_bert_tiny_model, num_columns: int, mini_batch_size: int) -> None:
    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()

    columns = [
        ["anchor a", "anchor b", "anchor c", "anchor d", "anchor e"],
        ["positive a", "positive b", "positive c", "positive d", "positive e"],
        ["negative a", "negative b", "negative c", "negative d", "negative e"],
    ][:num_columns]
    labels = torch.zeros(5, dtype=torch.long)

    def loss_and_grads(loss_fn: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss_value = loss_fn([model.preprocess(column) for column in columns], labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedGISTEmbedLoss(model, guide=model, mini_batch_size=mini_batch_size)
    )
    plain_loss, plain_grads = loss_and_grads(GISTEmbedLoss(model, guide=model))

    assert_trained(cached_grads)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_cached_gist_rejects_static_embedding_behind_a_router(static_embedding, stsb_bert_tiny_model) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Router

    model = SentenceTransformer(
        modules=[
            Router.for_query_document(query_modules=[static_embedding], document_modules=[static_embedding])
        ]
    )
    with pytest.raises(
        ValueError, match="not compatible with a SentenceTransformer model based on a StaticEmbedding"
    ):
        CachedGISTEmbedLoss(model, guide=stsb_bert_tiny_model)


@pytest.mark.parametrize("mini_batch_size", [2, 3])
def test_gist_matryoshka_matches_cached_gist_matryoshka(stsb_bert_tiny_model, mini_batch_size: int) -> None:
    import copy

    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()
    guide = copy.deepcopy(model)

    anchors = ["anchor a", "anchor b", "anchor c", "anchor d", "anchor e"]
    positives = ["positive a", "positive b", "positive c", "positive d", "positive e"]
    labels = torch.zeros(5, dtype=torch.long)

    def loss_and_grads(inner: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        features = [model.preprocess(anchors), model.preprocess(positives)]
        loss_value = MatryoshkaLoss(model, inner, matryoshka_dims=[128, 64, 32])(features, labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    plain_loss, plain_grads = loss_and_grads(GISTEmbedLoss(model, guide=guide))
    cached_loss, cached_grads = loss_and_grads(
        CachedGISTEmbedLoss(model, guide=guide, mini_batch_size=mini_batch_size)
    )

    assert_trained(plain_grads)
    assert plain_loss.item() == pytest.approx(cached_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grad, cached_grads[name], rtol=1e-4, atol=1e-4, msg=name)


def test_cached_gist_token_budget_matches_gist(stsb_bert_tiny_model) -> None:
    model = stsb_bert_tiny_model.to("cpu")
    disable_dropout(model)
    model.train()

    anchors = ["a", "anchor b with quite a few more words in it", "c and d", "final anchor sentence", "e"]
    positives = ["short", "positive b also has a longer surface form", "p", "another positive text", "q r"]
    labels = torch.zeros(5, dtype=torch.long)

    def loss_and_grads(loss_fn: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss_value = loss_fn([model.preprocess(anchors), model.preprocess(positives)], labels)
        loss_value.backward()
        return loss_value.detach(), gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedGISTEmbedLoss(model, guide=model, mini_batch_num_tokens=16)
    )
    plain_loss, plain_grads = loss_and_grads(GISTEmbedLoss(model, guide=model))

    assert_trained(cached_grads)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)
