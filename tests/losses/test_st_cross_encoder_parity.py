"""Drop-in parity with sentence-transformers 6.2's cross-encoder ``CachedMultipleNegativesRankingLoss``: its own
tests (``tests/cross_encoder/losses/test_cached_multiple_negatives_ranking.py`` of its repository at
cad2119, Apache-2.0, Copyright the sentence-transformers authors) with its class name bound straight to ours,
``CachedMultipleNegativesRankingLoss = CachedCrossEncoderLoss``, no argument mapping. Their bodies are unchanged;
the Hub model their fixture loads (``reranker_bert_tiny_model_v54``) is replaced by a tiny random BERT reranker
built offline with a vocabulary holding the tests' words, and their helper ``disable_dropout``
(``tests/sentence_transformer/losses/utils.py``, same licence) is copied in.

Left out, and why (both spy on ``loss_fn.predict_minibatch``, their loss's own per-mini-batch forward, which
ours does not have: our forwards and replays are the engine's):

* ``test_cached_ce_mnrl_replays_dropout_on_cuda`` (also CUDA only);
* ``test_cached_ce_mnrl_prompt_reaches_the_backward_pass``.

Both are kept in spirit at the end of this file, spying on the engine's forward instead
(:func:`test_replays_the_first_pass_logits_with_dropout`, :func:`test_prompt_reaches_the_replay`).
"""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.base.model import BaseModel
from sentence_transformers.cross_encoder import CrossEncoder
from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss
from sentence_transformers.util import batch_to_device

from st_cached_losses import CachedCrossEncoderLoss
from tests.support.tiny_model import WORDS, make_tiny_cross_encoder

# their class name, bound straight to ours
CachedMultipleNegativesRankingLoss = CachedCrossEncoderLoss

#: every word of the tests below, so that no text is all [UNK]
_TEST_WORDS = [
    "query",
    "answer",
    "wrong",
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "canary",
    "another",
    "rerank",
    "this",
    "passage",
    ":",
    "w0",
    "w1",
    "w2",
]


@pytest.fixture(scope="module")
def _reranker_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("st_cross_encoder") / "reranker"
    # dropout on, as a real reranker: the tests disable it where they compare
    make_tiny_cross_encoder(path, dropout=0.1, words=[*_TEST_WORDS, *WORDS])
    return str(path)


@pytest.fixture
def reranker_bert_tiny_model_v54(_reranker_dir) -> CrossEncoder:
    return CrossEncoder(_reranker_dir, device="cpu")


def disable_dropout(model: BaseModel, canary_inputs: list | None = None) -> None:
    """sentence-transformers' ``tests/sentence_transformer/losses/utils.py::disable_dropout``, as there."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute in ("dropout_prob", "attention_dropout", "attention_probs_dropout_prob"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
    was_training = model.training
    model.train()
    features = batch_to_device(
        model.preprocess(canary_inputs or ["a canary sentence", "another canary sentence"]), model.device
    )
    with torch.no_grad():
        outputs = model(features)
        key = "sentence_embedding" if "sentence_embedding" in outputs else "scores"
        first, second = outputs[key], model(features)[key]
    model.train(was_training)
    assert torch.equal(first, second), (
        "dropout is still active in training mode; disable_dropout needs updating"
    )


QUERIES = ["query a", "query b", "query c", "query d", "query e", "query f"]
ANSWERS = ["answer a", "answer b", "answer c", "answer d", "answer e", "answer f"]


def _gradients(model: CrossEncoder) -> dict[str, torch.Tensor]:
    return {
        name: param.grad.clone() for name, param in model.model.named_parameters() if param.grad is not None
    }


def _loss_and_grads(model: CrossEncoder, loss_fn: torch.nn.Module, seed: int = 12) -> tuple[float, dict]:
    # The in-batch negatives are sampled randomly inside forward, so seed for comparability.
    model.model.zero_grad()
    torch.manual_seed(seed)
    loss = loss_fn([QUERIES, ANSWERS], None)
    loss.backward()
    return loss.item(), _gradients(model)


def _disable_dropout(model: CrossEncoder) -> None:
    disable_dropout(
        model, canary_inputs=[["a canary query", "a canary answer"], ["another query", "another answer"]]
    )


@pytest.mark.parametrize("mini_batch_size", [2, 5, 64])
def test_cached_ce_mnrl_matches_mnrl(
    reranker_bert_tiny_model_v54: CrossEncoder, mini_batch_size: int
) -> None:
    """``mini_batch_size`` only bounds memory: the cached loss must reproduce MultipleNegativesRankingLoss's
    loss and gradient, whether or not it divides the pair count."""
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.train()

    cached_loss, cached_grads = _loss_and_grads(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    )
    plain_loss, plain_grads = _loss_and_grads(model, MultipleNegativesRankingLoss(model))

    assert cached_grads, "no parameter received a gradient"
    assert sum(grad.abs().sum() for grad in cached_grads.values()) > 0
    assert cached_loss == pytest.approx(plain_loss, rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_cached_ce_mnrl_two_forwards_before_one_backward(reranker_bert_tiny_model_v54: CrossEncoder) -> None:
    """Each forward pass must hand its own cached gradients to its own backward hook. The cache used to
    live on the loss module, where a second forward pass overwrote it."""
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.train()

    def losses(loss_fn_first: torch.nn.Module, loss_fn_second: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.model.zero_grad()
        torch.manual_seed(12)
        first = loss_fn_first([QUERIES[:3], ANSWERS[:3]], None)
        torch.manual_seed(34)
        second = loss_fn_second([QUERIES[3:], ANSWERS[3:]], None)
        (first + second).backward()
        return _gradients(model)

    shared = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    shared_grads = losses(shared, shared)
    reference_grads = losses(
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
    )

    assert shared_grads and sum(grad.abs().sum() for grad in shared_grads.values()) > 0
    for name, grad in shared_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("grad_accum_steps", [2, 4])
def test_cached_ce_mnrl_scales_with_the_outer_backward(
    reranker_bert_tiny_model_v54: CrossEncoder, grad_accum_steps: int
) -> None:
    """Scaling the returned loss (gradient accumulation, fp16 loss scaling) must scale the whole gradient."""
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.train()

    def grads(scale: float) -> dict[str, torch.Tensor]:
        model.model.zero_grad()
        torch.manual_seed(12)
        (
            CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)([QUERIES, ANSWERS], None) * scale
        ).backward()
        return _gradients(model)

    unscaled = grads(1.0)
    scaled = grads(1 / grad_accum_steps)

    assert unscaled and sum(grad.abs().sum() for grad in unscaled.values()) > 0
    for name, grad in scaled.items():
        torch.testing.assert_close(grad, unscaled[name] / grad_accum_steps, rtol=1e-4, atol=1e-6, msg=name)


def test_cached_ce_mnrl_under_no_grad(reranker_bert_tiny_model_v54: CrossEncoder) -> None:
    """The loss must be computable under ``torch.no_grad``, as the trainer does for the eval loss."""
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.eval()

    with torch.no_grad():
        torch.manual_seed(12)
        cached = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)([QUERIES, ANSWERS], None)
        torch.manual_seed(12)
        plain = MultipleNegativesRankingLoss(model)([QUERIES, ANSWERS], None)

    assert cached.item() == pytest.approx(plain.item(), rel=1e-4, abs=1e-5)


NEGATIVES = ["wrong a", "wrong b", "wrong c", "wrong d", "wrong e", "wrong f"]


@pytest.mark.parametrize("mini_batch_size", [2, 5])
def test_cached_ce_mnrl_with_hard_negatives(
    reranker_bert_tiny_model_v54: CrossEncoder, mini_batch_size: int
) -> None:
    """Explicit hard negatives (a third input column) triple the pair count. The cached loss must still
    reproduce the non-cached loss and gradient."""
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.train()

    def loss_and_grads(loss_fn: torch.nn.Module) -> tuple[float, dict]:
        model.model.zero_grad()
        torch.manual_seed(12)
        loss = loss_fn([QUERIES, ANSWERS, NEGATIVES], None)
        loss.backward()
        return loss.item(), _gradients(model)

    cached_loss, cached_grads = loss_and_grads(
        CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    )
    plain_loss, plain_grads = loss_and_grads(MultipleNegativesRankingLoss(model))

    assert cached_grads and sum(grad.abs().sum() for grad in cached_grads.values()) > 0
    assert cached_loss == pytest.approx(plain_loss, rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------------------
# The two left-out tests, kept in spirit: the engine's forwards stand in for their predict_minibatch.


def _spy_on_forwards(loss_fn: CachedCrossEncoderLoss, sink: list[list[torch.Tensor]]) -> None:
    encode = loss_fn.cache.encode

    def spy(model, features):
        out = encode(model, features)
        sink[0].append(out.detach().clone())
        return out

    object.__setattr__(loss_fn.cache, "encode", spy)  # a spy under the frozen engine's configuration


def test_replays_the_first_pass_logits_with_dropout(reranker_bert_tiny_model_v54: CrossEncoder) -> None:
    """Every replayed mini-batch re-predicts exactly its first-pass logits, dropout on (the last
    mini-batch keeps its first-pass graph and is not replayed)."""
    model = reranker_bert_tiny_model_v54
    model.model.train()
    assert any(m.p > 0 for m in model.model.modules() if isinstance(m, torch.nn.Dropout))
    loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    forward_logits: list[torch.Tensor] = []
    backward_logits: list[torch.Tensor] = []
    sink = [forward_logits]
    _spy_on_forwards(loss_fn, sink)
    loss = loss_fn([QUERIES, ANSWERS], None)
    sink[0] = backward_logits
    loss.backward()
    assert len(backward_logits) == len(forward_logits) - 1 > 0
    for index, (forward, backward) in enumerate(zip(forward_logits, backward_logits)):
        assert torch.equal(forward, backward), f"mini-batch {index} was re-predicted with different dropout"


def test_prompt_reaches_the_replay(reranker_bert_tiny_model_v54: CrossEncoder) -> None:
    model = reranker_bert_tiny_model_v54
    _disable_dropout(model)
    model.model.train()
    loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    forward_logits: list[torch.Tensor] = []
    backward_logits: list[torch.Tensor] = []
    sink = [forward_logits]
    _spy_on_forwards(loss_fn, sink)
    torch.manual_seed(12)
    loss = loss_fn([QUERIES, ANSWERS], None, prompt="Rerank this passage: ")
    sink[0] = backward_logits
    loss.backward()
    assert len(backward_logits) == len(forward_logits) - 1 > 0
    for index, (forward, backward) in enumerate(zip(forward_logits, backward_logits)):
        assert torch.equal(forward, backward), f"mini-batch {index} was re-predicted with different inputs"
    torch.manual_seed(12)
    plain = MultipleNegativesRankingLoss(model)([QUERIES, ANSWERS], None, prompt="Rerank this passage: ")
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
