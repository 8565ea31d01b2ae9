"""Run sentence-transformers' own tests of their cached losses with their classes and with ours.

Every test of this folder runs twice: ``[theirs]`` as their file is written, and ``[ours]`` with their class
names bound to ours in the test's module (``CachedMultipleNegativesRankingLoss = CachedMNRLoss``,
``CachedMultipleNegativesSymmetricRankingLoss = CachedCLIPLoss``, ``CachedGISTEmbedLoss = CachedGISTLoss``,
``CachedSpladeLoss = CachedSparseLoss``,
``CachedMultiVectorMultipleNegativesRankingLoss = CachedMultiVectorLoss``, ``DistillKLDivLoss =
CachedDistillKLDivLoss``, ``MultiVectorDistillKLDivLoss = CachedMultiVectorDistillKLDivLoss``,
``MultiVectorMarginMSELoss = CachedMultiVectorMarginMSELoss``; where a test reaches their class
through a package (``mve_losses.CachedMultiVector...``), the package's name is bound to a stand-in holding ours
under their names and theirs for every other name), no argument mapping. The drop-in promise is that no test
passing ``[theirs]`` fails ``[ours]``; the tests that cannot hold for ours are skipped there, each with its
reason (:data:`NOT_OURS`). Their multi-vector tests use stub models (no fixture). Their tests of their private
mini-batch slicing of multimodal inputs run with our engine's slicing bound to its name (:data:`HELPERS`).

Their fixtures load Hub models; these stand-ins are tiny random models built offline (tests run without a
network), with a vocabulary holding every word of their tests' texts so that none becomes ``[UNK]``:
``stsb_bert_tiny_model`` (a 2-layer BERT, hidden 128 as theirs: their Matryoshka tests truncate to 128, 64 and
32), ``splade_bert_tiny_model`` and ``inference_free_splade_bert_tiny_model`` (a SPLADE BERT, and the same
behind a Router with a ``SparseStaticEmbedding`` query route), ``static_embedding`` (over the tiny tokenizer),
and ``SentenceTransformer("distilbert/distilbert-base-uncased")`` inside ``test_cmnrl.py`` (the tiny BERT).
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer, SparseEncoder

from st_cached_losses import (
    CachedCLIPLoss,
    CachedDistillKLDivLoss,
    CachedGISTLoss,
    CachedMNRLoss,
    CachedMultiVectorDistillKLDivLoss,
    CachedMultiVectorLoss,
    CachedMultiVectorMarginMSELoss,
    CachedSparseLoss,
)
from st_cached_losses.engine.features import batch_size_of, slice_features
from tests.support.st_version import ST_6_3, ST_VERSION
from tests.support.tiny_model import WORDS, make_tiny_model, make_tiny_splade

#: their class names -> ours
OURS: dict[str, type] = {
    "CachedMultipleNegativesRankingLoss": CachedMNRLoss,
    "CachedMultipleNegativesSymmetricRankingLoss": CachedCLIPLoss,
    "CachedGISTEmbedLoss": CachedGISTLoss,
    "CachedSpladeLoss": CachedSparseLoss,
    "CachedMultiVectorMultipleNegativesRankingLoss": CachedMultiVectorLoss,
    "DistillKLDivLoss": CachedDistillKLDivLoss,
    "MultiVectorDistillKLDivLoss": CachedMultiVectorDistillKLDivLoss,
    "MultiVectorMarginMSELoss": CachedMultiVectorMarginMSELoss,
}

_SPIES_ON_EMBED_MINIBATCH = (
    "it spies on embed_minibatch, a method of their GradCache engine (CachedLossMixin) that ours does not have "
    "(our engine is loss.cache); the replay of dropout masks is held for ours by tests/losses/test_losses.py's "
    "dropout canaries and tests/losses/test_st_parity.py"
)
_THEIR_INTERNALS_GIST = (
    "it builds the loss with CachedGISTEmbedLoss.__new__ and sets their private attributes by hand "
    "(cross_entropy_loss, an nn.CosineSimilarity module), then monkeypatches all_gather_with_grad / get_rank of "
    "their module to fake rank 1 of 2: it tests their calculate_loss internals; ours is compared with their "
    "gathered loss across real gloo process groups (tests/losses/test_gist.py::"
    "test_two_processes_equal_their_gathered_loss)"
)
#: test id pattern (a regular expression over the node id) -> why it cannot run with ours; every other test of
#: these files passes with ours wherever it passes with theirs
NOT_OURS: dict[str, str] = {
    r"test_gradcache\.py::test_gradcache_replays_dropout_in_the_backward_pass": _SPIES_ON_EMBED_MINIBATCH,
    r"test_gradcache\.py::test_gradcache_token_budget_replays_dropout": _SPIES_ON_EMBED_MINIBATCH,
    r"test_gradcache\.py::test_gradcache_replays_through_prompt_exclusion": _SPIES_ON_EMBED_MINIBATCH,
    r"test_cached_gist_embed\.py::test_cached_gist_replays_dropout_in_the_backward_pass": _SPIES_ON_EMBED_MINIBATCH,
    r"test_cached_splade\.py::test_cached_splade_replays_dropout_in_the_backward_pass": _SPIES_ON_EMBED_MINIBATCH,
    r"test_gradcache\.py::test_gradcache_under_autocast": (
        "its premise asserts that their cached loss returns a bfloat16 loss under autocast; ours returns float32, "
        "as the non-cached MultipleNegativesRankingLoss does there (cross-entropy runs in float32 under autocast; "
        "our log-sum-exp is float32 by design)"
    ),
    r"test_gradcache\.py::test_gradcache_backward_releases_the_hook_state": (
        "it asserts that their backward hook still holds the step's features after backward (until the loss "
        "tensor is dropped); ours releases them in backward already, earlier than theirs"
    ),
    r"test_cmnrl\.py::test_cmnrl_hyperparameters_stay_assignable": (
        "it reads loss.loss, their private inner MultipleNegativesRankingLoss; the same assignments are held for "
        "ours by tests/losses/test_st_parity.py::test_hyperparameters_stay_assignable"
    ),
    r"test_gradcache\.py::test_adaptive_layer_warns_for_gradient_cached_losses": (
        "it matches the warning's text against their class name ('AdaptiveLayerLoss is not compatible with "
        "CachedMultipleNegatives...'); their AdaptiveLayerLoss does warn for ours, naming it: 'AdaptiveLayerLoss "
        "is not compatible with CachedMNRLoss.'"
    ),
    r"test_cached_gist_embed\.py::test_gather_rank1": _THEIR_INTERNALS_GIST,
    r"test_cached_gist_embed\.py::test_positive_mask_protects_ce_target_column": _THEIR_INTERNALS_GIST,
    r"test_cached_gist_embed\.py::test_relative_margin_negative": _THEIR_INTERNALS_GIST,
    r"test_multi_vector_misc\.py::test_cached_mnr_stamped_task_reaches_backward_hook": (
        "it counts the model's calls (2 per column per phase, 12); ours keeps the last mini-batch's graph "
        "(reuse_last_graph=True, the default) and so makes 11, all with the stamped task; with "
        "reuse_last_graph=False ours makes their 12, held by tests/losses/test_cached_multi_vector.py::"
        "test_token_gradients_with_ragged_mini_batch_widths"
    ),
    r"test_multi_vector_misc\.py::test_mnr_loss_does_not_scale_with_world_size\[ours-cached_mnrl\]": (
        "it monkeypatches all_gather_padded, a private global of their cached loss's module, to fake a 2-rank "
        "gather; ours is tested across real gloo process groups (tests/losses/test_cached_multi_vector.py::"
        "test_processes_equal_single_process_global_batch)"
    ),
    r"test_cmnrl\.py::test_cmnrl_gather_across_devices_offset": (
        "it monkeypatches all_gather_with_grad / get_rank, private globals of their loss's module, to fake rank 1 "
        "of 2; ours is tested across real gloo process groups (tests/losses/test_distributed.py)"
    ),
}
#: tests that fail with theirs as well, for no reason of ours: not run (our suite stays green)
NOT_EITHER: dict[str, str] = {
    r"test_cmnrl\.py::TestCreateMinibatchMixedModality::test_minibatch_(text_only_samples|grid_rows_coincides)": (
        "it tests their private _create_minibatch on mixed-modality features; the file (their commit cad21198) is "
        "newer than the installed sentence-transformers 6.2.0, whose helper fails it with theirs too (KeyError: "
        "'pixel_values' / 'image_grid_thw'); ours (bound as HELPERS says) fails it the same way: a mini-batch of "
        "text-only rows gets no pixel_values / image_grid_thw at all (as the processor makes a text-only batch), "
        "not empty ones; it uses no loss class"
    ),
}


_DEFAULT_NAME_62 = (
    "it asserts sentence-transformers 6.2's config name of the default similarity_fct ({name!r}); from 6.3 the "
    "default is the model's own similarity (model.similarity / similarity_pairwise), written None (their "
    "loss and ours, as the installed release writes it: losses/similarity.py's MODEL_SCORE_DEFAULT); the "
    "default's config and scores with 6.3 are held by tests/losses/test_st63_parity.py"
)
#: tests that hold sentence-transformers 6.2's semantics only: with 6.3 installed they are not run (with theirs
#: nor ours), each with its reason; with 6.2 they run as every other test
ST_62_ONLY: dict[str, str] = {
    r"test_multi_vector_misc\.py::test_similarity_fct_config_includes_hyperparameters": _DEFAULT_NAME_62.format(
        name="colbert_scores"
    ),
    r"test_multi_vector_misc\.py::test_margin_mse_accepts_xtr_pairwise_metric": _DEFAULT_NAME_62.format(
        name="colbert_scores_pairwise"
    ),
    r"test_multi_vector_misc\.py::test_distill_kl_div_separate_temperatures": _DEFAULT_NAME_62.format(
        name="colbert_kd_scores"
    ),
}


def _slice_rows(features: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
    """Our engine's mini-batch slicing (``engine.features.slice_features``) as their ``_create_minibatch``: rows
    ``begin:end``, left padding kept (as theirs)."""
    return slice_features(features, torch.arange(begin, end), batch_size_of(features), trim_leading=False)


#: test id pattern -> their private helpers' names -> ours, bound with ``[ours]`` too: their tests of the
#: GradCache base's mini-batch slicing of multimodal inputs call their helper, not a loss
HELPERS: dict[str, dict[str, Any]] = {
    r"test_cmnrl\.py::TestCreateMinibatchMixedModality::": {
        "_create_minibatch": _slice_rows,
        "_get_batch_size": batch_size_of,
    },
}
#: set to run the tests of NOT_OURS with ours too (to see that they still fail, and why)
RUN_ALL = os.environ.get("ST_UPSTREAM_RUN_ALL") == "1"

_TEXTS = """aaa bbb ccc ddd eee aas bbs ccs dds ees xxx yyy zzz kkk fff adsa czx dsada b fas xcz c asdas
anchor a b c d e f g h positive negative with quite few more words in it and final sentence short also has longer
surface form p another text q r s canary query document here"""
VOCAB = [*dict.fromkeys([*_TEXTS.split(), *WORDS])]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for pattern, reason in ST_62_ONLY.items():
            if ST_6_3 and re.search(pattern, item.nodeid):
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"6.2 only, sentence-transformers {ST_VERSION} installed: {reason}"
                    )
                )
        for pattern, reason in NOT_EITHER.items():
            if not RUN_ALL and re.search(pattern, item.nodeid):
                item.add_marker(pytest.mark.skip(reason=f"fails with theirs too: {reason}"))
        callspec = getattr(item, "callspec", None)
        if RUN_ALL or callspec is None or callspec.params.get("implementation") != "ours":
            continue
        for pattern, reason in NOT_OURS.items():
            if re.search(pattern, item.nodeid):
                item.add_marker(pytest.mark.skip(reason=f"not for ours: {reason}"))


@pytest.fixture(autouse=True, params=["theirs", "ours"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"theirs"``: the test as written; ``"ours"``: their class names bound to ours in the test's module."""
    if request.param == "ours":
        for name, cls in OURS.items():
            if name in vars(request.module):
                monkeypatch.setattr(request.module, name, cls)
        for pattern, helpers in HELPERS.items():
            if re.search(pattern, request.node.nodeid):
                for name, helper in helpers.items():
                    monkeypatch.setattr(request.module, name, helper)
        for alias, value in list(vars(request.module).items()):
            if isinstance(value, types.ModuleType) and _reexports_theirs(value):
                monkeypatch.setattr(request.module, alias, _with_ours(value))
    return str(request.param)


@pytest.fixture(autouse=True)
def _stub_models_score_as_models(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """With sentence-transformers 6.3 installed, their 6.2 file's stub models (``nn.Module`` classes of the
    test's module that return the features' token embeddings) get what 6.3's multi-vector losses read from a
    model where ``similarity_fct`` is None: ``similarity`` / ``similarity_pairwise`` (MaxSim, as a
    ``MultiVectorEncoder``'s default ``similarity_fn_name="maxsim"``) and that name. 6.2's losses scored with
    MaxSim (``colbert_scores``) without asking the model, so the stubs had none, and 6.3's losses fail on them
    with an AttributeError (with theirs as with ours where a test uses their non-cached loss): the same scores
    as 6.2's default, so every test of the file holds with 6.3 as written."""
    if not ST_6_3:
        return
    for value in list(vars(request.module).values()):
        if (
            isinstance(value, type)
            and issubclass(value, torch.nn.Module)
            and value.__module__ == request.module.__name__
            and not hasattr(value, "similarity")
        ):
            monkeypatch.setattr(value, "similarity_fn_name", "maxsim", raising=False)
            monkeypatch.setattr(value, "similarity", _stub_maxsim, raising=False)
            monkeypatch.setattr(value, "similarity_pairwise", _stub_maxsim_pairwise, raising=False)


def _stub_maxsim(self: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A ``MultiVectorEncoder``'s ``similarity`` with its default ``similarity_fn_name="maxsim"``."""
    from sentence_transformers.util.similarity import maxsim

    return maxsim(a, b, **kwargs)


def _stub_maxsim_pairwise(
    self: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """A ``MultiVectorEncoder``'s ``similarity_pairwise`` with its default ``similarity_fn_name="maxsim"``."""
    from sentence_transformers.util.similarity import maxsim_pairwise

    return maxsim_pairwise(a, b, **kwargs)


def _reexports_theirs(module: types.ModuleType) -> bool:
    """Whether ``module`` re-exports one of their cached losses (a package such as ``losses``), not the module
    defining it (which their tests import to monkeypatch its globals: left as it is)."""
    return any(
        getattr(vars(module).get(name), "__module__", module.__name__) != module.__name__ for name in OURS
    )


def _with_ours(module: types.ModuleType) -> types.ModuleType:
    """A stand-in for their module ``module``: ours under their class names, theirs for every other name."""
    bound = types.ModuleType(module.__name__)
    bound.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    bound.__dict__.update({name: cls for name, cls in OURS.items() if name in vars(module)})
    return bound


@pytest.fixture(scope="session")
def _models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("st_upstream")
    bert = make_tiny_model(root / "bert", hidden=128, words=VOCAB, dropout=0.1)
    splade = make_tiny_splade(root / "splade", words=VOCAB, dropout=0.1, bias=-0.05)
    return {"bert": bert, "splade": splade}


@pytest.fixture()
def stsb_bert_tiny_model(_models: dict[str, Any]) -> SentenceTransformer:
    """Stands in for their Hub fixture of the same name (a fresh copy per test, as theirs)."""
    return deepcopy(_models["bert"])


@pytest.fixture(autouse=True)
def _distilbert_offline(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _models: dict[str, Any]
) -> None:
    """``SentenceTransformer("distilbert/distilbert-base-uncased")`` in their module: the tiny BERT instead."""
    their = vars(request.module).get("SentenceTransformer")
    if their is not SentenceTransformer:
        return

    def load(name_or_path: Any = None, *args: Any, **kwargs: Any) -> SentenceTransformer:
        if name_or_path == "distilbert/distilbert-base-uncased":
            return deepcopy(_models["bert"])
        return SentenceTransformer(name_or_path, *args, **kwargs)

    monkeypatch.setattr(request.module, "SentenceTransformer", load)


@pytest.fixture()
def splade_bert_tiny_model(_models: dict[str, Any]) -> SparseEncoder:
    return deepcopy(_models["splade"])


@pytest.fixture()
def inference_free_splade_bert_tiny_model(_models: dict[str, Any]) -> SparseEncoder:
    """A SPLADE document route and a trainable ``SparseStaticEmbedding`` query route behind a Router, as their
    inference-free Hub model."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

    documents = deepcopy(_models["splade"])
    transformer, pooling = documents[0], documents[1]
    query = SparseStaticEmbedding(tokenizer=transformer.tokenizer, frozen=False)
    router = Router.for_query_document(query_modules=[query], document_modules=[transformer, pooling])
    return SparseEncoder(modules=[router], device="cpu")


@pytest.fixture()
def static_embedding(_models: dict[str, Any]) -> Any:
    """A ``StaticEmbedding`` over the tiny tokenizer (theirs: bert-base-uncased's, from the Hub)."""
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    tokenizer = _models["bert"][0].tokenizer.backend_tokenizer
    weights = np.random.default_rng(0).random((tokenizer.get_vocab_size(), 64)).astype(np.float32)
    return StaticEmbedding(tokenizer, embedding_weights=weights)


@pytest.fixture(autouse=True)
def clear_warning_once_cache() -> Iterator[None]:
    """As their conftest: transformers' ``warning_once`` cache cleared for every test."""
    import logging

    cache_clear = getattr(getattr(logging.Logger, "warning_once", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    yield
