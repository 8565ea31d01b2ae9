"""The template every cached loss is: [`CachedLoss`][st_cached_losses.losses.base.CachedLoss] runs GradCache's
stage 1 (embed without a graph), calls one [`Stage`][st_cached_losses.losses.base.Stage] object for the loss and
its gradients with respect to the cached rows (stage 2), and replays the encoder with them (stage 3); it also
writes ``forward``, evaluation, ``calculate_loss`` (sentence-transformers' cached-loss interface, which
``MatryoshkaLoss`` decorates), ``compute_loss_from_embeddings`` and the model card's parts. It knows no loss: a
loss is its settings (one frozen object, [`settings`][st_cached_losses.losses.settings]), the stage it builds
from them (``build_stage``) and its names.

A stage is a small object (``st_cached_losses.losses.stages``): InfoNCE, distillation, a weighted sum of
stages, the sparse loss's base loss and regularisers, the reranker's scores. A stage may depend on tensors with
a graph to the loss's own parameters (a learnable scale): the loss hands them over in ``step.inputs``
([`stage_inputs`][st_cached_losses.losses.base.CachedLoss.stage_inputs]) and the stage returns their gradients,
which reach the parameters through the engine.

Adding a loss: a settings class, a stage (an existing one, or a new one in the loss's file), the class with its
name, registered when defined; ``docs/development.md`` walks through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.engine.checks import warn_caching_off
from st_cached_losses.engine.features import batch_size_of, check_splittable, unwrap_model
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.engine.lists import ListColumns, list_columns
from st_cached_losses.functional.distributed import is_distributed, warn_no_process_group_once
from st_cached_losses.functional.placement import agree_on_sizes_and_tag
from st_cached_losses.losses import registry
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.guards import check_model_kind
from st_cached_losses.losses.registry import Variant
from st_cached_losses.losses.settings import (
    DEFAULT_PLAN,
    PLAN_FIELDS,
    EngineSettings,
    LossStageSettings,
    Plan,
    Settings,
)

__all__ = [
    "PLAN_FIELDS",
    "CachedLoss",
    "SettingAttribute",
    "Stage",
    "StageInput",
    "StageOutput",
    "StepData",
    "check_columns",
    "check_plan_reaches",
    "check_splittable_model",
    "engine_signature",
]


@dataclass
class StepData:
    """What one call of a loss hands its stage besides the rows, built by ``forward`` (the stage's
    ``prepare``) from the features; never kept on the loss, so that a wrapper decorating
    ``calculate_loss`` (MatryoshkaLoss) passes it through."""

    #: tensors the loss depends on besides the rows, with a graph to the loss's own parameters (a learnable
    #: scale's ``exp(logit_scale)`` as ``"scale"``), by name; their gradients come back from the stage
    inputs: dict[str, Tensor] = field(default_factory=dict)
    #: per column, the inputs' hashes (``mask_duplicates``)
    keys: list[Tensor] | None = None
    #: per column, a guide model's embeddings of the same rows (``CachedGISTLoss``)
    guide: list[Tensor] | None = None
    #: per column, a live teacher's embeddings of the same rows (``CachedEmbedDistillLoss``)
    teacher: list[Tensor] | None = None
    #: the queries of the step (the reranker's rows are its pairs)
    queries: int | None = None
    #: the loss's components of the last stage call, where it has several (the sparse loss)
    parts: dict[str, Tensor] | None = None
    #: per column the engine embedded, its per-row text counts ``(B,)`` where it is list-valued (None for a
    #: column of one text per row); None: no column is ([`lists`][st_cached_losses.engine.lists])
    counts: list[Tensor | None] | None = None
    #: with ``counts``, each embedded column's index among the batch's columns, and how many it has (a list
    #: column without a text in any row is not embedded)
    kept: list[int] | None = None
    given: int = 0
    #: per column, what ``calculate_loss``'s rows leave out and the stage needs (the cache form's ``expose``:
    #: a multi-vector column's mask, its rows the token embeddings alone, which a wrapper may truncate)
    aside: list[Tensor | None] | None = None


@dataclass
class StageOutput:
    """What a stage returns."""

    #: 0-d, detached: the loss (the sum of ``parts`` where there are several)
    loss: Tensor
    #: with ``with_grad``, the gradient of the loss wrt each column, in the columns' order and form
    grads: list[Tensor] | None = None
    #: with ``with_grad``, the gradients wrt ``step.inputs`` the loss depends on, by name
    input_grads: dict[str, Tensor] = field(default_factory=dict)
    #: the loss's components, in the order the loss returns them (None: the loss alone)
    parts: dict[str, Tensor] | None = None


@dataclass
class StageInput:
    """One call of a stage: the cached rows of every column, the labels and the step's data; every process's
    row count is agreed on once per call ([`sizes`][st_cached_losses.losses.base.StageInput.sizes]), however
    many stages read it (a weighted sum)."""

    embeddings: list[Tensor]
    labels: Tensor | None
    step: StepData
    owner: str = "the loss"
    _sizes: dict[bool, tuple[list[int] | None, int]] = field(default_factory=dict, repr=False)

    def sizes(self, gather: bool, tag: int = 0) -> list[int] | None:
        """Every process's row count when ``gather`` across processes (else None), and the finiteness check of
        the rows, agreed on by every process (one small collective, once per call); ``tag``: bits of this
        process's batch every process learns in it, OR-ed ([`tag`][st_cached_losses.losses.base.StageInput.tag])."""
        if gather not in self._sizes:
            if gather and not is_distributed():
                warn_no_process_group_once(self.owner)
            self._sizes[gather] = agree_on_sizes_and_tag(self.embeddings, gather, tag)
        return self._sizes[gather][0]

    def tag(self, gather: bool) -> int:
        """The ``tag`` bits of every process OR-ed, as agreed by [`sizes`][st_cached_losses.losses.base.StageInput.sizes]
        (this process's own on one process)."""
        return self._sizes[gather][1] if gather in self._sizes else 0


class Stage:
    """A loss stage: the loss of a step's cached rows and its gradients with respect to them (and to
    ``step.inputs``), computed without a graph to the encoder. Subclasses write ``__call__``; the others have
    defaults.

    Attributes:
        owner: the loss's class name, for messages.
        min_columns: the columns a batch needs at least (checked before any forward).
        form: the engine's cache form the stage reads (None: as the model outputs the rows).
        plan: the loss stage's plan, handed whole from the loss's settings (``settings.plan()``).
        plan_fields: the plan's fields the stage uses.
    """

    owner: str = "the loss"
    min_columns: int = 2
    form: CacheForm | None = None
    #: the loss stage's plan the stage was handed (a stage that uses any of it has a ``plan`` field)
    plan: Plan = DEFAULT_PLAN
    #: the plan's fields the stage uses ([`Plan`][st_cached_losses.losses.settings.Plan]): a loss refuses one
    #: set off its default that its stage does not use
    plan_fields: ClassVar[frozenset[str]] = frozenset()

    def honoured_plan(self) -> frozenset[str]:
        """The plan's fields this stage uses (a weighted sum: those of any of its stages)."""
        return self.plan_fields

    def plans(self) -> list[Plan]:
        """The plans this stage (and each stage it holds) was handed, where it uses any of it."""
        return [self.plan] if self.plan_fields else []

    def check(self, features: Sequence[Any]) -> None:
        """Refuse a batch the stage cannot take, before any forward (every process raises)."""
        check_columns(features, self.owner, self.min_columns, self.columns_message)

    def columns_message(self, n: int) -> str | None:
        """The message refusing ``n`` columns below ``min_columns`` (None: the generic one)."""
        return None

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        """What the step needs from the features besides the rows (duplicate keys, a guide's embeddings);
        ``inputs``: what the loss was called with."""
        return StepData()

    def with_embeddings(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        """What the step needs from the model's own rows of the step, at full width: called with them before
        ``calculate_loss``, which a wrapper may call on other rows (MatryoshkaLoss's truncations). Nothing by
        default (a self-guided GIST stage takes them as its guide's embeddings here)."""
        return step

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        """The loss of ``batch`` without a graph and, with ``with_grad``, its gradients."""
        raise NotImplementedError

    def autograd(self, batch: StageInput) -> Tensor:
        """The loss with autograd to the rows that require grad (and to ``step.inputs``): its value, with the
        computed gradients as its graph (``(e - e)`` is exactly 0)."""
        with_grad = any(e.requires_grad for e in batch.embeddings) or any(
            t.requires_grad for t in batch.step.inputs.values()
        )
        out = self(batch, with_grad=with_grad)
        batch.step.parts = out.parts
        loss = out.loss
        if out.grads is not None:
            loss = loss + sum(
                ((e - e.detach()) * g.to(e.dtype)).sum() for e, g in zip(batch.embeddings, out.grads)
            )
        for name, g in out.input_grads.items():
            t = batch.step.inputs[name]
            loss = loss + ((t - t.detach()) * g.detach().to(t.dtype)).sum()
        return loss


class SettingAttribute:
    """A setting of a loss as its attribute: read from the loss's settings object (a view of a learned value,
    ``temperature`` of a learned scale, from the learned value), assigned by building a new one
    (``loss.update_settings``), checked as a whole."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = (
            f"The setting ``{name}`` (see the loss's settings class); assigning it replaces the settings."
        )

    def __repr__(self) -> str:
        return f"SettingAttribute({self.name!r})"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.name in obj.learned_settings and obj.learned():  # a learned value, or a view of one
            return getattr(obj.current_settings(), self.name)
        return getattr(obj.settings, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.update_settings(**{self.name: value})


def engine_signature(init: Any, settings_class: type[Settings]) -> inspect.Signature:
    """``init``'s signature with its ``**engine`` written out as the keyword-only knobs of the engine and of
    the loss stage that ``settings_class`` has (and ``init`` does not take by name), each with its default:
    what ``inspect.signature`` shows of a loss, as the knobs' one declaration says them."""
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        return signature
    taken = {p.name for p in params} | settings_class.not_arguments
    knobs = {f.name for f in fields(LossStageSettings)} - {
        "mini_batch_size",
        "mini_batch_num_tokens",
        "show_progress_bar",
    }
    added = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(settings_class)
        if f.name in knobs and f.name not in taken
    ]
    return signature.replace(parameters=[*params[:-1], *added])


class CachedLoss(nn.Module):
    """The template of every cached loss (see the module's notes). A loss declares:

    Attributes:
        name: the name ``loss:`` takes (registered when the class is defined); ``aliases`` and ``st_names``
            (sentence-transformers' class names it replaces) name it too, ``variants`` name it with a base loss.
        settings_class: its settings (a frozen [`Settings`][st_cached_losses.losses.settings.Settings]); each
            setting is an attribute of the loss.
        model_kind: the sentence-transformers model class (by name) it trains.
        equivalent_st_loss: the sentence-transformers loss it equals (the model card's tags; None: none).
        citations: BibTeX entries of the model card (its settings add those of the options in use).
        engine_output: the model's output the engine caches (``"sentence_embedding"``, or a reranker's
            ``"scores"``).

    and writes ``__init__`` (sentence-transformers' signature, ``super().__init__(model, settings)``) and
    [`build_stage`][st_cached_losses.losses.base.CachedLoss.build_stage].
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    st_names: ClassVar[tuple[str, ...]] = ()
    variants: ClassVar[tuple[Variant, ...]] = ()
    settings_class: ClassVar[type[EngineSettings]]
    model_kind: ClassVar[str] = "SentenceTransformer"
    equivalent_st_loss: ClassVar[str | None] = "CachedMultipleNegativesRankingLoss"
    citations: ClassVar[tuple[str, ...]] = (GRADCACHE_CITATION,)
    engine_output: ClassVar[str] = "sentence_embedding"
    #: a distillation loss: teacher scores in the labels (the arguments check a dataset's label column)
    distillation: ClassVar[bool] = False
    #: refuse any model that is not a ``model_kind`` (a user's own module too)
    strict_model_kind: ClassVar[bool] = False
    #: the settings whose attribute reads a learned value while the loss learns it (``learned``)
    learned_settings: ClassVar[frozenset[str]] = frozenset()
    #: Tells sentence-transformers' MatryoshkaLoss (and AdaptiveLayerLoss) that this loss back-propagates by
    #: replaying the encoder: Matryoshka then decorates ``calculate_loss`` instead of the model.
    uses_gradient_cache = True

    cache: GradCache
    stage: Stage
    model: nn.Module

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        settings_class = cls.__dict__.get("settings_class")
        if settings_class is not None:
            for name in settings_class.names():
                if not hasattr(cls, name):
                    setattr(cls, name, SettingAttribute(name))
        init = cls.__dict__.get("__init__")
        if init is not None and getattr(cls, "settings_class", None) is not None:
            init.__signature__ = engine_signature(init, cls.settings_class)
        if "name" in cls.__dict__:
            registry.register(cls)

    def __init__(self, model: nn.Module, settings: EngineSettings | None = None) -> None:
        super().__init__()
        check_model_kind(model, type(self), strict=self.strict_model_kind)
        if self.engine_output == "sentence_embedding":
            check_splittable_model(model, type(self).__name__)
        self.model = model
        self._tagged = False
        self._warned_caching_off = False
        self._use(settings if settings is not None else self.settings_class(), None)

    def __setattr__(self, name: str, value: Any) -> None:
        declared = getattr(type(self), name, None)
        # a setting (a data descriptor of the class) receives every value assigned to it: nn.Module would file
        # a module value (a similarity module, a guide) under _modules before the setting could check it
        if hasattr(declared, "__set__"):
            object.__setattr__(self, name, value)
            return
        # a setting that only another cached loss has would be kept as a plain attribute and ignored
        if declared is None and not name.startswith("_") and name not in self.__dict__:
            owners = registry.setting_owners(name)
            if owners:
                raise ValueError(
                    f"{type(self).__name__} has no setting {name!r}: it is a setting of {', '.join(owners)}; "
                    "build that loss to use it."
                )
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ settings

    @property
    def settings(self) -> Any:
        """The loss's settings (frozen; an instance of ``settings_class``), as given: assign a setting, or call
        ``update_settings``, to change them. A learned value (a learnable scale) is the loss's state, not a
        setting: the settings keep its initial value, the loss's attribute (``loss.scale``) reads the learned
        one ([`learned`][st_cached_losses.losses.base.CachedLoss.learned])."""
        return self.__dict__["_settings"]

    def learned(self) -> dict[str, Any]:
        """The values the loss learned, by the name of the setting that gave their initial value (none by
        default; a learnable scale's ``"scale"``, SigLIP's ``"bias"`` too)."""
        return {}

    def current_settings(self) -> Any:
        """The settings with the learned values in them: what the model card's config writes, from which the
        loss is rebuilt as it is now."""
        settings = self.settings
        learned = {k: v for k, v in self.learned().items() if getattr(settings, k) != v}
        return settings.replace(**learned) if learned else settings

    def update_settings(self, **changes: Any) -> None:
        """Replace several settings at once: one new settings object, checked as a whole (a combination whose
        settings are only valid together, e.g. from ``"auto"`` mini-batches to fixed ones with no budget)."""
        old = self.current_settings()  # checked with what the loss learned: a clamp below a learned scale
        new = old.replace(**changes)
        if new != old:
            self._use(new, old)

    def _use(self, new: EngineSettings, old: EngineSettings | None) -> None:
        self.__dict__["_settings"] = new
        try:
            self._settings_changed(old, new)
        except BaseException:
            if old is not None:
                self.__dict__["_settings"] = old
                self._settings_changed(new, old)
            raise

    def _settings_changed(self, old: EngineSettings | None, new: EngineSettings) -> None:
        """Make the loss follow its new settings: register their modules, build the stage and the engine (a
        change of the engine's settings is a new engine, which keeps the run state; a change of the
        mini-batch sizes forgets what ``"auto"`` chose). A loss with state of its own derived from the
        settings (a learnable scale's parameter, the negative bank) extends it."""
        for f in fields(new):
            if f.metadata.get("module"):
                value = getattr(new, f.name)
                if isinstance(value, nn.Module) or f.name in self._modules:
                    self._modules[f.name] = value
        stage = self.build_stage()
        check_plan_reaches(stage, new, type(self).__name__)
        engine = new.engine()
        form = stage.form
        cache = self.__dict__.get("cache")
        if cache is None:
            self.cache = GradCache(**engine, output=self.engine_output, form=form or CacheForm())
        else:
            changed = {k: v for k, v in engine.items() if getattr(cache, k) != v}
            if form is not None and form is not cache.form:
                changed["form"] = form
            if changed:
                self.cache = replace(cache, **changed)
            sizes = ("mini_batch_size", "mini_batch_num_tokens", "mini_batch_memory_budget")
            if old is not None and any(getattr(old, n) != getattr(new, n) for n in sizes):
                self.cache.auto.forget()
        self.stage = stage

    def build_stage(self) -> Stage:
        """The loss's stage, built from ``self.settings`` (again whenever they change)."""
        raise NotImplementedError

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """Tensors the stage depends on besides the rows, with a graph to the loss's own parameters, by name
        (none by default; a learnable scale's ``"scale"``); ``training``: for a training step's forward."""
        return {}

    # ------------------------------------------------------------------ model card

    @property
    def citation(self) -> str:
        """BibTeX for the model card."""
        return "".join(self.citations + self.settings.citations())

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings for the model card: sentence-transformers' keys, then our extras that differ
        from their defaults, in forms the constructor takes back (``type(loss)(model, **config)`` rebuilds
        it), with what it learned (a learned scale as its ``scale``)."""
        return self.current_settings().config()

    def _tag_model_card(self) -> None:
        """Once per loss: tag the model's card with this library and the loss this one equals."""
        card = getattr(unwrap_model(self.model), "model_card_data", None)
        if self._tagged or card is None or not hasattr(card, "add_tags"):
            return
        # None: sentence-transformers has no such loss (the sigmoid loss)
        equivalent = self.equivalent_st_loss
        card.add_tags(["st_cached_losses"] + ([f"equivalent-loss:{equivalent}"] if equivalent else []))
        self._tagged = True

    # ------------------------------------------------------------------ the template

    def engine_columns(self, inputs: Iterable[Any], **call: Any) -> list[Any]:
        """The columns the engine embeds from what the loss was called with (the features, as given)."""
        return list(inputs)

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Refuse a batch with list-valued columns (or ``None`` values) the loss cannot take, before any forward
        (instead of the stage's check of fixed columns). By default every loss refuses them."""
        raise ValueError(
            f"{type(self).__name__} takes columns of one text per row: column(s) {lists.kept} (or a column left "
            "out) hold lists of texts or None values. Lists of hard negatives are taken by CachedMNRLoss, "
            "CachedCLIPLoss, CachedTiledLoss, CachedGISTLoss, CachedSparseLoss (with "
            "SparseMultipleNegativesRankingLoss), CachedSigLIPLoss and CachedMultiVectorLoss; otherwise give one "
            "text per row in every column."
        )

    def forward(self, inputs: Iterable[Any], labels: Tensor | None = None, **call: Any) -> Any:
        """The loss of one batch: ``inputs`` are the columns' features (the reranker's: text columns; ``call``
        its ``prompt`` / ``task``). With gradients enabled, the returned loss's backward replays the
        encoder; without, the same loss, mini-batched, no caching and no graph. A loss whose stage has several
        components returns them as a dict (sentence-transformers' ``SpladeLoss``)."""
        inputs = list(inputs)
        self._tag_model_card()
        try:
            lists = list_columns(inputs)  # list-valued columns: their existing texts, and per-row counts
            features = self.engine_columns(lists.columns, **call)
            if lists.listed:
                self.check_lists(features, lists)
            else:
                self.stage.check(features)
        except ValueError as exc:  # the other processes are about to wait for this one: tell them
            self.cache.raise_on_every_process(self.model, exc)
        step = self.stage.prepare(self, features, inputs)
        if lists.listed:
            step.counts, step.kept, step.given = lists.counts, lists.kept, lists.given
        step.inputs = self.stage_inputs(training=torch.is_grad_enabled())
        if not torch.is_grad_enabled():
            embeddings = self.cache.embed(self.model, features)
            step = self.stage.with_embeddings(step, embeddings)
            exposed = self._expose(embeddings, step)
            loss = self.calculate_loss([[e] for e in exposed], labels, step=step)
            return self._returned(loss, step, training=False)
        self._warn_if_caching_off(features)
        extra = list(step.inputs.values())
        loss = self.cache.step(self.model, features, lambda e: self._stage2(e, labels, step), extra=extra)
        return self._returned(loss, step, training=True)

    def calculate_loss(
        self,
        reps: list[list[Tensor]],
        labels: Tensor | None = None,
        *,
        with_backward: bool = False,
        step: StepData | None = None,
    ) -> Tensor:
        """The loss of already computed rows (sentence-transformers' cached-loss interface).

        Args:
            reps: per column (anchors, positives, hard negatives...), a list of ``(m_j, ...)`` pieces that
                concatenate to the column's rows in order.
            labels: the batch's labels (a distillation loss's teacher scores), or None.
            with_backward: also put the gradient of the loss in each piece's ``.grad`` (the pieces must be
                leaves that require grad) and return the loss without a graph to the rows. (With
                ``step.inputs``, a learnable scale, the returned loss keeps a graph to them that carries
                exactly their gradient: a wrapper that weighs and sums several calls, like MatryoshkaLoss,
                thus weighs theirs too.) Without it the loss is returned with autograd (or without a graph
                under ``torch.no_grad``).
            step: what the call of the loss on these rows' features prepared ([`StepData`][st_cached_losses.losses.base.StepData]);
                None, called directly: no duplicate masks (they need the inputs). The loss's components (the
                sparse loss's) are left in ``step.parts``.

        With ``gather_across_devices``, each process returns its share of the global loss: DDP's gradient
        average is the full batch's gradient.
        """
        embeddings = [torch.cat(r) if len(r) > 1 else r[0] for r in reps]
        if step is None:
            step = StepData(inputs=self.stage_inputs())
        form = self.cache.form
        aside = step.aside if step.aside is not None else [None] * len(embeddings)
        embeddings = [form.restore(e, a) for e, a in zip(embeddings, aside)]
        batch = StageInput(embeddings, labels, step, type(self).__name__)
        if not with_backward and torch.is_grad_enabled():  # a caller asking for autograd, not the cache
            return self.stage.autograd(batch)
        out = self.stage(batch, with_grad=with_backward)
        step.parts = out.parts
        if not with_backward:
            return out.loss
        assert out.grads is not None  # asked for
        for pieces, grad, a in zip(reps, out.grads, aside):
            grad = form.exposed_grad(grad, a)
            for piece, g in zip(pieces, grad.split([p.shape[0] for p in pieces])):
                g = form.expand(g, piece).to(piece.dtype)
                piece.grad = g if piece.grad is None else piece.grad + g
        loss = out.loss.detach()
        for name, g in out.input_grads.items():
            # the value of the loss, with d/d(input) = the input's gradient: a caller's weights reach it
            t = step.inputs[name]
            loss = loss + ((t - t.detach()) * g.detach().to(t.dtype)).sum()
        return loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """sentence-transformers' interface: the loss of already computed rows (one tensor per column), with
        autograd to those that require grad."""
        return self.calculate_loss([[e] for e in embeddings], labels)

    def _stage2(
        self, embeddings: list[Tensor], labels: Tensor | None, step: StepData
    ) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
        """GradCache's stage 2 through ``calculate_loss``, so that a wrapper that decorates it works: the loss,
        its gradient wrt each column, and wrt each of ``step.inputs``."""
        step = self.stage.with_embeddings(step, embeddings)
        reps = [[e.detach().requires_grad_()] for e in self._expose(embeddings, step)]
        loss = self.calculate_loss(reps, labels, with_backward=True, step=step)
        inputs = list(step.inputs.values())
        input_grads: list[Tensor | None] = [None] * len(inputs)
        if inputs and loss.requires_grad:
            # through whatever a wrapper did with the returned losses (e.g. Matryoshka's weights)
            input_grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
        form, aside = self.cache.form, step.aside or [None] * len(reps)
        grads = [
            form.rows_grad(r[0].grad if r[0].grad is not None else torch.zeros_like(r[0]), a)
            for r, a in zip(reps, aside)
        ]
        return loss.detach(), grads, input_grads

    def _expose(self, embeddings: list[Tensor], step: StepData) -> list[Tensor]:
        """The columns' rows as ``calculate_loss`` takes them (the cache form's ``expose``), what each leaves
        out put aside in ``step``."""
        exposed = [self.cache.form.expose(e) for e in embeddings]
        step.aside = [a for _, a in exposed]
        return [x for x, _ in exposed]

    def _returned(self, loss: Tensor, step: StepData, *, training: bool) -> Tensor | dict[str, Tensor]:
        """What ``forward`` returns: the loss, or the stage's components (``step.parts``) as a dict: in
        training the first carries the graph (the total minus the others), the others are values for the
        logs, as sentence-transformers' ``SpladeLoss`` returns them."""
        if step.parts is None:
            return loss
        if not training:
            return step.parts
        values = {k: v.detach().float().to(loss.device) for k, v in step.parts.items()}
        first = next(iter(values))
        others = sum((v for k, v in values.items() if k != first), start=torch.zeros_like(loss))
        return {k: (loss - others if k == first else v) for k, v in values.items()}

    @classmethod
    def non_cached_equivalent(cls, settings: Settings) -> str | None:
        """sentence-transformers' non-cached loss (its class name) that gives the result of a loss of this
        class with ``settings`` on a batch that fits in one encoder mini-batch; None where none does: theirs
        lacks a setting in use ([`beyond_sentence_transformers`][st_cached_losses.losses.settings.Settings.beyond_sentence_transformers]:
        a learnable scale, a negative bank, ...), or they have no such loss (``equivalent_st_loss`` None: the
        sigmoid loss). The caching-off warning names it, and is not given without one."""
        equivalent = cls.equivalent_st_loss
        if equivalent is None or settings.beyond_sentence_transformers():
            return None
        return equivalent.removeprefix("Cached")

    def _warn_if_caching_off(self, features: list[Any]) -> None:
        """Once per loss: a batch that fits in one mini-batch, every column's rows together, saves no memory
        (configured without the arguments, which warn at construction, nothing else would say so), and
        sentence-transformers' non-cached loss would give the same result; not said where none would
        ([`non_cached_equivalent`][st_cached_losses.losses.base.CachedLoss.non_cached_equivalent])."""
        if self._warned_caching_off or not self.cache.fits_in_one(features):
            return
        # its flags only: the settings as set (a learned scale's value is not needed)
        non_cached = self.non_cached_equivalent(self.settings)
        if non_cached is None:
            return
        self._warned_caching_off = True
        rows = sum(batch_size_of(f) for f in features)
        tokens = self.cache.mini_batch_num_tokens
        setting = (
            f"mini_batch_size={self.cache.mini_batch_size}"
            if tokens is None
            else f"mini_batch_num_tokens={tokens}"
        )
        # pointing past forward, torch and the trainer: at the line that calls train()
        warn_caching_off(
            f"{type(self).__name__}: the whole batch ({len(features)} columns, {rows} rows together)",
            setting,
            non_cached,
        )


def check_plan_reaches(stage: Stage, settings: Settings, owner: str) -> None:
    """Refuse a loss whose settings' plan (``path``, ``tile_size``, ``memory_budget``, ``matmul_precision``)
    would be accepted and ignored: a stage that uses the plan built without the settings' (its
    ``build_stage`` must hand over ``settings.plan()``), or a field set off its default that no stage of the
    loss uses (the distillation losses' ``path`` without their InfoNCE term)."""
    if not isinstance(settings, LossStageSettings):
        return
    wanted = settings.plan()
    for built in stage.plans():
        if built != wanted:
            name = next(n for n in PLAN_FIELDS if getattr(built, n) != getattr(wanted, n))
            raise ValueError(
                f"{owner}: {name}={getattr(wanted, name)!r} does not reach its stage ({type(stage).__name__} was "
                f"built with {name}={getattr(built, name)!r}): {owner}.build_stage must pass "
                "plan=settings.plan() to the stage (docs/development.md, Adding a loss)."
            )
    used = stage.honoured_plan()
    for name in PLAN_FIELDS:
        value = getattr(settings, name)
        if name not in used and value != type(settings).default(name):
            uses = ", ".join(sorted(used)) or "none of the plan"
            raise ValueError(
                f"{owner}: {name}={value!r} is used by no part of this loss as configured (its stage, "
                f"{type(stage).__name__}, uses {uses}): {settings.idle_plan_hint(name)}."
            )


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


def check_columns(
    sentence_features: Sequence[dict[str, Any]],
    owner: str,
    min_columns: int = 2,
    message: Any = None,
) -> None:
    """At least ``min_columns`` columns (anchor, positive[, negatives...]), every column splittable, and the
    same number of rows in each. ``message(n)``: a loss's own words for too few columns (None: these)."""
    if len(sentence_features) < min_columns:
        words = message(len(sentence_features)) if message is not None else None
        if words:
            raise ValueError(words)
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
