"""SigLIP's pairwise sigmoid loss with GradCache: [`CachedSigLIPLoss`][st_cached_losses.losses.cached_siglip.CachedSigLIPLoss],
its settings ([`SigLIPSettings`][st_cached_losses.losses.cached_siglip.SigLIPSettings]) and its stage
([`Sigmoid`][st_cached_losses.losses.cached_siglip.Sigmoid], the functional core's
[`sigmoid_loss_and_grad`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss_and_grad]): the first loss added as
``docs/development.md`` says a loss is added, in one file.

Every pair's term is independent (no softmax), so the loss stage needs no statistics: row chunks, tiles and a
ring of processes each compute the loss and every gradient in one pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_cached_losses.engine.features import batch_size_of
from st_cached_losses.engine.lists import ListColumns, check_list_columns, every_column
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.functional.placement import mean_scale_grad, ring_path
from st_cached_losses.functional.sigmoid.loss import SigmoidOptions, sigmoid_loss_and_grad
from st_cached_losses.losses.base import Stage, StageInput, StageOutput
from st_cached_losses.losses.citations import GRADCACHE_CITATION, SIGLIP_CITATION
from st_cached_losses.losses.learnable_scale import LearnableScale
from st_cached_losses.losses.settings import (
    DEFAULT_PLAN,
    PLAN_FIELDS,
    LearnableScaleSettings,
    LossStageSettings,
    Plan,
    ScaleSettings,
    SharedSettings,
    check_bool,
    check_finite,
    check_max_scale,
    redefault,
    setting,
    view,
)
from st_cached_losses.losses.similarity import EMBEDDING, SimilarityKind

__all__ = ["CachedSigLIPLoss", "SigLIPSettings", "Sigmoid"]


@dataclass(frozen=True, kw_only=True)
class SigLIPSettings(ScaleSettings, LossStageSettings):
    """[`CachedSigLIPLoss`][st_cached_losses.losses.cached_siglip.CachedSigLIPLoss]'s settings: the scale and
    the bias of the logits ``scale * sim + bias``, whether both are learned, the similarity, gathering across
    processes, the engine's knobs and the loss stage's plan."""

    owner: ClassVar[str] = "CachedSigLIPLoss"
    #: the config's first keys: the scale and the bias (the current, learned ones), the similarity by name,
    #: the mini-batches and gathering
    config_keys: ClassVar[tuple[str, ...]] = (
        "scale",
        "bias",
        "similarity_fct",
        "mini_batch_size",
        "mini_batch_num_tokens",
        "gather_across_devices",
    )
    #: the kind of ``similarity_fct`` (its check, its config name, the arguments' names)
    similarity_kind: ClassVar[SimilarityKind] = EMBEDDING

    scale: float = redefault(ScaleSettings, "scale", 10.0)
    bias: float = setting(
        -10.0,
        doc="SigLIP's bias b in the pair logits scale * sim + b (the initial value when learnable); -10 keeps "
        "the many negative pairs from dominating the first steps.",
        check=check_finite,
        config="always",
    )
    learnable: bool = setting(
        False,
        doc="Learn SigLIP's scale (through its log, logit_scale, clamped at max_scale) and bias (logit_bias) as "
        "parameters of the loss; give the trainer callbacks=[LossStateCallback(loss)] to save, restore and log "
        "them.",
        check=check_bool,
        config="never",
    )
    max_scale: float = redefault(LearnableScaleSettings, "max_scale", 100.0)
    similarity_fct: Callable[..., Tensor] | str = redefault(SharedSettings, "similarity_fct", cos_sim)
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False)

    @view
    def learnable_scale(self) -> bool:
        """Whether the scale is learned: ``learnable`` (which learns the bias too); setting it sets
        ``learnable``."""
        return self.learnable

    @learnable_scale.changes
    def _(self, value: Any) -> dict[str, Any]:
        return {"learnable": check_bool("learnable_scale", value)}

    @view
    def similarity(self) -> Any:
        """The core's score: ``"cosine"``, ``"dot"`` (GEMM blocks) or the function itself."""
        return self.resolved("similarity_fct")

    def validate(self) -> None:
        super().validate()
        if self.learnable:
            check_max_scale(self.max_scale, self.scale)

    def learned_config(self) -> dict[str, Any]:
        """``learnable`` and its clamp, when the scale and the bias are learned."""
        return {"learnable": True, "max_scale": self.max_scale} if self.learnable else {}


@dataclass(eq=False, kw_only=True)
class Sigmoid(Stage):
    """The sigmoid loss of the cached rows (anchors, then the positives and every hard-negative column) and
    its gradients wrt them and wrt a learned scale and bias (``step.inputs["scale"]`` / ``["bias"]``), in one
    pass: on one process, gathered across processes, or on a ring (``path="tiled"`` with ``gather``).

    Args:
        owner: the loss's class name, for messages.
        similarity: ``"cosine"``, ``"dot"`` or a function of two ``(rows, dim)`` tensors.
        scale: the logits' scale (``scale * sim + bias``) when it is not learned.
        bias: the logits' bias when it is not learned.
        plan: the loss stage's plan, whole (``settings.plan()``: the path, across processes ``"tiled"`` the
            ring exchange and the others a gather; the tile size; the memory budget; the products' precision,
            the softplus terms, sums and gradients staying fp32).
        gather: score each process's rows against every process's candidates.
    """

    plan_fields: ClassVar[frozenset[str]] = frozenset(PLAN_FIELDS)

    owner: str
    similarity: Any
    scale: float
    bias: float
    plan: Plan = DEFAULT_PLAN
    gather: bool = False

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        embeddings, step = batch.embeddings, batch.step
        listed = step.counts is not None  # lists of hard negatives: columns of their own lengths
        kept = None
        if self.gather and is_distributed():
            # a list column this process did not embed: (0, d) rows, as every process has it
            embeddings, kept = every_column(embeddings, step.kept, step.given)
            if kept is not None:
                batch = StageInput(embeddings, batch.labels, step, batch.owner)
        # also the finiteness check, and whether any process has lists, agreed on by every process (all then
        # score them as lists, each process's columns gathered or passed around the ring at their own lengths)
        sizes = batch.sizes(self.gather, tag=int(listed))
        if sizes is not None:
            listed = bool(batch.tag(self.gather))
        scale = step.inputs.get("scale", self.scale)
        bias = step.inputs.get("bias", self.bias)
        options = SigmoidOptions(
            scale=scale,
            bias=bias,
            similarity=self.similarity,
            **self.plan.options(),
            check_finite=False,
            listed_negatives=listed,
        )
        ring = sizes is not None and ring_path(self.plan.path)
        out = sigmoid_loss_and_grad(
            embeddings[0], embeddings[1:], options, sizes=sizes, ring=ring, with_grad=with_grad
        )
        if not with_grad:
            return StageOutput(out.loss)
        assert out.grad_anchors is not None  # asked for
        grads = [out.grad_anchors, *out.grad_candidates]
        if kept is not None:  # the embedded columns' only
            grads = [grads[k] for k in kept]
        input_grads: dict[str, Tensor] = {}
        for name, grad in (("scale", out.grad_scale), ("bias", out.grad_bias)):
            if grad is None:
                continue
            if sizes is None:
                # each process scored its own rows and the scale and bias belong to the loss, outside any
                # wrapper: average their gradients as DDP averages the model's (the gathered and ring paths
                # average them themselves)
                grad = mean_scale_grad(grad)
            assert grad is not None
            input_grads[name] = grad
        return StageOutput(out.loss, grads, input_grads)


class CachedSigLIPLoss(LearnableScale):
    name = "siglip"
    aliases = ("sigmoid",)
    settings_class = SigLIPSettings
    citations = (GRADCACHE_CITATION, SIGLIP_CITATION)
    #: sentence-transformers has no sigmoid loss (their issue 3119)
    equivalent_st_loss = None

    logit_bias: nn.Parameter

    def __init__(
        self,
        model: nn.Module,
        scale: float = 10.0,
        bias: float = -10.0,
        learnable: bool = False,
        mini_batch_size: int | str = 32,
        similarity_fct: Callable[..., Tensor] | str = cos_sim,
        mini_batch_num_tokens: int | str | None = None,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        *,
        max_scale: float = 100.0,
        **engine: Any,
    ) -> None:
        """
        SigLIP's pairwise sigmoid loss with GradCache: every (anchor, candidate) pair of the batch is a binary
        classification, exact at any batch size with the memory of one mini-batch.

        For anchors ``x_i`` and candidates ``y_j`` (the positives, then every hard-negative column; across
        processes with ``gather_across_devices``, every process's), as the paper writes it:

        ```text
        L = -(1 / B) * sum_i sum_j log sigmoid(z_ij * (scale * sim(x_i, y_j) + bias))
        ```

        with ``z_ij = +1`` for row ``i``'s own positive and -1 for every other pair. One sum over all pairs, so
        the loss is symmetric by construction (there is no ``directions`` setting), and it is not normalised
        over the batch: no softmax, so the loss stage needs no row or column statistics, and its memory is
        the embeddings plus one block of pairs whatever the batch (and, on the ring, whatever the number of
        processes). With ``learnable=True`` the loss has two parameters, ``logit_scale = log(scale)`` (clamped
        at ``max_scale``) and ``logit_bias``, which the stock trainer optimises; their gradients are averaged
        over processes, and [`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback] saves,
        restores and logs them.

        Args:
            model: the SentenceTransformer to train (text-text, or image-text such as a CLIP model).
            scale: ``t`` in ``t * sim + b`` (the initial value when learnable; SigLIP: 10).
            bias: ``b`` in ``t * sim + b`` (the initial value when learnable; SigLIP: -10).
            learnable: learn ``scale`` (through its log, as the paper) and ``bias``; give the trainer
                ``callbacks=[LossStateCallback(loss)]`` to save, restore and log them with checkpoints.
            mini_batch_size: rows per encoder forward (GradCache's chunk): sets the memory, never the result;
                ``"auto"``: the largest that fits ``mini_batch_memory_budget``.
            similarity_fct: ``cos_sim`` / ``"cosine"`` (default, as SigLIP), ``dot_score`` / ``"dot"``, or any
                ``f(a, b) -> (len(a), len(b))`` (scored exactly block by block through autograd, slower).
            mini_batch_num_tokens: a token budget per encoder mini-batch instead of ``mini_batch_size``.
            gather_across_devices: score each process's anchors against every process's candidates (the loss of
                the global batch; by ring exchange with ``path="tiled"``).
            show_progress_bar: tqdm bars over the encoder mini-batches.
            max_scale: the clamp of a learned scale (100, as open_clip).

        The engine's knobs and the loss stage's plan (``path``, ``tile_size``, ``memory_budget``,
        ``graph_memory_budget``, ...) are keyword-only, as every cached loss takes them; with
        ``gather_across_devices``, ``path="tiled"`` is the ring.

        References:
            - Zhai et al., Sigmoid Loss for Language Image Pre-Training, 2023:
              https://huggingface.co/papers/2303.15343
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
            2. A SentenceTransformer of text or of images and text (the columns may hold either).

        Inputs:
            | Texts | Labels |
            |---|---|
            | (anchor, positive) pairs | none |
            | (anchor, positive, negative) triplets | none |
            | (anchor, positive, negative_1, ..., negative_n) | none |
            | (anchor, positive, negative), a list of negatives per row (or None in negative_k) | none |
            | (image, caption) pairs | none |

        Lists (the trainer's ``data_collator=ListDataCollator(preprocess_fn=model.preprocess)``): every listed
        negative is a negative pair of every anchor, on one process and across processes (each process's lists
        gathered, or passed around the ring with ``path="tiled"``, at their own lengths); one positive per row.

        Relations:
            - [`CachedCLIPLoss`][st_cached_losses.losses.cached_clip.CachedCLIPLoss] is the softmax (InfoNCE)
              counterpart: its loss is normalised over the batch, both directions.
            - [`sigmoid_loss`][st_cached_losses.functional.sigmoid.loss.sigmoid_loss] computes this loss on
              embeddings from any training loop.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedSigLIPLoss, LossStateCallback

            model = SentenceTransformer("all-MiniLM-L6-v2")
            loss = CachedSigLIPLoss(model, scale=10.0, bias=-10.0, learnable=True, mini_batch_size=32)
            trainer = SentenceTransformerTrainer(
                model=model, train_dataset=train_dataset, loss=loss,
                callbacks=[LossStateCallback(loss)],  # the scale and bias saved / restored with checkpoints
            )
            trainer.train()
            ```
        """
        super().__init__(
            model,
            SigLIPSettings(
                scale=scale,
                bias=bias,
                learnable=learnable,
                mini_batch_size=mini_batch_size,
                similarity_fct=similarity_fct,
                mini_batch_num_tokens=mini_batch_num_tokens,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                max_scale=max_scale,
                **engine,
            ),
        )

    learned_settings = frozenset({"scale", "temperature", "bias"})

    def learned(self) -> dict[str, Any]:
        """The learned scale and bias (``"scale"``, ``"bias"``) while learnable."""
        learned = super().learned()
        if learned and "logit_bias" in self._parameters:
            learned["bias"] = float(self.logit_bias.detach())
        return learned

    @property
    def bias(self) -> float:
        """The current bias: the learned value while learnable (a view of ``logit_bias``, which an assignment
        sets), else the setting."""
        return float(self.learned().get("bias", self.settings.bias))

    @bias.setter
    def bias(self, value: float) -> None:
        self.update_settings(bias=value)

    def _settings_changed(self, old: Any, new: Any) -> None:
        super()._settings_changed(old, new)  # the scale's parameter
        was = old is not None and old.learnable and "logit_bias" in self._parameters
        if new.learnable and not was:
            self.logit_bias = nn.Parameter(torch.tensor(new.bias, dtype=torch.float32))
        elif new.learnable and new.bias != old.bias:  # (old: with the learned value)
            with torch.no_grad():
                self.logit_bias.fill_(new.bias)
        elif not new.learnable and was:
            del self.logit_bias

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The learned scale (``exp(logit_scale)``, clamped on the parameter) and bias with their graphs to
        the parameters, as ``"scale"`` and ``"bias"`` (nothing when fixed)."""
        inputs = super().stage_inputs(training)
        if self.settings.learnable:
            inputs["bias"] = self.logit_bias.float()
        return inputs

    def check_lists(self, features: list[Any], lists: ListColumns) -> None:
        """Lists of hard negatives (each row its own number, empty allowed): every one a negative of every
        anchor, as a hard-negative column's rows are; one positive per row (SigLIP's pair labels have one
        positive pair per anchor)."""
        owner = type(self).__name__
        check_list_columns(
            [batch_size_of(f) for f in features],
            lists,
            owner,
            one_positive="A pair's label is positive for its own anchor only. Give one positive per row (lists of "
            "hard negatives are taken), or use CachedMNRLoss / CachedCLIPLoss, which take several positives per row.",
        )

    def build_stage(self) -> Sigmoid:
        s = self.settings
        return Sigmoid(
            owner=type(self).__name__,
            similarity=s.similarity,
            scale=s.scale,
            bias=s.bias,
            plan=s.plan(),
            gather=s.gather_across_devices,
        )
