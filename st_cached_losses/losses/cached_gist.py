from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from st_cached_losses.engine.features import batch_size_of, input_ids_by_row, model_device, unwrap_model
from st_cached_losses.engine.multimodal import media_inputs
from st_cached_losses.functional import scale_value
from st_cached_losses.functional.options import Guide
from st_cached_losses.functional.terms import gist_terms
from st_cached_losses.losses._base import LearnableScale, LossStageOptions, LossTerms, StageOutput, StepData
from st_cached_losses.losses.citations import GIST_CITATION, GRADCACHE_CITATION
from st_cached_losses.losses.settings import Setting, check_own_candidates

_NO_TOKENIZER = "Both the training model and the guiding model must have a tokenizer attribute."


class CachedGISTLoss(LearnableScale):
    _citations = (GRADCACHE_CITATION, GIST_CITATION)
    equivalent_st_loss = "CachedGISTEmbedLoss"

    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module | None = None,
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
        in_batch_negatives: bool = True,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        """
        GISTEmbed's guided in-batch negatives with GradCache: a frozen guide model removes the in-batch
        negatives it rates above the positive (likely false negatives), exactly as sentence-transformers'
        ``GISTEmbedLoss``, for batches of thousands in the memory of one encoder mini-batch. Without a guide
        (``guide=None``) the model guides itself with its own embeddings of the step, at no extra cost.

        The guide embeds each column once per step, mini-batch by mini-batch and without a graph (re-tokenising
        the texts when its tokenizer differs from the model's: then a column with images, videos or audio is
        refused, the decoded text having none of them); it is never replayed nor trained. Its mask is
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
            guide: a SentenceTransformer rating the pairs (any embedding size; cosine similarity), or None
                (default): self-guided, the model rates the pairs with its own embeddings of this step (the
                engine's first pass, detached: no guide model, no extra forward), so the mask follows the
                model as it trains; the same loss as ``GISTEmbedLoss`` with a frozen copy of the model, taken
                at this step, as the guide (on a model without dropout; with dropout, the mask is that of the
                step's own forward); inside ``MatryoshkaLoss`` every width is guided by the full-width
                embeddings, as that frozen copy guides it. The model itself is accepted too (as in sentence-transformers): then it
                embeds the batch once more without a graph, in the mode the model is in (as theirs: no
                ``eval()``).
            temperature: divides the cosine similarities (``scale = 1 / temperature``).
            mini_batch_size: rows per encoder forward (the model's and the guide's), or ``"auto"``.
            mini_batch_num_tokens: a budget of real (non-padding) tokens per mini-batch instead of
                ``mini_batch_size``, as sentence-transformers.
            show_progress_bar: tqdm bars over the mini-batches.
            margin_strategy: ``"absolute"``: remove a negative whose guide similarity exceeds the positive's
                minus ``margin``; ``"relative"``: exceeds the positive's minus ``|positive's| * margin``.
            margin: the margin of that rule (0: remove only negatives rated above the positive). Negative
                margins keep negatives rated a little above the positive: ``margin=-0.1`` (absolute) is
                Qwen3-Embedding's rule, a negative is masked when it scores more than 0.1 above the positive.
            contrast_anchors: also contrast each anchor with this process's other anchors.
            contrast_positives: also contrast each positive with every other positive.
            gather_across_devices: score each process's anchors against every process's positives and
                negatives (the guide's embeddings of them are gathered too).
            learnable_scale: learn the scale as CLIP's ``logit_scale = log(scale)``, clamped at ``max_scale``
                (sentence-transformers' GIST losses have a fixed temperature); give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log it.
            max_scale: the clamp of a learned scale.
            in_batch_negatives: contrast with the other rows' candidates (default); False: each anchor against
                its own positive and its own hard negatives only, those the guide rates above the positive
                removed (GIST's filter of mined hard negatives), across processes too (nothing is gathered).
                ``contrast_anchors`` / ``contrast_positives`` contrast other rows, so they do not apply then.
                Needs hard-negative columns.

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
        self.in_batch_negatives = in_batch_negatives
        self._init_learnable_scale(learnable_scale, max_scale)

    @property
    def guide(self) -> nn.Module | None:
        """The guide model (a registered submodule, as in sentence-transformers), or None: self-guided, the
        model's own first-pass embeddings rate the pairs. Assigning a model checks it as at construction and
        decides again whether it reads the model's token ids or the re-tokenised texts."""
        return self._modules["guide"]

    @guide.setter
    def guide(self, value: nn.Module | None) -> None:
        self._check_guide(value, self.gather_across_devices)
        self._modules["guide"] = value
        self.must_retokenize = value is not None and self._must_retokenize(value)

    @property
    def self_guided(self) -> bool:
        """Whether the model guides itself (``guide=None``): the mask is computed from the embeddings of the
        engine's first pass, the very ones the loss is computed from (detached), with no guide model and no
        extra forward."""
        return self.guide is None

    @staticmethod
    def _check_guide(guide: nn.Module | None, gather: bool) -> None:
        if guide is None:
            return  # self-guided
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
        if value and self._modules.get("guide") is not None:
            self._check_guide(self.guide, True)
        return value

    gather_across_devices = Setting[bool](validate=_check_gathered_guide)
    margin_strategy = Setting[str]()
    margin = Setting[float]()
    contrast_anchors = Setting[bool]()
    contrast_positives = Setting[bool]()
    #: False: each anchor against its own positive and hard negatives only (no in-batch negatives)
    in_batch_negatives = Setting[bool]()

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
        """The guide's embeddings of the batch (no graph), where the model's embeddings are; self-guided,
        nothing: the model's own embeddings are its guide (`_with_embeddings`)."""
        if self.guide is None:
            return StepData()
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
            self.contrast_anchors, self.contrast_positives, n_columns, self.margin_strategy, self.margin,
            self.in_batch_negatives,
        )  # fmt: skip
        return LossTerms(terms, "cosine", guide=Guide(g[0], g[1:]))

    def _check_columns(self, features: list[dict[str, Any]]) -> None:
        super()._check_columns(features)
        if not self.in_batch_negatives:
            check_own_candidates(len(features), type(self).__name__)
        if self.guide is not None and self.must_retokenize:
            media = {k: media_inputs(f) for k, f in enumerate(features) if media_inputs(f)}
            if media:
                raise ValueError(
                    f"CachedGISTLoss: the guide reads another vocabulary (or fewer tokens) than the model, so its "
                    "inputs are re-tokenised from the decoded text, which holds no images, videos or audio; "
                    f"column(s) {sorted(media)} have {sorted({k for keys in media.values() for k in keys})}. "
                    "Use a guide that reads the model's inputs (its processor and max_seq_length), or guide=None "
                    "(the model guides itself)."
                )

    def _with_embeddings(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        """Self-guided: the model's own embeddings of the step, at full width and detached, are the guide's.
        In GradCache's stage 2 they are the first pass's embeddings, which the replay reproduces (its random
        state restored), so the mask is the one of the very forward that is differentiated; taken before
        ``calculate_loss``, so that a wrapper calling it on truncations (MatryoshkaLoss) guides every width
        with them, as ``GISTEmbedLoss`` with a frozen copy of the model as guide does."""
        if self.guide is None and step.guide is None:
            step.guide = [e.detach() for e in embeddings]
        return step

    def _guided_by_itself(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        """Self-guided and called without the step's own embeddings (``calculate_loss`` called directly):
        a copy of the step with the given embeddings, detached, as the guide's."""
        if self.guide is not None or step.guide is not None:
            return step
        return replace(step, guide=[e.detach() for e in embeddings])

    def _loss_stage(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData, with_grad: bool
    ) -> StageOutput:
        return super()._loss_stage(embeddings, labels, self._guided_by_itself(step, embeddings), with_grad)

    def _autograd_loss(self, embeddings: list[Tensor], labels: Tensor | None, step: StepData) -> Tensor:
        return super()._autograd_loss(embeddings, labels, self._guided_by_itself(step, embeddings))

    def _guide_features(self, features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The columns as the guide reads them: re-tokenised from the text when its tokenizer differs."""
        guide = cast(Any, self.guide)
        if self.must_retokenize:
            decode = self._model_tokenizer.batch_decode
            features = [
                guide.preprocess(decode(input_ids_by_row(f), skip_special_tokens=True)) for f in features
            ]
        device = model_device(guide)
        return [{k: v.to(device) if isinstance(v, Tensor) else v for k, v in f.items()} for f in features]
