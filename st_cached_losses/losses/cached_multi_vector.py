from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.functional.multi_vector import XTR, MaxSim
from st_cached_losses.functional.parallel import pad_to_common_tokens
from st_cached_losses.functional.terms import mnrl_terms
from st_cached_losses.losses._base import CachedInfoNCEBase, LossStageOptions, LossTerms, StepData
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.settings import ONE_DIRECTION, Setting

__all__ = ["CachedMultiVectorLoss", "resolve_token_similarity"]


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """A scoring function as sentence-transformers' configs write it (``similarity_fct_name``):
    ``"xtr_scores"`` -> ``("xtr_scores", {})``, ``"XTRScores(top_k=5, chunk_elements=None)"`` ->
    ``("XTRScores", {"top_k": 5, "chunk_elements": None})``; None for anything else (positional arguments,
    values that are not literals). Parsed, never evaluated."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Name):
        return node.id, {}
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    keywords: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **mapping
            return None
        try:
            keywords[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    return node.func.id, keywords


def scoring_from_config(text: str) -> Callable[..., Tensor]:
    """A scoring function from its config string (``similarity_fct_name``'s form): ``colbert_scores``,
    ``mean_colbert_scores`` or ``xtr_scores`` with keyword arguments (a ``functools.partial``), or
    ``XTRScores(...)``; anything else raises."""
    from sentence_transformers.multi_vector_encoder import scoring

    call = parse_call(text)
    functions = {
        name: getattr(scoring, name)
        for name in ("colbert_scores", "mean_colbert_scores", "xtr_scores", "XTRScores")
    }
    if call is None or call[0] not in functions:
        raise ValueError(
            f"similarity_fct={text!r} is not a multi-vector score: use 'maxsim', 'meanmaxsim' or 'xtr', or a "
            "config's 'colbert_scores', 'mean_colbert_scores(length_normalize=...)', 'xtr_scores(top_k=...)' or "
            "'XTRScores(top_k=...)'."
        )
    name, keywords = call
    try:
        if name == "XTRScores":
            return functions[name](**keywords)
        # a partial with an unknown keyword is refused below, by the callables' rule
        return functools.partial(functions[name], **keywords)
    except TypeError as err:
        raise ValueError(f"similarity_fct={text!r}: {err}.") from None


def scoring_config_name(fn: Any) -> str:
    """The config's name of a scoring function: sentence-transformers' for theirs; for the core's own
    [`MaxSim`][st_cached_losses.functional.multi_vector.MaxSim] / [`XTR`][st_cached_losses.functional.multi_vector.XTR], the name of their function it equals, so that the config rebuilds it and
    reads as theirs."""
    from sentence_transformers.util import similarity_fct_name

    if isinstance(fn, str):
        return fn
    if isinstance(fn, MaxSim):
        return "mean_colbert_scores" if fn.length_normalize else "colbert_scores"
    if isinstance(fn, XTR):
        return f"xtr_scores(top_k={fn.top_k!r})"
    return similarity_fct_name(fn)


def resolve_token_similarity(similarity_fct: Callable[..., Tensor] | str | None) -> MaxSim | XTR:
    """sentence-transformers' multi-vector scoring functions as the core's tile score: ``None`` /
    ``colbert_scores`` / ``"maxsim"`` -> MaxSim, ``mean_colbert_scores`` / ``"meanmaxsim"`` -> MeanMaxSim
    (a ``functools.partial`` of either may bind ``length_normalize`` and ``chunk_elements``, the latter a
    memory knob the tiles make moot), ``xtr_scores`` / ``XTRScores(top_k)`` / ``"xtr"`` -> XTR (a partial of
    ``xtr_scores`` may bind ``top_k`` and ``chunk_elements``; ``top_k`` 256 by default, as theirs), or a
    [`MaxSim`][st_cached_losses.functional.multi_vector.MaxSim] / ``XTR``. ``XTRKDScores`` is refused: it
    scores each query's own documents only (a distillation score), not the in-batch ranking."""
    if similarity_fct is None:
        return MaxSim()
    if isinstance(similarity_fct, (MaxSim, XTR)):
        return similarity_fct
    if isinstance(similarity_fct, str):
        names = {"maxsim": False, "colbert_scores": False, "meanmaxsim": True, "mean_colbert_scores": True}
        if similarity_fct.lower() in names:
            return MaxSim(names[similarity_fct.lower()])
        if similarity_fct.lower() in ("xtr", "xtr_scores"):
            return XTR()
        # as a config writes it (get_config_dict, theirs and ours): "xtr_scores(top_k=5)", "XTRScores(...)"
        similarity_fct = scoring_from_config(similarity_fct)
    from sentence_transformers.multi_vector_encoder import scoring

    fn: Any = similarity_fct
    keywords: dict[str, Any] = {}
    if isinstance(fn, functools.partial) and not fn.args:
        fn, keywords = fn.func, dict(fn.keywords)
    if isinstance(fn, scoring.XTRKDScores) or fn is scoring.xtr_kd_scores:
        raise ValueError(
            "XTRKDScores / xtr_kd_scores score each query against its own documents only (for distillation); "
            "the in-batch ranking loss takes xtr_scores or XTRScores."
        )
    if isinstance(fn, scoring.XTRScores) and not keywords:
        return XTR(fn.top_k)
    if fn is scoring.xtr_scores and not set(keywords) - {"top_k", "chunk_elements"}:
        return XTR(keywords.get("top_k", 256))
    defaults = {scoring.colbert_scores: False, scoring.mean_colbert_scores: True}
    if fn not in defaults or set(keywords) - {"length_normalize", "chunk_elements"}:
        raise ValueError(
            f"similarity_fct={similarity_fct!r} is not supported: CachedMultiVectorLoss scores tile by tile, "
            "so it takes sentence_transformers.multi_vector_encoder.scoring.colbert_scores (MaxSim, the default), "
            "mean_colbert_scores (MeanMaxSim) or xtr_scores / XTRScores (XTR), optionally as a functools.partial "
            "binding length_normalize / chunk_elements (top_k / chunk_elements for xtr_scores), or "
            "st_cached_losses.functional.multi_vector.MaxSim / XTR."
        )
    return MaxSim(bool(keywords.get("length_normalize", defaults[fn])))


class CachedMultiVectorLoss(CachedInfoNCEBase):
    _citations = (GRADCACHE_CITATION, MNRL_CITATION)
    equivalent_st_loss = "CachedMultiVectorMultipleNegativesRankingLoss"
    caches_tokens = True  # the engine caches packed token embeddings and masks
    #: the model kind it trains (another is refused at construction)
    model_kind = "MultiVectorEncoder"

    def __init__(
        self,
        model: nn.Module,
        *,
        scale: float = 1.0,
        similarity_fct: Callable[..., Tensor] | str | None = None,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        score_mini_batch_size: int | None = None,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        Late-interaction (ColBERT MaxSim) in-batch negatives ranking loss with GradCache, for a
        ``MultiVectorEncoder``: the gradients of a batch of thousands with the memory of one encoder
        mini-batch and one scoring tile, exactly.

        Each query is scored against its positive document, every hard negative and every other row's
        documents by MaxSim (the sum over the query's tokens of the best document-token similarity), and the
        loss is the cross-entropy of picking the positive, as sentence-transformers'
        ``MultiVectorMultipleNegativesRankingLoss``. The batch is embedded mini-batch by mini-batch without a
        graph (token embeddings and scoring masks cached, each mini-batch trimmed to its longest row); the
        loss and its gradient wrt every token embedding are computed by the package's one InfoNCE core, tile
        by tile over (query rows x document rows): the largest intermediate is one tile's
        ``(rows, documents, q_tokens, d_tokens)`` similarities, sized from ``memory_budget``, never the
        ``(Q, Q*N, q_tokens, d_tokens)`` tensor of sentence-transformers' cached loss. The encoder is then
        replayed with the cached gradients.

        The constructor takes sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``
        arguments (keyword-only, as theirs), then our extras. Every argument is a property, read and
        assigned between steps.

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan, keyword-only
        ([`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]); none changes the result. Here
        the loss stage's tiles are score tiles (token similarities included), and across processes
        ``path="tiled"`` is the ring exchange (each process holds its own rows and one visiting block, never
        every process's documents), the others gather.

        Args:
            model: the ``MultiVectorEncoder`` to train (column 0 embedded as ``task="query"``, the others as
                ``"document"``, unless the collator set a column's task).
            scale: multiplies the scores (``1 / temperature``); 1.0 as sentence-transformers (MaxSim is a sum
                over query tokens); with MeanMaxSim about the average query length.
            similarity_fct: ``None`` / ``colbert_scores`` (MaxSim), ``mean_colbert_scores`` (MeanMaxSim) or
                ``xtr_scores`` / ``XTRScores(top_k)`` (XTR), from
                ``sentence_transformers.multi_vector_encoder.scoring``; or ``"maxsim"`` / ``"meanmaxsim"`` /
                ``"xtr"``. XTR's top-k runs over every in-batch document token (every process's with
                ``gather_across_devices``, as theirs): a first streaming pass over the same tiles keeps each
                query token's running top-``k`` tokens, then the scoring pass scores tile by tile with them.
                Exactly ``top_k`` tokens per query token, as ``torch.topk``; among tokens tied at the
                ``top_k``-th similarity (a document repeated in the batch), those first in
                sentence-transformers' flat ``documents x tokens`` order. (``torch.topk`` on the CPU picks
                tied elements in an order of its selection algorithm, not of their index: with a hard
                negative shared by every row, it agreed with this rule in only 5 of 49 (batch, top_k) cases
                with a tie, and there the loss and gradients differ from theirs, by up to 0.8% in the loss in
                an audit. Without exact ties the retrieval is theirs.)
            mini_batch_size: rows per encoder forward; sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead of
                ``mini_batch_size``, as sentence-transformers; a query's ColBERT expansion positions count
                as real tokens (the encoder runs over them and the loss scores them).
            score_mini_batch_size: kept for sentence-transformers' signature and config (default:
                ``mini_batch_size``); the scoring tiles are sized from ``memory_budget`` (or ``tile_size``)
                instead, and never change the result.
            gather_across_devices: score each process's queries against every process's documents,
                gathered, or by ring exchange with ``path="tiled"``. Token rows are padded to the widest of
                every process first (processes may hold different numbers of rows and tokens); XTR's top-k
                runs over every process's document tokens either way (under the ring, by a first pass of
                the document blocks around it).
            show_progress_bar: tqdm bars over the mini-batches of both passes.

        References:
            - Khattab and Zaharia, ColBERT: Efficient and Effective Passage Search via Contextualized Late
              Interaction over BERT, 2020: https://huggingface.co/papers/2004.12832
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (query, positive) pairs or (query, positive, negative_1, ..., negative_n) tuples.
            2. A ``MultiVectorEncoder`` (outputs ``token_embeddings`` and a scoring ``attention_mask``).

        Inputs:
            | Texts | Labels |
            |---|---|
            | (query, positive) pairs | none |
            | (query, positive, negative_1, ..., negative_n) | none |

        Relations:
            - Same loss and gradients as ``MultiVectorMultipleNegativesRankingLoss`` and
              ``CachedMultiVectorMultipleNegativesRankingLoss`` (sentence-transformers) with MaxSim,
              MeanMaxSim or XTR scoring.

        Example:
            ```python
            from sentence_transformers import MultiVectorEncoder, MultiVectorEncoderTrainer
            from st_cached_losses import CachedMultiVectorLoss

            model = MultiVectorEncoder("answerdotai/ModernBERT-base")
            loss = CachedMultiVectorLoss(model, mini_batch_size=8)
            trainer = MultiVectorEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        super().__init__(
            model,
            scale=scale,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.gather_across_devices = gather_across_devices
        self.similarity_fct = similarity_fct
        self.score_mini_batch_size = score_mini_batch_size

    def _resolve_similarity(self, old: object, new: Callable[..., Tensor] | str | None) -> None:
        self._similarity = resolve_token_similarity(new)

    #: What was given (``None``: ``colbert_scores``).
    similarity_fct = Setting[Any](after=_resolve_similarity)
    #: sentence-transformers' scoring chunk (default ``mini_batch_size``); config only: tiles are sized
    #: from ``memory_budget`` / ``tile_size``.
    score_mini_batch_size = Setting[int | str](none_reads_as="mini_batch_size")

    @property
    def similarity(self) -> MaxSim | XTR:
        """The core's tile score: [`MaxSim`][st_cached_losses.functional.multi_vector.MaxSim] or ``XTR``."""
        return self._similarity

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        return LossTerms(mnrl_terms(ONE_DIRECTION, "joint", None, 0.0, n_columns), self.similarity)

    def _gatherable(self, embeddings: list[Tensor]) -> list[Tensor]:
        return pad_to_common_tokens(embeddings)

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' six keys, the same values for the same settings, then the extras that
        differ from their defaults."""
        from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

        fn = self.similarity_fct if self.similarity_fct is not None else colbert_scores
        config: dict[str, Any] = {
            "scale": self.scale,
            "similarity_fct": scoring_config_name(fn),
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            # None where it follows an "auto" mini_batch_size: it rebuilds the same (their key takes a count)
            "score_mini_batch_size": None
            if self.score_mini_batch_size == "auto"
            else self.score_mini_batch_size,
            "gather_across_devices": self.gather_across_devices,
        }
        return {**config, **self._changed_settings()}

    def _columns(self, features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # each column's task, as sentence-transformers stamps it (a collator's choice kept): queries first
        return [
            {**f, "task": f.get("task", "query" if k == 0 else "document")} for k, f in enumerate(features)
        ]
