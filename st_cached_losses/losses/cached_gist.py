from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.engine.features import batch_size_of, input_ids_by_row, model_device, unwrap_model
from st_cached_losses.functional import scale_value
from st_cached_losses.functional.options import Guide
from st_cached_losses.functional.terms import gist_terms
from st_cached_losses.losses._base import LearnableScale, LossStageOptions, LossTerms, StepData
from st_cached_losses.losses.citations import GIST_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.settings import Setting

_NO_TOKENIZER = "Both the training model and the guiding model must have a tokenizer attribute."


class CachedGISTLoss(LearnableScale):
    _citations = (GRADCACHE_CITATION, GIST_CITATION)
    equivalent_st_loss = "CachedGISTEmbedLoss"

    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module,
        temperature: float = 0.01,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        show_progress_bar: bool = False,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        learnable_scale: bool = False,
        max_scale: float = 100.0,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        GISTEmbed's guided in-batch negatives with GradCache: a frozen guide model removes the in-batch
        negatives it rates above the positive (likely false negatives), exactly as sentence-transformers'
        ``GISTEmbedLoss``, for batches of thousands in the memory of one encoder mini-batch.

        The guide embeds each column once per step, mini-batch by mini-batch and without a graph (re-tokenising
        the texts when its tokenizer differs from the model's); it is never replayed nor trained. Its mask is
        computed tile by tile next to the logits, never as a ``B x C`` matrix; across processes the guide's
        embeddings of the candidates are gathered (or travel around the ring) with the model's.

        The constructor takes sentence-transformers' ``CachedGISTEmbedLoss`` arguments in its positional order,
        then our extras, keyword-only. Every argument is also a property, read and assigned between steps
        (``guide`` too: a new guide is checked as at construction and ``must_retokenize`` is decided again);
        ``scale`` (``1 / temperature``) and ``learnable_scale`` / ``max_scale`` (CLIP's learned, clamped
        ``log(scale)``, as on ``CachedMNRLoss``) as well. It has only the settings GIST uses: not
        ``directions``, ``partition_mode``, ``symmetric``, ``similarity_fct``, ``hardness_mode``,
        ``hardness_strength`` nor ``mask_duplicates`` (the guide, not these, decides which negatives count).

        Besides the arguments below, the loss takes the engine's knobs and the loss stage's plan (``path``,
        ``tile_size``, ``memory_budget``), keyword-only, each documented once on
        [`LossStageOptions`][st_cached_losses.losses._base.LossStageOptions]; none changes the result.

        Args:
            model: the SentenceTransformer to train.
            guide: a SentenceTransformer rating the pairs (any embedding size; cosine similarity); the model
                itself is accepted (self-guidance, as in sentence-transformers): its embeddings for the guide
                are then computed without a graph, in the mode the model is in (as theirs: no ``eval()``).
            temperature: divides the cosine similarities (``scale = 1 / temperature``).
            mini_batch_size: rows per encoder forward (the model's and the guide's), or ``"auto"``.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per mini-batch instead of
                ``mini_batch_size``, as sentence-transformers.
            show_progress_bar: tqdm bars over the mini-batches.
            margin_strategy: ``"absolute"``: remove a negative whose guide similarity exceeds the positive's
                minus ``margin``; ``"relative"``: exceeds the positive's minus ``|positive's| * margin``.
            margin: the margin of that rule (0: remove only negatives rated above the positive).
            contrast_anchors: also contrast each anchor with this process's other anchors.
            contrast_positives: also contrast each positive with every other positive.
            gather_across_devices: score each process's anchors against every process's positives and
                negatives (the guide's embeddings of them are gathered too).
            learnable_scale: learn the scale as CLIP's ``logit_scale = log(scale)``, clamped at ``max_scale``
                (sentence-transformers' GIST losses have a fixed temperature); give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it.
            max_scale: the clamp of a learned scale.

        References:
            - Solatorio, GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding
              Fine-tuning, 2024: https://huggingface.co/papers/2402.16829
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Relations:
            - Equals ``sentence_transformers.sentence_transformer.losses.GISTEmbedLoss`` (and ``CachedGISTEmbedLoss``) with the same
              arguments, on one process and with ``gather_across_devices``.

        Inputs:
            (anchor, positive) pairs or (anchor, positive, negative, ...) columns; no labels.
        """
        super().__init__(
            model,
            scale=1.0 / scale_value(temperature, name="temperature"),
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            **engine,
        )
        self.gather_across_devices = gather_across_devices
        if not hasattr(model, "tokenizer"):
            raise ValueError(_NO_TOKENIZER)
        # kept from construction: the trainer later puts a DDP / FSDP wrapper, without a tokenizer, in .model
        self._model_tokenizer = cast(Any, model).tokenizer
        self.guide = guide  # checked, and must_retokenize decided
        self.margin_strategy = margin_strategy
        self.margin = margin
        self.contrast_anchors = contrast_anchors
        self.contrast_positives = contrast_positives
        self._init_learnable_scale(learnable_scale, max_scale)

    @property
    def guide(self) -> nn.Module:
        """The guide model (a registered submodule, as in sentence-transformers). Assigning one checks it as at
        construction and decides again whether it reads the model's token ids or the re-tokenised texts."""
        return self._modules["guide"]  # type: ignore[return-value]

    @guide.setter
    def guide(self, value: nn.Module) -> None:
        self._check_guide(value, self.gather_across_devices)
        self._modules["guide"] = value
        self.must_retokenize = self._must_retokenize(value)

    @staticmethod
    def _check_guide(guide: nn.Module, gather: bool) -> None:
        if guide is None:
            raise ValueError(
                "CachedGISTLoss needs a guide model, got guide=None: pass a SentenceTransformer that rates the "
                "pairs, e.g. CachedGISTLoss(model, SentenceTransformer('all-MiniLM-L6-v2')) (the model before "
                "fine-tuning, or a stronger one), or the model itself for self-guidance: CachedGISTLoss(model, model)."
            )
        if not hasattr(guide, "tokenizer"):
            raise ValueError(_NO_TOKENIZER)
        size = getattr(guide, "get_embedding_dimension", None) or getattr(
            guide, "get_sentence_embedding_dimension", None
        )
        dim = size() if size is not None else None
        if gather and not isinstance(dim, int):
            raise ValueError(
                "guide: with gather_across_devices=True every process's guide embeddings are gathered into one "
                "matrix, so the guide must declare its embedding size (get_embedding_dimension() returned "
                f"{dim!r}); end the guide with a Pooling (or Dense) module, or set gather_across_devices=False."
            )

    def _must_retokenize(self, guide: nn.Module) -> bool:
        """sentence-transformers' rule: another vocabulary, or a guide that reads fewer tokens than the model."""
        model = unwrap_model(self.model)  # the trainer may have wrapped it by now
        try:
            same_vocab = self._model_tokenizer.get_vocab() == cast(Any, guide).tokenizer.get_vocab()
        except AttributeError:
            return True
        return not same_vocab or getattr(guide, "max_seq_length", 0) < getattr(model, "max_seq_length", 0)

    # ------------------------------------------------------------------ settings

    def _check_gathered_guide(self, value: bool) -> bool:
        # the guide's embeddings are gathered too: a guide of unknown size is refused here as at construction
        if value and "guide" in self._modules:
            self._check_guide(self.guide, True)
        return value

    gather_across_devices = Setting[bool](validate=_check_gathered_guide)
    margin_strategy = Setting[str]()
    margin = Setting[float]()
    contrast_anchors = Setting[bool]()
    contrast_positives = Setting[bool]()

    def get_config_dict(self) -> dict[str, Any]:
        """sentence-transformers' ``CachedGISTEmbedLoss`` keys, with the current values, then the extras
        that differ from their defaults (a learnable scale's settings when learnable)."""
        config = {
            "guide": self.guide,
            "temperature": self.temperature,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "contrast_anchors": self.contrast_anchors,
            "contrast_positives": self.contrast_positives,
            "gather_across_devices": self.gather_across_devices,
        }
        return {**config, **self._changed_settings()}

    # ------------------------------------------------------------------ forward

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        """The guide's embeddings of the batch (no graph), where the model's embeddings are."""
        guide_features = self._guide_features(features)
        with torch.no_grad():
            guided = self.cache.embed(self.guide, guide_features)
        assert all(g.shape[0] == batch_size_of(features[0]) for g in guided)
        return StepData(guide=[g.to(model_device(self.model)) for g in guided])

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        g = step.guide
        if g is None or len(g) != n_columns + 1 or len(g[0]) != n_rows:
            raise ValueError(
                "CachedGISTLoss needs the guide's embeddings of the same batch: call the loss on the features "
                "(loss(features, labels)), which embeds them with the guide, rather than calculate_loss directly."
            )
        terms = gist_terms(
            self.contrast_anchors, self.contrast_positives, n_columns, self.margin_strategy, self.margin
        )
        return LossTerms(terms, "cosine", guide=Guide(g[0], g[1:]))

    def _guide_features(self, features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The columns as the guide reads them: re-tokenised from the text when its tokenizer differs."""
        if self.must_retokenize:
            decode = self._model_tokenizer.batch_decode
            guide = cast(Any, self.guide)
            features = [
                guide.preprocess(decode(input_ids_by_row(f), skip_special_tokens=True)) for f in features
            ]
        device = model_device(self.guide)
        return [{k: v.to(device) if isinstance(v, Tensor) else v for k, v in f.items()} for f in features]
