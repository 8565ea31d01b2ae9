"""What a call of the loss stage is given besides the embeddings: [`InfoNCEOptions`][st_cached_losses.functional.softmax.options.InfoNCEOptions], the options of
every entry point, written once, and [`LossSpec`][st_cached_losses.functional.softmax.options.LossSpec], what the drivers read: the options resolved for a
call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.checks import (
    check_matmul_precision,
    check_path,
    check_positive_int,
    validate_keys,
)
from st_cached_losses.functional.kernels.tiles import DEFAULT_MEMORY_BUDGET
from st_cached_losses.functional.placement import LossPath
from st_cached_losses.functional.precision import MatmulPrecision, Products, global_matmul_precision
from st_cached_losses.functional.score import Score, Similarity
from st_cached_losses.functional.softmax.flash import kernels_enabled
from st_cached_losses.functional.softmax.terms import PairKeys, TermSet, bank_terms, mnrl_terms

__all__ = [
    "FALSE_NEGATIVE_FILTERS",
    "Bank",
    "FalseNegativeFilter",
    "Guide",
    "InfoNCEOptions",
    "Keys",
    "LossPath",
    "LossSpec",
]


@dataclass
class Guide:
    """A guide model's embeddings of the same batch (GIST): ``anchors`` ``(B, g)`` of this process,
    ``candidates`` one ``(N, g)`` per column, laid out like the loss's candidates (gathered)."""

    anchors: Tensor
    candidates: list[Tensor]


#: the false-negative filters and each one's typical margin (NV-Retriever's TopK-PercPos, Qwen3-Embedding's)
FALSE_NEGATIVE_FILTERS = {"relative": 0.95, "absolute": 0.1}


@dataclass(frozen=True)
class FalseNegativeFilter:
    """Positive-aware false-negative filtering with the loss's own similarities as the judge: a candidate
    (any entry of any term but the row's positive) is no negative of row ``i`` when its similarity to the
    row exceeds, with ``p`` the row's positive similarity,

    * ``"relative"`` (NV-Retriever's TopK-PercPos): ``margin * p`` (``margin`` in ``(0, 1]``, typically
      0.95; for a negative ``p`` the threshold ``p - |p| (1 - margin)``, so that an entry rated above the
      positive is always removed);
    * ``"absolute"`` (Qwen3-Embedding): ``p + margin`` (``margin >= 0``, typically 0.1).

    These are GIST's thresholds ([`positive_thresholds`][st_cached_losses.functional.softmax.terms.positive_thresholds])
    with GIST's margin ``1 - margin`` (relative) and ``-margin`` (absolute). The mask is decided without
    gradient from the logits the loss computes (so at each truncation of a MatryoshkaLoss from that
    truncation's similarities); the row's positive is the one of the softmax being computed (with several
    positives per row, each positive's own). ``tally``: an ``(2,)`` int64 tensor the call adds to (entries
    removed, negatives seen), for monitoring."""

    strategy: str
    margin: float
    tally: Tensor | None = None

    def __post_init__(self) -> None:
        if self.strategy not in FALSE_NEGATIVE_FILTERS:
            raise ValueError(
                f"false-negative filter must be 'relative' or 'absolute', got {self.strategy!r}."
            )
        m = self.margin
        if (
            isinstance(m, bool)
            or not isinstance(m, (int, float))
            or not (0.0 < m <= 1.0 if self.strategy == "relative" else 0.0 <= m < float("inf"))
        ):
            bounds = (
                "in (0, 1], e.g. 0.95" if self.strategy == "relative" else "a finite number >= 0, e.g. 0.1"
            )
            raise ValueError(f"a {self.strategy} false-negative margin must be {bounds}; got {m!r}.")

    @property
    def gist_margin(self) -> float:
        """The margin in GIST's form (``positive_thresholds``)."""
        return 1.0 - float(self.margin) if self.strategy == "relative" else -float(self.margin)


@dataclass
class Bank:
    """A negative bank's embeddings (ContAccum-style, without gradient): earlier steps' rows scored as extra
    negatives. ``candidates`` ``(n, d)``: past candidate embeddings (positives and hard negatives), extra
    columns of every term that scores rows against the candidates; ``anchors`` ``(m, d)`` or None: past
    anchors, extra columns of every term that scores rows against the anchors (the symmetric loss's
    positive -> anchors direction). Either may have 0 rows: it adds nothing then.

    On one process they are the bank as it is; the strategies across processes take this process's share
    and exchange it as they exchange the candidates (gathered, or around the ring). No gradient reaches
    them, and none of their entries is a row's positive."""

    candidates: Tensor
    anchors: Tensor | None = None

    @property
    def sizes(self) -> tuple[int, int]:
        """Rows of the candidates and of the anchors (0 without)."""
        return self.candidates.shape[0], (self.anchors.shape[0] if self.anchors is not None else 0)


@dataclass
class Keys:
    """Duplicate keys of a call (``mask_duplicates``): ``anchors`` ``(B,)`` this process's anchors' (or
    None: pairs are then compared by their positives only), ``candidates`` one ``(N,)`` per column, and
    ``anchors_all`` ``(N,)`` every positive's anchor's (across processes; None on one process)."""

    anchors: Tensor | None
    candidates: list[Tensor]
    anchors_all: Tensor | None = None

    def sources(self, row_offset: int, b: int) -> dict[str, PairKeys]:
        """The keys of every row and column source (see [`PairKeys`][st_cached_losses.functional.softmax.terms.PairKeys])."""
        pos = self.candidates[0]
        pair_anchor = self.anchors_all if self.anchors_all is not None else self.anchors
        rows = PairKeys(pos[row_offset : row_offset + b], self.anchors)
        out = {"q": rows, "d": rows, "q_local": rows, "q_all": PairKeys(pos, pair_anchor)}
        out["c0"] = out["q_all"]
        out.update({f"c{k}": PairKeys(c, pairs=False) for k, c in enumerate(self.candidates) if k > 0})
        return out


@dataclass(frozen=True, kw_only=True, eq=False)
class InfoNCEOptions:
    """The options of every InfoNCE entry point ([`infonce`][st_cached_losses.functional.softmax.loss.infonce],
    [`infonce_loss_and_grad`][st_cached_losses.functional.softmax.loss.infonce_loss_and_grad] and the strategies of [`parallel`][st_cached_losses.functional.softmax.parallel]). An entry point takes
    them as keywords (``infonce(a, c, scale=20.0, path="tiled")``) or as one object (``infonce(a, c,
    options)``, keywords replacing its fields). Checked when made.

    Args:
        scale: ``1 / temperature``; a float or a 0-d tensor (its gradient is returned if it requires grad).
        similarity: ``"cosine"`` (embeddings normalised once), ``"dot"``, or a function
            ``f(a (b, d), c (t, d)) -> (b, t)`` scored exactly tile by tile through autograd (slower).
        symmetric: also score each of this process's positives against every anchor, and average.
        terms: the loss as logit terms ([`st_cached_losses.functional.softmax.terms`][st_cached_losses.functional.softmax.terms]: sentence-transformers'
            ``directions`` / ``partition_mode`` / hardness options, or GIST's terms, built by
            ``mnrl_terms`` / ``gist_terms``); replaces ``symmetric``. Across processes, pass the
            gathered anchors as ``anchors_all`` when a term reads them (``terms.uses_anchors_all``).
        guide: a guide model's embeddings (GIST), for terms that are guided.
        path: ``"chunked"`` (row chunks against all candidates; one pass unless a softmax runs down the
            columns), ``"tiled"`` (Inf-CL-style tiles in both dimensions, memory ``O((B + N) d)`` plus a
            few tiles) or ``"auto"`` (chunked when ``memory_budget`` allows chunks of at least 64 rows).
        chunk_size: rows per chunk for the chunked path (default: from ``memory_budget``).
        tile_size: tile side for the tiled path (default: from ``memory_budget``, at most 2048).
        memory_budget: bytes of logit blocks to hold at once when sizes are not given.
        anchor_keys: ``(B,)`` integer keys (e.g. hashes of the token ids) of the anchors, with
            ``candidate_keys`` (one ``(N,)`` per column) and, when ``N != B`` (across processes),
            ``anchors_all_keys`` ``(N,)``, the keys of every positive's anchor; they mask false
            negatives in every term. Pairs ``i != j`` are duplicates when their anchors' keys or their
            positives' keys are equal; then pair ``j``'s entries (its positive, its anchor) are masked
            out of row ``i``'s softmaxes, and any hard negative whose key equals row ``i``'s positive's
            too. A row's own pair is never masked. Without ``anchor_keys`` only equal positives make
            duplicates.
        candidate_keys: see ``anchor_keys``.
        anchors_all_keys: see ``anchor_keys``.
        anchors_all: ``(N, d)`` gathered anchors, for ``symmetric=True`` across processes.
        row_offset: index of this process's first positive in the (gathered) candidate columns.
        check_finite: raise ``ValueError`` on NaN / inf embeddings (one cheap pass over the inputs).
        bank: a negative bank ([`Bank`][st_cached_losses.functional.softmax.options.Bank]): earlier rows' embeddings
            scored as extra negatives, without gradient; None (default) or an empty bank: none.
        matmul_precision: the precision of the similarity products, with
            ``torch.set_float32_matmul_precision``'s names: ``"highest"`` (fp32, the exact path), ``"high"``
            (TF32 on CUDA; fp32 on a CPU), ``"medium"`` (bf16 operands, fp32 sums: what bf16 tensor cores
            compute); None (default): ``torch.get_float32_matmul_precision()`` at the call. Maxima,
            log-sum-exps, sums of probabilities and accumulated gradients are fp32 whatever it says. On CUDA
            with Triton installed, ``"high"`` and ``"medium"`` run FlashAttention-style kernels
            ([`flash`][st_cached_losses.functional.softmax.flash]). Losses with a guide (GIST), duplicate keys or a
            hardness penalty, a similarity function, packed (multi-vector, sparse) rows and fp64 inputs keep
            fp32 products (see [`Products`][st_cached_losses.functional.precision.Products]).
        listed_negatives: the hard-negative columns (``candidates[1:]``) are lists: each may have any number
            of rows (every row's own number of negatives, flattened; a column of ``None`` where a row has
            none holds the rows that have one), and each of their entries is a candidate of every row and
            no row's own, so no term may treat their diagonal apart (no hardness penalty on a row's own hard
            negatives, no ``doc_to_doc``); a list column may be empty. Across processes they are gathered,
            or passed around the ring, at each process's own lengths (no duplicate keys or guide on the ring).
            Several positives per row: [`positives`][st_cached_losses.functional.softmax.positives].
        false_negatives: a [`FalseNegativeFilter`][st_cached_losses.functional.softmax.options.FalseNegativeFilter]:
            every candidate the loss's own similarities rate too close to (or above) the row's positive is
            removed from the row's softmaxes, in every term and column source (the bank's too); None (default):
            none. Its products are fp32, as with duplicate keys.

    ``anchors_all``, ``row_offset``, ``anchors_all_keys`` and ``check_finite`` describe one process's rows
    against columns the caller gathered: the strategies of [`parallel`][st_cached_losses.functional.softmax.parallel] set them (and refuse the first
    three); their finiteness check is [`agree_on_sizes`][st_cached_losses.functional.placement.agree_on_sizes]."""

    scale: float | Tensor = 20.0
    similarity: Similarity = "cosine"
    symmetric: bool = False
    terms: TermSet | None = None
    guide: Guide | None = None
    path: LossPath = "auto"
    chunk_size: int | None = None
    tile_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    anchor_keys: Tensor | None = None
    candidate_keys: Sequence[Tensor] | None = None
    anchors_all_keys: Tensor | None = None
    anchors_all: Tensor | None = None
    row_offset: int = 0
    check_finite: bool = True
    bank: Bank | None = None
    matmul_precision: MatmulPrecision | None = None
    listed_negatives: bool = False
    false_negatives: FalseNegativeFilter | None = None

    def __post_init__(self) -> None:
        Score(self.similarity)  # refuses anything but "cosine", "dot" or a function
        check_path("path", self.path)
        check_matmul_precision("matmul_precision", self.matmul_precision)
        for name in ("chunk_size", "tile_size", "memory_budget"):
            check_positive_int(name, getattr(self, name))
        if self.terms is not None and self.symmetric:
            raise ValueError("pass either terms or symmetric=True, not both: terms say every direction.")
        if (self.terms is not None and self.terms.guided) != (self.guide is not None):
            raise ValueError(
                "guided terms (GIST) need guide=Guide(...) embeddings, and a guide needs guided terms."
            )

    @classmethod
    def of(cls, options: InfoNCEOptions | None, keywords: dict[str, Any]) -> InfoNCEOptions:
        """An entry point's options: ``options`` (default: the defaults) with ``keywords`` replacing its fields."""
        if options is None:
            return cls(**keywords)
        if not isinstance(options, cls):
            raise TypeError(
                f"options must be an InfoNCEOptions, got {options!r}: pass the options as keywords."
            )
        return replace(options, **keywords) if keywords else options

    @property
    def uses_anchors_all(self) -> bool:
        """Whether the loss scores against every process's anchors (they must be gathered)."""
        return self.symmetric or (self.terms is not None and self.terms.uses_anchors_all)

    def spec(self, anchors: Tensor, cols: list[Tensor], score: Score) -> LossSpec:
        """What the drivers read for a call on ``anchors`` and candidate columns ``cols``, scored by ``score``:
        the terms (the given ones, or the one-directional / symmetric loss's) and the keys, both checked
        against the embeddings, as is the guide."""
        guide = self.guide
        if guide is not None and (
            guide.anchors.shape[0] != anchors.shape[0]
            or [c.shape[0] for c in guide.candidates] != [c.shape[0] for c in cols]
        ):
            raise ValueError(
                f"the guide's embeddings must have the loss's rows: anchors {anchors.shape[0]}, columns "
                f"{[c.shape[0] for c in cols]}; got {guide.anchors.shape[0]} and {[c.shape[0] for c in guide.candidates]}."
            )
        validate_keys(
            self.anchor_keys, self.candidate_keys, self.anchors_all_keys, anchors, cols, self.anchors_all,
            self.symmetric,
        )  # fmt: skip
        keys = None
        if self.candidate_keys is not None:
            keys = Keys(self.anchor_keys, list(self.candidate_keys), self.anchors_all_keys)
        terms = self.terms
        if self.listed_negatives:
            self._check_listed(terms)
        if terms is not None and not terms.in_batch:
            raise ValueError(
                "terms without in-batch negatives (in_batch=False) are each row's own candidates, computed by "
                "st_cached_losses.functional.softmax.own: call infonce / infonce_loss_and_grad / loss_and_grad, which "
                "send them there, not a tile driver."
            )
        if terms is None:
            directions = ("query_to_doc", "doc_to_query") if self.symmetric else ("query_to_doc",)
            terms = mnrl_terms(directions, "per_direction", None, 0.0, len(cols))
        if self.bank is not None:
            terms = self._with_bank(terms, self.bank, anchors, score)
        # a score whose rows carry data computed from every column (XTR's retrieved tokens)
        if hasattr(score.fn, "with_row_data") and any(
            t.rows != "q" or not t.cols.startswith("c") for t in terms.terms
        ):
            raise ValueError(
                f"{score.fn!r} scores queries against documents only (its top-k runs over the document "
                "columns' tokens): the loss's terms may score only the anchors against the candidate columns "
                "(query_to_doc), not documents against anchors."
            )
        return LossSpec(self, terms, score.with_products(self._products(anchors, terms, score, keys)), keys)

    def _check_listed(self, terms: TermSet | None) -> None:
        """Lists of hard negatives belong to no row: refuse what reads a row's own entry of them."""
        if terms is None:
            return
        if not terms.in_batch:
            raise ValueError(
                "listed_negatives=True: a list of hard negatives belongs to no row's own entries, so a loss "
                "without in-batch negatives (in_batch=False) has nothing to score them against; use one or the "
                "other."
            )
        for t in terms.terms:
            if t.cols.startswith("c") and t.cols != "c0" and (t.diag != "keep" or t.pen_diag != t.pen_off):
                raise ValueError(
                    f"listed_negatives=True: the term {t.rows!r} -> {t.cols!r} treats a row's own entry of a "
                    "hard-negative column apart (a penalty on the row's own hard negatives, or removing them as "
                    "doc_to_doc does), but a listed negative is no row's own entry; use terms that score every "
                    "entry of a hard-negative column alike."
                )

    def _products(self, anchors: Tensor, terms: TermSet, score: Score, keys: Keys | None) -> Products:
        """``matmul_precision`` as this call runs it (see [`Products`][st_cached_losses.functional.precision.Products]):
        fp32 products for the losses that keep them; TF32 only on CUDA (or the kernels' interpreter); the
        kernels where every term is a plain one (no diagonal removed) and they can run here."""
        if anchors.dtype == torch.float64 or not score.gemm or score.packed:
            return Products()
        precision = self.matmul_precision or global_matmul_precision(anchors.device.type)
        masked = (
            self.guide is not None or keys is not None or terms.guided or self.false_negatives is not None
        )
        if precision == "highest" or masked or any(t.pen_off or t.pen_diag for t in terms.terms):
            return Products()
        kernels = all(t.diag in ("positive", "keep") for t in terms.terms) and kernels_enabled(anchors.device)
        if precision == "high" and anchors.device.type != "cuda" and not kernels:
            return Products()  # no TF32 on this device: fp32
        return Products(precision, kernels)

    def _with_bank(self, terms: TermSet, bank: Bank, anchors: Tensor, score: Score) -> TermSet:
        """``terms`` extended by the bank's columns, checked against the embeddings."""
        if score.packed:
            raise ValueError(
                "a negative bank holds (n, d) embeddings: it cannot be scored with a score of packed rows "
                "(multi-vector or sparse); leave bank None."
            )
        if self.candidate_keys is not None:
            raise ValueError(
                "a negative bank has no duplicate keys, so its entries could not be masked: use either the bank "
                "or duplicate keys (mask_duplicates), not both."
            )
        for name, x in (("bank.candidates", bank.candidates), ("bank.anchors", bank.anchors)):
            if x is not None and (x.dim() != 2 or x.shape[1] != anchors.shape[1]):
                raise ValueError(
                    f"{name} must be (rows, {anchors.shape[1]}) embeddings like the anchors, got {tuple(x.shape)}."
                )
        n_c, n_q = bank.sizes
        return bank_terms(terms, n_c > 0, n_q > 0)


@dataclass(frozen=True)
class LossSpec:
    """What the drivers read, fixed for a call: the options (where this process's positives are, the
    block plan's inputs, the guide), and what they resolve to on the call's embeddings: the loss's terms,
    its score and the duplicate keys."""

    options: InfoNCEOptions
    terms: TermSet
    score: Score
    keys: Keys | None = None
