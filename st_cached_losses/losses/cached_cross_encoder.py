"""The cached reranker loss: sentence-transformers' cross-encoder ``CachedMultipleNegativesRankingLoss`` on the
template, where the rows are (query, document) pairs (the loss's ``columns`` make them from the text columns)
and the cached quantity is each pair's score (the [`PairScores`][st_cached_losses.losses.stages.reranker.PairScores]
stage)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_cached_losses.engine.features import (
    Features,
    InputsOnDemand,
    is_flattened,
    position_shift_invariant,
    unwrap_model,
)
from st_cached_losses.engine.multimodal import media_axes, patches_per_row
from st_cached_losses.losses.base import CachedLoss
from st_cached_losses.losses.citations import GRADCACHE_CITATION, MNRL_CITATION
from st_cached_losses.losses.settings import EngineSettings, setting
from st_cached_losses.losses.stages.reranker import PairScores

__all__ = ["CachedCrossEncoderLoss", "CrossEncoderSettings", "in_batch_negatives"]


def in_batch_negatives(batch_size: int, num_columns: int, num_negatives: int | None) -> Tensor:
    """Which candidates each anchor is scored against besides its own, drawn as sentence-transformers'
    cross-encoder ``MultipleNegativesRankingLoss`` draws them (the same call on the CPU generator, so a
    seeded step picks the same negatives as theirs).

    The candidates are the ``num_columns`` columns (positive, hard negatives) flattened column-major, so
    candidate ``c * batch_size + i`` is row ``i`` of column ``c``; an anchor never gets its own row's
    candidates.

    Args:
        batch_size: anchors ``B``.
        num_columns: candidate columns (1 + hard negatives).
        num_negatives: negatives per anchor, drawn without replacement; None, or at least the
            ``B * num_columns - num_columns`` there are: every other row's candidates, in order.

    Returns:
        ``(B, k)`` indices into the flattened candidates.
    """
    # (B, B * num_columns): True off each anchor's own row in every column
    allowed = ~torch.eye(batch_size, dtype=torch.bool).repeat(1, num_columns)
    available = batch_size * num_columns - num_columns
    if num_negatives is not None and num_negatives < available:
        return torch.multinomial(allowed.float(), num_negatives)
    every = torch.arange(batch_size * num_columns).repeat(batch_size, 1)
    return every[allowed].reshape(batch_size, -1)


#: pairs per tokenizer call when [`CachedCrossEncoderLoss.features`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss.features] measures the pairs
TOKENIZE_CHUNK = 64


def _pad(t: Tensor, width: int, left: bool, value: Any) -> Tensor:
    """``(n, t)`` padded to ``(n, width)``, on the left or the right, with ``value``."""
    return F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)


def _pad_inputs(features: Features, width: int, tokenizer: Any) -> Features:
    """A left-padded mini-batch's inputs padded on the left to ``width``, as the tokenizer pads."""
    pad_values = {
        "input_ids": tokenizer.pad_token_id,
        "token_type_ids": tokenizer.pad_token_type_id,
        "attention_mask": 0,
    }
    seq_len = features["attention_mask"].shape[1]
    out = dict(features)
    for key, value in features.items():
        if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] == seq_len:
            if key not in pad_values:
                raise ValueError(
                    f"cannot pad the reranker input {key!r} to the batch's width (the model has absolute "
                    "positions and its tokenizer pads on the left); set tokenizer.padding_side = 'right'."
                )
            out[key] = _pad(value, width, True, pad_values[key])
    return out


def _scale(name: str, value: Any) -> Any:
    # sentence-transformers skips the multiplication for a falsy scale (0 or None): accepted as theirs
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not torch.isfinite(torch.tensor(value))
    ):
        raise ValueError(f"{name} must be a finite number (or None: no scaling), got {value!r}; e.g. 10.0.")
    return value


def _num_negatives(name: str, value: Any) -> int | None:
    """A positive number of in-batch negatives, or None / ``"all"``: every one there is."""
    if value is None or value == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, or 'all' (None in Python), got {value!r}.")
    return value


def _activation(name: str, value: Any) -> Any:
    """A callable, None, or the config's form of a ``torch.nn`` module (its class path, as
    sentence-transformers' ``fullname`` writes it), built with no arguments."""
    if isinstance(value, str):
        module, _, cls_name = value.rpartition(".")
        if not module.startswith("torch.nn"):
            raise ValueError(
                f"{name}={value!r}: a class path is taken for torch.nn modules only (the config's form, e.g. "
                "'torch.nn.modules.activation.Sigmoid'); pass the module itself for another activation."
            )
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            return cls()
        except (ImportError, AttributeError, TypeError) as err:
            raise ValueError(
                f"{name}={value!r} is not a torch.nn module built with no arguments ({err})."
            ) from None
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be a function or module of the scores, or None, got {value!r}.")
    return value


def _class_path(activation: Any) -> str:
    """The activation as their config writes it: its class path, which the constructor takes back."""
    from sentence_transformers.util import fullname

    return fullname(activation)


@dataclass(frozen=True, kw_only=True)
class CrossEncoderSettings(EngineSettings):
    """[`CachedCrossEncoderLoss`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss]'s settings:
    sentence-transformers' cross-encoder ``CachedMultipleNegativesRankingLoss`` arguments."""

    owner: ClassVar[str] = "CachedCrossEncoderLoss"
    #: sentence-transformers' keys, in their order
    config_keys: ClassVar[tuple[str, ...]] = ("scale", "num_negatives", "activation_fn", "mini_batch_size")

    num_negatives: int | None = setting(
        4,
        doc="Documents of other rows scored against each query, drawn at random as sentence-transformers' "
        "reranker loss draws them (default 4); 'all' (or None): every other row's documents.",
        check=_num_negatives,
        config="always",
    )
    scale: float | None = setting(
        10.0,
        doc="Multiplies the reranker's activated scores in its softmax: 1 / temperature (10 for sigmoid scores); "
        "0 or None: not scaled, as sentence-transformers'.",
        check=_scale,
        config="always",
    )
    activation_fn: Any = setting(
        nn.Sigmoid(),  # theirs: one shared instance
        doc="Applied to each pair's score before scaling (default torch.nn.Sigmoid, as sentence-transformers'); "
        "None: the raw score.",
        check=_activation,
        config="always",
        config_form=lambda _, value: _class_path(value),
        module=True,
    )


class CachedCrossEncoderLoss(CachedLoss):
    name = "cross_encoder"
    aliases = ("cross-encoder", "crossencoder")
    st_names = ("CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss")
    settings_class = CrossEncoderSettings
    citations = (GRADCACHE_CITATION, MNRL_CITATION)
    equivalent_st_loss = "CachedMultipleNegativesRankingLoss"
    model_kind = "CrossEncoder"
    strict_model_kind = True
    #: the rows the engine caches are pairs, and what it keeps of each is the model's score
    engine_output = "scores"

    def __init__(
        self,
        model: nn.Module,
        num_negatives: int | None = 4,
        scale: float = 10.0,
        activation_fn: nn.Module | None = nn.Sigmoid(),  # noqa: B008 - theirs: one shared instance
        mini_batch_size: int | str = 32,
        show_progress_bar: bool = False,
        *,
        mini_batch_num_tokens: int | str | None = None,
        **engine: Any,
    ) -> None:
        """
        Multiple-negatives ranking loss for rerankers (``CrossEncoder``) with GradCache: each query is scored
        against its positive, ``num_negatives`` documents of other rows and its hard negatives, each pair a full
        forward of the joint text, with the memory of one mini-batch of pairs, exactly.

        The loss is the cross-entropy of picking the positive among ``scale * activation_fn(score)`` of the
        query's pairs, as sentence-transformers' cross-encoder ``MultipleNegativesRankingLoss``. Every pair's
        length is measured, and the pairs are scored without a graph in mini-batches cut from them sorted
        by their joint length (so a mini-batch pads little), each mini-batch tokenized when it runs (no step
        holds every pair's tokens); the loss and its gradient wrt every pair's score are computed at
        once (``B x (1 + k)`` numbers); in backward the model is replayed mini-batch by mini-batch, with the
        RNG state of its first forward (the same dropout masks), and the last mini-batch's graph is kept
        from the first pass instead of being replayed.

        The in-batch negatives are drawn exactly as theirs (the same ``torch.multinomial`` call on the CPU
        generator, before any forward), so a seeded step equals theirs. Across processes each process draws
        its negatives from its own batch, as theirs, and the loss is the mean over every process's queries:
        with DDP's gradient average, the gradient of one process on all the pairs, also when the processes
        hold different numbers of rows.

        Besides the arguments below, the loss takes the engine's knobs, keyword-only, each declared once on
        [`EngineSettings`][st_cached_losses.losses.settings.EngineSettings]; none changes the result. Its settings
        are a [`CrossEncoderSettings`][st_cached_losses.losses.cached_cross_encoder.CrossEncoderSettings]; the
        stage is [`PairScores`][st_cached_losses.losses.stages.reranker.PairScores].

        Args:
            model: the ``CrossEncoder`` to train, with one output label (``num_labels=1``).
            num_negatives: documents of other rows scored against each query (drawn at random, without
                replacement); None (or ``"all"``): every other row's positive and hard negatives.
            scale: multiplies the activated scores (``1 / temperature``); 0 or None: not scaled, as theirs.
            activation_fn: applied to each pair's score before scaling; None: the raw score. A class path
                (the config's form, ``"torch.nn.modules.activation.Sigmoid"``) of a ``torch.nn`` module is
                built with no arguments. A learnable one (e.g. ``nn.PReLU()``) gets its exact gradient,
                averaged over the processes as the model's is.
            mini_batch_size: pairs per model forward: sets the memory, never the result. ``"auto"``: the
                largest that fits ``mini_batch_memory_budget``, measured at the first step.
            show_progress_bar: tqdm bars over the mini-batches of both passes.
            mini_batch_num_tokens: a budget of real (non-padding) tokens of the joint pair per mini-batch
                instead of ``mini_batch_size``: pairs, longest first, are packed while their tokens fit (a
                longer pair alone). ``"auto"``: the largest budget that fits ``mini_batch_memory_budget``.

        References:
            - Henderson et al., Efficient Natural Language Response Suggestion for Smart Reply, 2017, section
              4.4: https://huggingface.co/papers/1705.00652
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. A ``CrossEncoder`` with ``num_labels=1``.
            2. A ``per_device_train_batch_size`` larger than ``mini_batch_size`` (else nothing is cached:
               the same result and memory as the non-cached loss).

        Inputs:
            | Inputs | Labels | Number of Model Output Labels |
            |---|---|---|
            | (anchor, positive) pairs | none | 1 |
            | (anchor, positive, negative) triplets | none | 1 |
            | (anchor, positive, negative_1, ..., negative_n) | none | 1 |

        Recommendations:
            - ``batch_sampler=BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates a positive.

        Relations:
            - Same loss and gradients as ``sentence_transformers.cross_encoder.losses.MultipleNegativesRankingLoss``
              and its ``CachedMultipleNegativesRankingLoss`` (for the same seed).

        Example:
            ```python
            from datasets import Dataset
            from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer
            from st_cached_losses import CachedCrossEncoderLoss

            model = CrossEncoder("microsoft/mpnet-base", num_labels=1)
            train_dataset = Dataset.from_dict({
                "query": ["What are pandas?", "What is the capital of France?"],
                "answer": ["Pandas are a kind of bear.", "The capital of France is Paris."],
            })
            loss = CachedCrossEncoderLoss(model, mini_batch_size=32)
            trainer = CrossEncoderTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        _check_labels(model, type(self).__name__)
        super().__init__(
            model,
            CrossEncoderSettings(
                num_negatives=num_negatives,
                scale=scale,
                activation_fn=activation_fn,
                mini_batch_size=mini_batch_size,
                show_progress_bar=show_progress_bar,
                mini_batch_num_tokens=mini_batch_num_tokens,
                **engine,
            ),
        )

    def build_stage(self) -> PairScores:
        s = self.settings
        return PairScores(owner=type(self).__name__, scale=s.scale, activation_fn=s.activation_fn)

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The parameters of a learnable ``activation_fn`` (e.g. ``nn.PReLU()``) that require grad, by name."""
        activation = self.settings.activation_fn
        if not isinstance(activation, nn.Module):
            return {}
        return {f"activation_fn.{n}": p for n, p in activation.named_parameters() if p.requires_grad}

    def engine_columns(
        self, inputs: Any, prompt: str | None = None, task: str | None = None, **call: Any
    ) -> list[Any]:
        """The step's pairs as the engine's columns, from ``(query, positive[, negative_1, ...])`` text
        columns (see [`pairs`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss.pairs] and
        [`columns`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss.columns]);
        ``prompt`` and ``task``: the model's ``preprocess`` arguments (set per dataset by sentence-transformers'
        collator), applied to every pair."""
        inputs = list(inputs)
        batch_size = len(inputs[0]) if len(inputs) else 0
        return self.columns(self.pairs(inputs), batch_size, prompt, task)

    def pairs(self, inputs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
        """The (query, document) pairs of one step, column-major: every query with its positive, then
        with each in-batch negative (one draw per call, see [`in_batch_negatives`][st_cached_losses.losses.cached_cross_encoder.in_batch_negatives]), then with each
        hard-negative column; pair ``c * B + i`` is query ``i``'s ``c``-th candidate."""
        if len(inputs) < 2:
            raise ValueError(
                f"{type(self).__name__} needs at least two text columns, (query, positive[, negatives...]); got "
                f"{len(inputs)}. A 'label'/'score' column is not a text column."
            )
        queries, columns = list(inputs[0]), [list(c) for c in inputs[1:]]
        if not queries:
            raise ValueError(f"{type(self).__name__} got an empty batch: there is nothing to rank.")
        if any(len(c) != len(queries) for c in columns):
            raise ValueError(
                f"{type(self).__name__}: every column needs one entry per query ({len(queries)}); got "
                f"{[len(c) for c in columns]}."
            )
        flat = [doc for column in columns for doc in column]
        chosen = in_batch_negatives(len(queries), len(columns), self.settings.num_negatives)
        candidates = [columns[0]]
        candidates += [[flat[j] for j in column.tolist()] for column in chosen.T]
        candidates += columns[1:]
        return [(q, doc) for column in candidates for q, doc in zip(queries, column)]

    def columns(
        self, pairs: list[tuple[str, str]], batch_size: int, prompt: str | None, task: str | None
    ) -> list[Features]:
        """The step's pairs as the engine's columns (see [`features`][st_cached_losses.losses.cached_cross_encoder.CachedCrossEncoderLoss.features]): one column of every pair, or, for
        a model with absolute positions whose tokenizer pads on the left, one column per candidate column
        (``batch_size`` pairs each), so that each pair is padded to its own column's widest pair as the
        non-cached loss pads it (its positions depend on that padding)."""
        tokenizer = getattr(unwrap_model(self.model), "tokenizer", None)
        if getattr(tokenizer, "padding_side", "right") != "left" or position_shift_invariant(self.model):
            return [self.features(pairs, prompt, task)]
        return [
            self.features(pairs[i : i + batch_size], prompt, task) for i in range(0, len(pairs), batch_size)
        ]

    def features(self, pairs: list[tuple[str, str]], prompt: str | None, task: str | None) -> Features:
        """The pairs as one engine column, made per mini-batch ([`InputsOnDemand`][st_cached_losses.engine.features.InputsOnDemand]): it holds
        every pair's attention mask (the planning sorts and cuts by it), and a mini-batch's pairs are
        tokenized when it runs (prompt and task as the model's ``preprocess`` takes them), in the first pass
        and again in the replay, as sentence-transformers' cached loss tokenizes them: the very tokens of
        the pairs tokenized at once, no step holds every pair's tokens (``B x B`` with every in-batch
        negative), and they go to the model's device a mini-batch at a time.

        A model that flattens its inputs (padding-free, as sentence-transformers does under flash
        attention's variable-length kernels) gets every pair's real tokens flattened at once (no padding
        to hold; the engine slices them per sequence).

        A multimodal reranker's pairs (a document or query with images) are measured with their images: the
        column keeps each pair's vision patches where the processor flattens them (Qwen2-VL), which a token
        budget and the ``"auto"`` sizes count besides the pair's tokens, as for an embedding model's column."""
        inner = unwrap_model(self.model)
        kwargs = {"task": task} if task is not None else {}
        tokenizer = getattr(inner, "tokenizer", None)
        left = getattr(tokenizer, "padding_side", "right") == "left"

        def tokenize(part: list[tuple[str, str]]) -> Features:
            return dict(inner.preprocess(part, prompt=prompt, **kwargs))  # type: ignore[operator]

        # the masks chunk by chunk: a fast tokenizer's working memory (each truncated pair's overflow
        # included) is one chunk's
        chunks = [tokenize(pairs[:TOKENIZE_CHUNK])]
        if is_flattened(chunks[0]):  # no attention mask: each pair's tokens delimited by cu_seq_lens_q
            return chunks[0] if len(pairs) <= TOKENIZE_CHUNK else tokenize(pairs)
        chunks += [
            tokenize(pairs[i : i + TOKENIZE_CHUNK]) for i in range(TOKENIZE_CHUNK, len(pairs), TOKENIZE_CHUNK)
        ]
        masks = [chunk["attention_mask"].bool() for chunk in chunks]
        # a multimodal reranker's pairs: the vision patches of each pair's images, which a token budget counts
        patches = [patches_per_row(media_axes(c, len(m)), len(m)) for c, m in zip(chunks, masks)]
        del chunks
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([_pad(m, width, left, False) for m in masks])
        per_pair = None
        if any(p is not None for p in patches):
            per_pair = torch.cat(
                [
                    p if p is not None else torch.zeros(len(m), dtype=torch.long)
                    for p, m in zip(patches, masks)
                ]
            )

        def make(rows: Tensor, trim_leading: bool) -> Features:
            out = tokenize([pairs[i] for i in rows.tolist()])
            if left and not trim_leading:
                # a model with absolute positions numbers a left-padded pair's tokens after all the padding
                # of the whole column (see slice_features): pad to its width as the tokenizer pads
                out = _pad_inputs(out, width, tokenizer)
            return out

        return InputsOnDemand(mask, make, per_pair)


def _check_labels(model: nn.Module, owner: str) -> None:
    """A ``CrossEncoder`` with one output label, as sentence-transformers' loss requires."""
    inner = unwrap_model(model)
    labels = getattr(inner, "num_labels", 1)
    if labels != 1:
        raise ValueError(
            f"{owner} expects a model with 1 output label, but got a model with {labels} output labels; "
            "load it as CrossEncoder(..., num_labels=1)."
        )
