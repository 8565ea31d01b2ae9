"""The core every cached embedding loss is built on: the model, the GradCache engine and its settings, the
scale, the forward (evaluation without a graph, or the engine's three stages) and the loss stage (one
process, gathered across processes, or by ring exchange, through ``st_cached_losses.functional.parallel``).

What only some losses have is theirs: the learnable scale is the [`LearnableScale`][st_cached_losses.losses._base.LearnableScale] mixin (MNR, CLIP,
tiled, GIST), the terms of sentence-transformers' ranking options live on [`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss], the
regularisers on [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss]. A setting is one constructor parameter and one spec
(``settings.py``), checked on every assignment.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor, nn
from typing_extensions import TypedDict, Unpack

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.engine.caller import user_stacklevel
from st_cached_losses.engine.checks import is_auto
from st_cached_losses.engine.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.functional import Guide, InfoNCEOptions, LossPath, Similarity, infonce, scale_value
from st_cached_losses.functional.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional.infonce import InfoNCEOutput
from st_cached_losses.functional.options import Bank
from st_cached_losses.functional.parallel import (
    agree_on_sizes,
    gathered_infonce,
    loss_and_grad,
    mean_scale_grad,
)
from st_cached_losses.functional.terms import TermSet
from st_cached_losses.losses.callbacks import warn_if_scale_unsaved
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.guards import check_model_kind, foreign_setting_owners
from st_cached_losses.losses.settings import SPECS, Setting, check_max_scale

__all__ = [
    "CachedInfoNCEBase",
    "EngineOptions",
    "EngineSettings",
    "LearnableScale",
    "LossStageOptions",
    "LossTerms",
    "StageOutput",
    "StepData",
    "check_columns",
    "check_splittable_model",
    "engine_signature",
]


@dataclass
class StepData:
    """What one call of a loss hands its loss stage besides the embeddings, built by ``forward`` from the
    features (never kept on the loss): [`CachedInfoNCEBase.calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss] reads it from its ``step``
    argument, so that a wrapper decorating ``calculate_loss`` (MatryoshkaLoss) passes it through."""

    #: per column, the inputs' hashes (``mask_duplicates``)
    keys: list[Tensor] | None = None
    #: per column, the guide's embeddings of the same rows (CachedGISTLoss)
    guide: list[Tensor] | None = None
    #: in GradCache's stage 2, a leaf standing for the learnable scale (its gradient is read off it)
    scale_leaf: Tensor | None = None
    #: the loss's components of the last loss stage on these rows, where it has several (the sparse loss)
    parts: dict[str, Tensor] | None = None
    #: a negative bank's entries this call scores as extra negatives (CachedMNRLoss's ``negative_bank_size``)
    bank: Bank | None = None


@dataclass(frozen=True)
class LossTerms:
    """A loss's part of the core's options ([`InfoNCEOptions`][st_cached_losses.functional.options.InfoNCEOptions]), what
    ``_loss_terms`` returns: which loss the core computes. The core adds the scale
    and the loss stage's plan (``path``, ``tile_size``, ``memory_budget``)."""

    #: the logit terms ([`st_cached_losses.functional.terms`][st_cached_losses.functional.terms])
    terms: TermSet
    #: the core's score of the embeddings
    similarity: Similarity = "cosine"
    #: a guide model's embeddings (GIST's guided terms)
    guide: Guide | None = None
    #: per column, duplicate keys of these rows (``mask_duplicates``): anchors' first
    keys: Sequence[Tensor] | None = None


@dataclass
class StageOutput:
    """What a loss stage returns (``_loss_stage``)."""

    #: 0-d, detached: the loss (the sum of ``parts`` where there are several)
    loss: Tensor
    #: with ``with_grad``, the gradient of the loss wrt each column, in the columns' order
    grads: list[Tensor] | None = None
    #: the learnable scale's gradient (averaged over processes), when it has one
    grad_scale: Tensor | None = None
    #: the tensor scale the gradient is of (stage 2's leaf, or ``logit_scale``'s image)
    scale: Tensor | float | None = None
    #: the loss's components, in the order the loss returns them (None: the loss alone)
    parts: dict[str, Tensor] | None = None


class EngineOptions(TypedDict, total=False):
    """The GradCache engine's knobs: how it runs the encoder's mini-batches, declared here once with their
    documentation and taken by every cached loss as keyword-only arguments (``**engine``). None changes the
    result; a knob left out takes its default (the spec's, ``SPECS``),
    and each is a setting of the loss afterwards, checked on every assignment."""

    sort_by_length: bool
    """Embed each column's rows longest first, so that a mini-batch pads little (default True)."""
    reuse_last_graph: bool
    """Keep the last encoder mini-batch's graph from the first pass instead of replaying it (default True)."""
    keep_params_unsharded: bool
    """Under FSDP2, gather every parameter group once per step and keep it until the last replay: one
    all-gather and one reduce-scatter per group per step, for the memory of the full parameters (default
    False; nothing for other wrappers)."""
    graph_memory_budget: int | str | None
    """Bytes (or a size such as ``"6GB"``) of first-pass encoder graphs to keep instead of replaying their
    mini-batches, the largest first: the same gradients, fewer forwards (default None: replay all but the
    last). ``"auto"``: on CUDA, what the device has free after the step's own needs (``"auto:20GB"``: at most
    20 GB); elsewhere none."""
    mini_batch_memory_budget: int | str | None
    """With ``mini_batch_size="auto"`` (or ``mini_batch_num_tokens="auto"``), the activation memory one
    encoder mini-batch may take, in bytes or a size such as ``"2GB"`` (default None: on CUDA half the free
    memory)."""


class LossStageOptions(EngineOptions, total=False):
    """The engine's knobs ([`EngineOptions`][st_cached_losses.losses._base.EngineOptions]) and the loss stage's plan, for the embedding losses'
    ``**engine``. None changes the result."""

    path: LossPath
    """The loss stage's algorithm: ``"auto"`` (from the batch and ``memory_budget``), ``"chunked"`` (row
    chunks against every column) or ``"tiled"`` (Inf-CL-style tiles; across processes, the ring exchange)."""
    tile_size: int | None
    """Side of a logit tile / rows of a chunk of the loss stage (default None: from ``memory_budget``, at
    most 2048)."""
    memory_budget: int | str
    """Bytes of logit blocks the loss stage may hold at once, or a size such as ``"64MiB"``."""
    matmul_precision: str | None
    """The loss stage's similarity products, with ``torch.set_float32_matmul_precision``'s names:
    ``"highest"`` (fp32, exact), ``"high"`` (TF32 on CUDA), ``"medium"`` (bf16 operands, fp32 sums); default
    None: ``torch.get_float32_matmul_precision()`` at the step. Statistics and gradients stay fp32."""


def engine_signature(init: Callable[..., None]) -> inspect.Signature:
    """``init``'s signature with its ``**engine: Unpack[...]`` written out as the keyword-only knobs of the
    TypedDict, each with its default: what ``inspect.signature`` shows of a loss (the configuration layer
    reads it), as an IDE shows the ``Unpack``."""
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        return signature
    annotation = params[-1].annotation
    if isinstance(annotation, str):  # postponed: "Unpack[LossStageOptions]", named in init's module
        annotation = eval(annotation, init.__globals__)
    (options,) = get_args(annotation)
    knobs = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=SPECS[name].default,
            annotation=getattr(kind, "__forward_arg__", kind),  # as the source writes it
        )
        for name, kind in options.__annotations__.items()
    ]
    return signature.replace(parameters=[*params[:-1], *knobs])


def _forget_auto_size(loss: EngineSettings, old: object, new: object) -> None:
    """A change of the mini-batch sizes forgets what ``"auto"`` chose: sized again at the next step. And
    ``"auto"`` mini-batches without a memory budget are refused when set (not at the first step) where no
    CUDA device gives the budget a default (the setting is then put back)."""
    if new != old:
        loss.cache.auto.forget()
    loss.cache.check_auto_budget()


class EngineSettings:
    """The settings a loss keeps on its GradCache engine (``loss.cache``): the encoder mini-batches (rows, a
    token budget, or ``"auto"`` sized to a memory budget) and how they are run. None changes the result.
    Shared by every cached loss, the reranker loss included; a change of the mini-batch sizes forgets what
    ``"auto"`` chose, so the next step sizes them again."""

    cache: GradCache
    model: nn.Module
    #: the sentence-transformers loss this one equals, named in the model card's tags
    equivalent_st_loss: str
    _tagged: bool = False
    #: the sentence-transformers model class (by name) the loss trains; another kind is refused at construction
    model_kind: ClassVar[str]

    mini_batch_size = Setting[int | str](on_engine=True, after=_forget_auto_size)
    mini_batch_num_tokens = Setting[int | str | None](on_engine=True, after=_forget_auto_size)
    mini_batch_memory_budget = Setting[int | None](on_engine=True, after=_forget_auto_size)
    show_progress_bar = Setting[bool](on_engine=True)
    sort_by_length = Setting[bool](on_engine=True)
    reuse_last_graph = Setting[bool](on_engine=True)
    keep_params_unsharded = Setting[bool](on_engine=True)
    graph_memory_budget = Setting[int | str | None](on_engine=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            init.__signature__ = engine_signature(init)

    def __setattr__(self, name: str, value: Any) -> None:
        # a setting that only another cached loss has would be kept as a plain attribute and ignored: refuse it
        if owners := foreign_setting_owners(self, name, EngineSettings):
            raise ValueError(
                f"{type(self).__name__} has no setting {name!r}: it is a setting of {', '.join(owners)}; build "
                "that loss to use it."
            )
        super().__setattr__(name, value)

    def _init_engine(
        self,
        cache: GradCache,
        show_progress_bar: bool,
        engine: Mapping[str, Any],
        options: type[EngineOptions] = EngineOptions,
    ) -> None:
        """Keep ``cache`` as the loss's engine and set its knobs (``engine``, keys of ``options``; those left
        out take their spec's default), each checked by its spec."""
        unknown = [name for name in engine if name not in options.__annotations__]
        if unknown:  # as Python says it of a keyword the signature lacks
            raise TypeError(
                f"{type(self).__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}"
            )
        self.cache = cache
        self.show_progress_bar = show_progress_bar
        for name in options.__annotations__:
            setattr(self, name, engine.get(name, SPECS[name].default))
        cache = self.cache
        if cache.mini_batch_memory_budget is not None and not is_auto(
            cache.mini_batch_size, cache.mini_batch_num_tokens
        ):
            warnings.warn(
                f"{type(self).__name__}: mini_batch_memory_budget sizes 'auto' mini-batches only, and "
                f"mini_batch_size={cache.mini_batch_size!r} is fixed, so the budget is unused. Set "
                "mini_batch_size='auto' (or mini_batch_num_tokens='auto') to size the mini-batches to it, or "
                "remove mini_batch_memory_budget.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _auto_config(self) -> dict[str, Any]:
        """What the config of an ``"auto"`` loss needs besides its sizes to rebuild it: its
        ``mini_batch_memory_budget`` when set (a setting that never changes the result, otherwise left out of
        the config; an ``"auto"`` loss without it is refused where no CUDA device gives it a default)."""
        budget = self.mini_batch_memory_budget
        if budget is None or not is_auto(self.mini_batch_size, self.mini_batch_num_tokens):
            return {}
        return {"mini_batch_memory_budget": budget}

    def _tag_model_card(self) -> None:
        """Once per loss: tag the model's card with this library and the loss this one equals."""
        card = getattr(unwrap_model(self.model), "model_card_data", None)
        if self._tagged or card is None or not hasattr(card, "add_tags"):
            return
        card.add_tags(["st_cached_losses", f"equivalent-loss:{self.equivalent_st_loss}"])
        self._tagged = True


class CachedInfoNCEBase(EngineSettings, nn.Module):
    """The core of the cached embedding losses ([`CachedMNRLoss`][st_cached_losses.losses.cached_mnr.CachedMNRLoss], [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss],
    [`CachedTiledLoss`][st_cached_losses.losses.cached_tiled.CachedTiledLoss], [`CachedGISTLoss`][st_cached_losses.losses.cached_gist.CachedGISTLoss], [`CachedSparseLoss`][st_cached_losses.losses.cached_sparse.CachedSparseLoss],
    [`CachedMultiVectorLoss`][st_cached_losses.losses.cached_multi_vector.CachedMultiVectorLoss]): the engine, a fixed scale, the forward and the loss stage. A loss
    supplies its terms (`_loss_terms`), its config (``get_config_dict``), its citations, and sets
    ``gather_across_devices`` (the sparse loss keeps it on its base loss).
    """

    #: BibTeX entries of the model card's citation
    _citations: tuple[str, ...] = (GRADCACHE_CITATION,)
    #: The sentence-transformers loss this one equals (the same loss and gradients for the same options),
    #: named in the model card's tags next to ``loss:<our class>``.
    equivalent_st_loss = "CachedMultipleNegativesRankingLoss"
    #: Tells sentence-transformers' MatryoshkaLoss (and AdaptiveLayerLoss) that this loss back-propagates
    #: by replaying the encoder: Matryoshka then decorates [`calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss] instead of the model.
    uses_gradient_cache = True
    #: What the engine caches of a row: its embedding, or (True) its token embeddings and mask, packed
    #: (the multi-vector loss); given to the engine when the loss builds it.
    caches_tokens: bool = False
    model_kind: ClassVar[str] = "SentenceTransformer"

    gather_across_devices = Setting[bool]()
    path = Setting[LossPath]()
    tile_size = Setting[int | None]()
    memory_budget = Setting[int]()
    matmul_precision = Setting[str | None]()

    def __setattr__(self, name: str, value: Any) -> None:
        # a setting (a property or Setting of the class) receives every value assigned to it: nn.Module would
        # file a module value (a similarity module, a guide) under _modules before the setter could check it
        if isinstance(getattr(type(self), name, None), (property, Setting)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        model: nn.Module,
        *,
        scale: float,
        mini_batch_size: int | str,
        mini_batch_num_tokens: int | str | None,
        show_progress_bar: bool,
        **engine: Unpack[LossStageOptions],
    ) -> None:
        super().__init__()
        check_model_kind(model, type(self), EngineSettings)
        check_splittable_model(model, type(self).__name__)
        self.model = model
        cache = GradCache(
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            tokens=self.caches_tokens,
            form=self._cache_form(),
        )
        self._init_engine(cache, show_progress_bar, engine, LossStageOptions)
        self._scale = scale_value(scale)
        self._warned_caching_off = False

    def _cache_form(self) -> CacheForm | None:
        """How the engine keeps the cached embeddings ([`CacheForm`][st_cached_losses.engine.cache_form.CacheForm]),
        given to it when the loss builds it; None: as the encoder outputs them (the sparse loss packs them)."""
        return None

    # ------------------------------------------------------------------ the scale

    def _set_temperature(self, old: float, new: float) -> None:
        if new != old:  # else unchanged: 1 / (1 / s) may round
            self.scale = 1.0 / new

    #: The scale (1 / temperature) the similarities are multiplied by.
    scale = Setting[float]()
    #: ``1 / scale``: a view of ``scale``; setting it sets the scale.
    temperature = Setting[float](view=lambda loss: 1.0 / loss.scale, after=_set_temperature)

    def scale_tensor(self) -> Tensor | float:
        """The scale the loss stage multiplies by: a float, or ([`LearnableScale`][st_cached_losses.losses._base.LearnableScale]) a tensor with its graph."""
        return self.scale

    # ------------------------------------------------------------------ model card

    def _citation_parts(self) -> tuple[str, ...]:
        return self._citations

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        return "".join(self._citation_parts())

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card: its sentence-transformers counterpart's keys, then our
        extras in use (each loss writes its own)."""
        raise NotImplementedError

    def _changed_settings(self) -> dict[str, Any]:
        """The extras of the config ([`LearnableScale`][st_cached_losses.losses._base.LearnableScale] adds the scale's clamp first): each ``"changed"`` setting of this
        loss that differs from its default. A setting assigned after construction to a loss whose constructor
        lacks it is listed too: the config says how the model was
        trained, even where ``type(loss)(model, **config)`` cannot rebuild that loss. And an ``"auto"`` loss's
        memory budget, which rebuilding it needs ([`_auto_config`][st_cached_losses.losses._base.EngineSettings._auto_config])."""
        extras: dict[str, Any] = {}
        for name, spec in SPECS.items():
            if spec.config == "changed" and isinstance(getattr(type(self), name, None), Setting):
                value = getattr(self, name)
                if value != spec.default:
                    extras[name] = value
        return {**extras, **self._auto_config()}

    # ------------------------------------------------------------------ the loss stage

    def _loss_terms(self, step: StepData, n_rows: int, n_columns: int) -> LossTerms:
        """Which loss the core computes ([`LossTerms`][st_cached_losses.losses._base.LossTerms]): the loss's own part of the seam;
        ``n_columns``: candidate columns (positives and hard negatives) of this step."""
        raise NotImplementedError

    def _options(self, step: StepData, n_rows: int, n_columns: int, scale: float | Tensor) -> InfoNCEOptions:
        """The core's options of one call: the loss stage's plan (``path``, ``tile_size``,
        ``memory_budget``), the scale, the loss's terms and the step's negative bank."""
        parts = self._loss_terms(step, n_rows, n_columns)
        keys = parts.keys
        return InfoNCEOptions(
            scale=scale,
            similarity=parts.similarity,
            terms=parts.terms,
            guide=parts.guide,
            path=self.path,
            tile_size=self.tile_size,
            memory_budget=self.memory_budget,
            matmul_precision=self.matmul_precision,  # type: ignore[arg-type]
            anchor_keys=keys[0] if keys is not None else None,
            candidate_keys=keys[1:] if keys is not None else None,
            bank=step.bank,
        )

    def _step_data(self, features: list[dict[str, Any]]) -> StepData:
        """What this call's loss stage needs from the features besides the embeddings (a loss adds its own)."""
        return StepData()

    def _with_embeddings(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        """What this call's loss stage needs from the model's own embeddings of the step, at full width: called
        with them before [`calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss],
        which a wrapper may call on other embeddings (MatryoshkaLoss's truncations). Nothing by default (the
        self-guided GIST loss takes its guide's embeddings here)."""
        return step

    def _agree(self, embeddings: list[Tensor]) -> list[int] | None:
        """Every process's row count when gathering across processes (else None), and the finiteness check,
        agreed on by every process."""
        if self.gather_across_devices and not is_distributed():
            warn_no_process_group_once(type(self).__name__)
        return agree_on_sizes(embeddings, self.gather_across_devices)

    def _ranking(
        self, embeddings: list[Tensor], options: InfoNCEOptions, sizes: list[int] | None, with_grad: bool
    ) -> InfoNCEOutput:
        """The core's loss (and with ``with_grad`` its gradients) of the embeddings, one process, gathered,
        or by ring exchange (``path="tiled"`` across processes)."""
        ring = self.path == "tiled"
        return loss_and_grad(embeddings[0], embeddings[1:], sizes, options, ring=ring, with_grad=with_grad)

    def _loss_stage(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData, with_grad: bool
    ) -> StageOutput:
        """The loss of the embeddings without a graph, and with ``with_grad`` its gradient wrt each column
        (and a learnable scale): the core's InfoNCE of ``_loss_terms`` by default; a loss with more
        parts (the sparse loss's regularisers) overrides it."""
        sizes = self._agree(embeddings)
        scale = self.scale_tensor()
        # the scale whose gradient the core computes: stage 2's leaf, or the scale itself called directly
        if isinstance(scale, Tensor) and step.scale_leaf is not None:
            scale = step.scale_leaf
        out = self._ranking(
            embeddings, self._options(step, len(embeddings[0]), len(embeddings) - 1, scale), sizes, with_grad
        )
        if not with_grad:
            return StageOutput(out.loss)
        assert out.grad_anchors is not None  # asked for
        grad_scale = out.grad_scale
        if grad_scale is not None and sizes is None:
            # each process scored only its own rows, and the scale belongs to the loss, outside any
            # wrapper: average its gradient as DDP / FSDP / DeepSpeed average the model's, or every
            # process would step to another scale (the gathered and ring paths average it themselves)
            grad_scale = mean_scale_grad(grad_scale)
        return StageOutput(out.loss, [out.grad_anchors, *out.grad_candidates], grad_scale, scale)

    def _autograd_loss(self, embeddings: list[Tensor], labels: Tensor | None, step: StepData) -> Tensor:
        """The loss with autograd (a caller asking for a graph, not the cache): the core's InfoNCE, whose
        backward recomputes its tiles; gathered with autograd across processes."""
        sizes = self._agree(embeddings)
        scale = self.scale_tensor()
        options = self._options(step, len(embeddings[0]), len(embeddings) - 1, scale)
        if sizes is None:
            if isinstance(scale, Tensor) and scale.requires_grad and is_distributed():
                # each process's own rows: average the scale's gradient as DDP averages the model's
                scale.register_hook(mean_scale_grad)
            return infonce(embeddings[0], embeddings[1:], options, check_finite=False)
        embeddings = self._gatherable(embeddings)  # (loss_and_grad pads packed rows itself)
        return gathered_infonce(embeddings[0], embeddings[1:], sizes, options)

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: StepData | None = None,
    ) -> Tensor:
        """The loss of already computed embeddings (sentence-transformers' cached-loss interface).

        Args:
            reps: per column (anchors, positives, hard negatives...), a list of ``(m_j, d)`` pieces that
                concatenate to the column's ``(B, d)`` embeddings in row order.
            labels: unused by the InfoNCE losses (the positive of row ``i`` is row ``i`` of the second
                column); passed to a base loss that reads them (the sparse loss's).
            with_backward: also put the gradient of the loss in each piece's ``.grad`` (the pieces must
                be leaves that require grad) and return the loss without a graph to the embeddings. (With
                a learnable scale, the returned loss keeps a graph to the scale that carries exactly the
                scale's gradient: to ``step.scale_leaf`` inside GradCache's stage 2, to ``logit_scale``
                when called directly; a wrapper that weighs and sums several calls, like MatryoshkaLoss,
                thus weighs the scale's gradient too.) Without it the loss is returned with autograd (or
                without a graph under ``torch.no_grad``).
            step: what the call of the loss on these rows' features prepared ([`StepData`][st_cached_losses.losses._base.StepData]); None,
                called directly: no duplicate masks (they need the inputs). The loss's components
                (the sparse loss's) are left in ``step.parts``.

        With ``gather_across_devices``, each process returns its share of the global loss (see
        ``st_cached_losses.functional.parallel``): DDP's gradient average is the full batch's gradient.
        """
        embeddings = [torch.cat(r) if len(r) > 1 else r[0] for r in reps]
        step = step if step is not None else StepData()
        if not with_backward and torch.is_grad_enabled():  # a caller asking for autograd, not the cache
            return self._autograd_loss(embeddings, labels, step)
        out = self._loss_stage(embeddings, labels, step, with_grad=with_backward)
        step.parts = out.parts
        if not with_backward:
            return out.loss
        assert out.grads is not None  # asked for
        for pieces, grad in zip(reps, out.grads):
            for piece, g in zip(pieces, grad.split([p.shape[0] for p in pieces])):
                if g.dim() == 3:  # token rows: the column's width, a mini-batch's own may be narrower
                    g = g[:, : piece.shape[1]]
                g = g.to(piece.dtype)
                piece.grad = g if piece.grad is None else piece.grad + g
        loss = out.loss.detach()
        if out.grad_scale is not None:
            # the value of the loss, with d/d(leaf) = the scale's gradient: a caller's weights reach it
            scale = out.scale
            assert isinstance(scale, Tensor)
            loss = loss + (scale - scale.detach()) * out.grad_scale.detach().to(scale.dtype)
        return loss

    def _gatherable(self, embeddings: list[Tensor]) -> list[Tensor]:
        """The embeddings as every process gathers them with autograd (the multi-vector loss pads token
        rows; the cached path's ``loss_and_grad`` pads packed rows itself)."""
        return embeddings

    def _stage2(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData | None = None
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """GradCache's stage 2 through [`calculate_loss`][st_cached_losses.losses._base.CachedInfoNCEBase.calculate_loss], so that a wrapper that decorates it works."""
        reps = [[e.detach().requires_grad_()] for e in embeddings]
        scale = self.scale_tensor()
        step = self._with_embeddings(step if step is not None else StepData(), embeddings)
        step.scale_leaf = scale.detach().requires_grad_() if isinstance(scale, Tensor) else None
        loss = self.calculate_loss(reps, labels, with_backward=True, step=step)
        scale_grad = None
        if step.scale_leaf is not None and loss.requires_grad:
            # through whatever a wrapper did with the returned losses (e.g. Matryoshka's weights)
            (scale_grad,) = torch.autograd.grad(loss, step.scale_leaf)
        grads = [r[0].grad if r[0].grad is not None else torch.zeros_like(r[0]) for r in reps]
        return loss.detach(), grads, [scale_grad]

    def _warn_if_caching_off(self, features: list[dict[str, Any]]) -> None:
        """Once per loss: a batch that fits in one mini-batch, every column's rows together, saves no memory
        (configured without CachedLossTrainingArguments, which warns at construction, nothing else would
        say so)."""
        if self._warned_caching_off or not self.cache.fits_in_one(features):
            return
        self._warned_caching_off = True
        rows = sum(batch_size_of(f) for f in features)
        tokens = self.mini_batch_num_tokens
        setting = (
            f"mini_batch_size={self.mini_batch_size}" if tokens is None else f"mini_batch_num_tokens={tokens}"
        )
        warnings.warn(
            f"{type(self).__name__}: the whole batch ({len(features)} columns, {rows} rows together) fits in one "
            f"encoder mini-batch ({setting}), so caching saves no memory: the non-cached loss holds no more than "
            "that one mini-batch, with the same result. Use a mini-batch smaller than the batch to save memory.",
            stacklevel=user_stacklevel(),  # past forward, torch and the trainer: the line that calls train()
        )

    # ------------------------------------------------------------------ forward: the template

    def _columns(self, features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The columns as the engine embeds them (the multi-vector loss stamps each column's task)."""
        return features

    def _check_columns(self, features: list[dict[str, Any]]) -> None:
        """Refuse a batch the loss cannot take ([`check_columns`][st_cached_losses.losses._base.check_columns]), before any forward."""
        check_columns(features, type(self).__name__)

    def _before_training_step(self) -> None:
        """Called by ``forward`` before a step with gradients (the learnable scale warns if unsaved)."""

    def _returned(self, loss: Tensor, step: StepData, *, training: bool) -> Tensor | dict[str, Tensor]:
        """What ``forward`` returns: the loss; a loss whose stage leaves components in ``step.parts``
        returns them instead (the sparse loss's dict, as sentence-transformers' ``SpladeLoss``)."""
        return loss

    def forward(
        self, sentence_features: Iterable[dict[str, Any]], labels: Tensor | None = None
    ) -> Tensor | dict[str, Tensor]:
        features = self._columns(list(sentence_features))
        self._tag_model_card()
        try:
            self._check_columns(features)
        except ValueError as exc:  # the other processes are about to wait for this one: tell them
            self.cache.raise_on_every_process(self.model, exc)
        if torch.is_grad_enabled():
            self._before_training_step()
        step = self._step_data(features)
        if not torch.is_grad_enabled():
            # evaluation: the same loss, mini-batched, no caching and no graph
            embeddings = self.cache.embed(self.model, features)
            step = self._with_embeddings(step, embeddings)
            loss = self.calculate_loss([[e] for e in embeddings], labels, step=step)
            return self._returned(loss, step, training=False)
        self._warn_if_caching_off(features)
        scale = self.scale_tensor()
        extra = [scale] if isinstance(scale, Tensor) else []
        loss = self.cache.step(self.model, features, lambda e: self._stage2(e, labels, step), extra=extra)
        return self._returned(loss, step, training=True)


def check_splittable_model(model: nn.Module, owner: str) -> None:
    """Refuse a StaticEmbedding model: its inputs (flat token ids with offsets) have no batch dimension
    to cut into mini-batches."""
    if model is None:  # a loss built without a model (their tests' model=None) scores given embeddings only
        return
    try:
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    except ImportError:  # pragma: no cover - layout of other versions
        return
    if any(isinstance(m, StaticEmbedding) for m in unwrap_model(model).modules()):
        raise ValueError(
            f"{owner} is not compatible with a SentenceTransformer model based on a StaticEmbedding: its inputs "
            "(flat token ids with offsets, no batch dimension) cannot be split into mini-batches. Use "
            "sentence-transformers' MultipleNegativesRankingLoss, which is cheap for such models."
        )


def check_columns(sentence_features: Sequence[dict[str, Any]], owner: str) -> None:
    """At least (anchor, positive), every column splittable, and the same number of rows in each."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{owner} needs at least two text columns, (anchor, positive[, negatives...]); got "
            f"{len(sentence_features)}. Check the dataset's columns (a 'label'/'score' column is not a text column)."
        )
    sizes = []
    for features in sentence_features:
        check_splittable(features)
        sizes.append(batch_size_of(features))
    if len(set(sizes)) > 1:
        raise ValueError(
            f"all columns must have the same number of rows, got {sizes}: every anchor needs one positive (and "
            "one row in each hard-negative column)."
        )
    if sizes[0] == 0:
        raise ValueError(
            f"{owner} got an empty batch: column 0 (the anchors) of this batch has 0 rows (rows per column: "
            f"{sizes}). Every step needs at least one (anchor, positive) pair on every process; check the "
            "sampler or the dataset split that produced this batch (e.g. drop_last, or fewer rows than processes)."
        )


class LearnableScale(CachedInfoNCEBase):
    """The scale learned as CLIP's ``logit_scale = log(scale)`` parameter, clamped at ``max_scale``, for the
    losses that offer it (``learnable_scale`` in their constructor): MNR, CLIP, tiled and GIST."""

    logit_scale: nn.Parameter

    def _init_learnable_scale(self, learnable_scale: bool, max_scale: float) -> None:
        self.max_scale = max_scale
        self.learnable_scale = learnable_scale

    def _current_scale(self) -> float:
        if self.learnable_scale:
            return float(self.logit_scale.detach().exp().clamp(max=self.max_scale))
        return self._scale

    def _check_scale(self, value: float) -> float:
        if self.learnable_scale and value != self.scale and value > self.max_scale:
            raise ValueError(
                f"scale must be <= max_scale={self.max_scale!r} with learnable_scale, got {value!r}."
            )
        return value

    def _set_scale(self, old: float, new: float) -> None:
        if new == old:
            return  # a learnable scale is not rewritten through log(exp(x)), which may round
        if self.learnable_scale:
            with torch.no_grad():
                self.logit_scale.fill_(math.log(new))
        self._scale = new

    #: The current scale (1 / temperature), as a float; the learned value when learnable (a view of
    #: ``logit_scale`` then, which an assignment sets).
    scale = Setting[float](view=_current_scale, validate=_check_scale, after=_set_scale)

    def _learnable_changed(self, old: object, new: bool) -> None:
        if new == old:
            return
        if new:
            check_max_scale(self.max_scale, self._scale)
            # CLIP's parametrisation: the log of the scale is learned, the scale is clamped at max_scale
            self.logit_scale = nn.Parameter(torch.tensor(math.log(self._scale), dtype=torch.float32))
        elif old:
            self._scale = float(self.logit_scale.detach().exp().clamp(max=self.max_scale))
            del self.logit_scale

    def _check_max_scale(self, value: float) -> float:
        if self.learnable_scale:
            check_max_scale(value, self.scale)
        return value

    #: Whether the scale is learned, as CLIP's ``logit_scale = log(scale)`` parameter, clamped at
    #: ``max_scale``. Turning it on after the optimizer was built leaves the new parameter out of it.
    learnable_scale = Setting[bool](after=_learnable_changed)
    max_scale = Setting[float](validate=_check_max_scale)

    def _changed_settings(self) -> dict[str, Any]:
        learned = {"learnable_scale": True, "max_scale": self.max_scale} if self.learnable_scale else {}
        return {**learned, **super()._changed_settings()}

    def _before_training_step(self) -> None:
        if self.learnable_scale:
            # the stock trainer saves only the model: say so once if no LossStateCallback saves the scale
            warn_if_scale_unsaved(self)

    def scale_tensor(self) -> Tensor | float:
        """The scale with its graph to ``logit_scale`` when learnable, else the float.

        A learnable scale is kept at most ``max_scale`` by clamping the parameter itself (as CLIP does
        after each optimizer step), not its image: a clamp inside the graph would have no gradient above
        the limit, so a scale that one step carried past it could never come back.
        """
        if self.learnable_scale:
            with torch.no_grad():
                self.logit_scale.clamp_(max=math.log(self.max_scale))
            return self.logit_scale.float().exp()
        return self._scale
