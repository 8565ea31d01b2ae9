"""Distillation of a teacher's embeddings with GradCache:
[`CachedEmbedDistillLoss`][st_cached_losses.losses.cached_embed_distill.CachedEmbedDistillLoss] (sentence-transformers'
``EmbedDistillLoss``, the teacher's embeddings in the labels or from a live frozen teacher), its settings
([`EmbedDistillSettings`][st_cached_losses.losses.cached_embed_distill.EmbedDistillSettings]) and its stage
([`EmbedDistill`][st_cached_losses.losses.stages.embed_distill.EmbedDistill]): the pointwise distance of each
student embedding to the teacher's ([`embed_distill_loss_and_grad`][st_cached_losses.functional.distill.embed.embed_distill_loss_and_grad],
through a learned projection where the widths differ) plus, with a weight, the listwise KL of the teacher's
softmax over every candidate of the global batch to the student's
([`listwise_kl_loss_and_grad`][st_cached_losses.functional.distill.listwise.listwise_kl_loss_and_grad]).

Each row's pointwise term is its own, so that part of the stage is per row; the listwise term is a softmax per
anchor over every candidate, computed in tiles with running log-sum-exps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from st_cached_losses.engine.features import model_device, unwrap_model
from st_cached_losses.functional.distill.embed import EMBED_DISTANCES
from st_cached_losses.losses.base import CachedLoss, Stage
from st_cached_losses.losses.cached_distill import (
    DistillSettings,
    distillation_stage,
    refuse_idle_matmul_precision,
)
from st_cached_losses.losses.citations import GRADCACHE_CITATION
from st_cached_losses.losses.settings import (
    LossStageSettings,
    SharedSettings,
    check_nonnegative,
    check_scale,
    redefault,
    setting,
)
from st_cached_losses.losses.stages.embed_distill import PROJECTION_INPUTS, EmbedDistill
from st_cached_losses.losses.stages.infonce import GuideModel

__all__ = ["EMBED_DISTILL_CITATION", "CachedEmbedDistillLoss", "EmbedDistillSettings", "embedding_dimension"]

#: the EmbedDistill paper (the model card's citation, as sentence-transformers' ``EmbedDistillLoss`` cites it)
EMBED_DISTILL_CITATION = """
@article{kim2023embeddistill,
    title={EmbedDistill: A Geometric Knowledge Distillation for Information Retrieval},
    author={Kim, Seungyeon and Rawat, Ankit Singh and Zaheer, Manzil and Jayasumana, Sadeep and Sadhanala, Veeranjaneyulu and Jitkrittum, Wittawat and Menon, Aditya Krishna and Fergus, Rob and Kumar, Sanjiv},
    year={2023},
    eprint={2301.12005},
    archivePrefix={arXiv},
    primaryClass={cs.IR}
}
"""


def _distance_metric(name: str, value: Any) -> str:
    if value not in EMBED_DISTANCES:
        raise ValueError(f"distance_metric must be one of 'mse', 'l2', 'cosine', but got '{value}'.")
    return str(value)


def _projection_dim(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive int (the teacher's embedding width) or None (no projection), got {value!r}."
        )
    return value


def _teacher(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, nn.Module):
        raise ValueError(
            f"{name} must be a SentenceTransformer (the frozen teacher, embedding every column in stage 1) or None "
            f"(the teacher's embeddings in the labels), got {type(value).__name__}."
        )
    return value


def _weight(name: str, value: Any) -> float:
    out = check_nonnegative(name, value, optional=False, example="1.0")
    assert out is not None
    return out


def _teacher_scale(name: str, value: Any) -> float | None:
    return None if value is None else check_scale(name, value)


def embedding_dimension(model: Any) -> int | None:
    """The model's (untruncated) embedding width, as sentence-transformers' versions ask it; None if it has
    none to say."""
    model = unwrap_model(model) if model is not None else None
    for name in ("get_embedding_dimension", "get_sentence_embedding_dimension"):
        get = getattr(model, name, None)
        if get is not None:
            dim = get()
            return dim if isinstance(dim, int) else None
    return None


@dataclass(frozen=True, kw_only=True)
class EmbedDistillSettings(LossStageSettings):
    """[`CachedEmbedDistillLoss`][st_cached_losses.losses.cached_embed_distill.CachedEmbedDistillLoss]'s settings:
    sentence-transformers' ``EmbedDistillLoss`` arguments (``distance_metric``, ``projection_dim``), the live
    teacher, the weights of the pointwise and the listwise terms, the listwise softmaxes' scales, gathering
    across processes, the engine's knobs and the loss stage's plan."""

    owner: ClassVar[str] = "CachedEmbedDistillLoss"
    #: sentence-transformers' keys (``distance_metric``, ``projection_dim``) and the mini-batches; what differs
    #: from its default follows (the teacher, the terms' weights and scales, gathering, the plan)
    config_keys: ClassVar[tuple[str, ...]] = (
        "distance_metric",
        "projection_dim",
        "mini_batch_size",
        "mini_batch_num_tokens",
    )

    distance_metric: str = setting(
        "cosine",
        doc="How each student embedding is compared with the teacher's: 'cosine' (1 - cosine similarity), 'l2' "
        "(Euclidean distance, the EmbedDistill paper's) or 'mse' (mean squared error), as EmbedDistillLoss.",
        check=_distance_metric,
        config="always",
    )
    projection_dim: int | None = setting(
        None,
        doc="The teacher's embedding width: a learned nn.Linear(student_dim, projection_dim) of the loss maps the "
        "student's embeddings into the teacher's space before the distance (None: no projection, the widths "
        "must agree); save_projection / load_projection keep it between runs.",
        check=_projection_dim,
        config="always",
    )
    teacher: nn.Module | None = setting(
        None,
        doc="A frozen teacher SentenceTransformer embedding every column in stage 1, mini-batch by mini-batch and "
        "without a graph, instead of the teacher's embeddings in the labels (None: the labels).",
        check=_teacher,
        module=True,
    )
    pointwise_weight: float = setting(
        1.0,
        doc="The weight of the pointwise term (each student embedding against the teacher's, distance_metric); "
        "0: the listwise term alone.",
        check=_weight,
    )
    listwise_weight: float = setting(
        0.0,
        doc="The weight of the listwise term: per anchor, the KL divergence of the student's softmax over every "
        "candidate of the global batch from the teacher's (both from cosine similarities of embeddings), the mean "
        "over the anchors; 0: the pointwise loss alone (EmbedDistillLoss).",
        check=_weight,
    )
    listwise_scale: float = setting(
        20.0,
        doc="The listwise term's student scale: its logits are listwise_scale * cos(student anchor, student "
        "candidate).",
        check=check_scale,
    )
    listwise_teacher_scale: float | None = setting(
        None,
        doc="The listwise term's teacher scale: its logits are listwise_teacher_scale * cos(teacher anchor, "
        "teacher candidate) (None: listwise_scale).",
        check=_teacher_scale,
    )
    infonce_weight: float = redefault(DistillSettings, "infonce_weight", 0.0, config="changed")
    infonce_scale: float = redefault(DistillSettings, "infonce_scale", 20.0, config="changed")
    gather_across_devices: bool = redefault(SharedSettings, "gather_across_devices", False, config="changed")

    def validate(self) -> None:
        super().validate()
        if not self.pointwise_weight and not self.listwise_weight and not self.infonce_weight:
            raise ValueError(
                f"{self.owner}: pointwise_weight, listwise_weight and infonce_weight are all 0, so there is no loss; "
                "set one above 0 (e.g. listwise_weight=1.0)."
            )
        refuse_idle_matmul_precision(self, "the pointwise and listwise terms keep fp32 products")

    def beyond_sentence_transformers(self) -> tuple[str, ...]:
        """What ``EmbedDistillLoss`` has no form of: a live teacher, a pointwise weight other than 1, the
        listwise and the InfoNCE terms."""
        ours = (
            ("teacher", self.teacher is not None),
            ("pointwise_weight", self.pointwise_weight != 1.0),
            ("listwise_weight", bool(self.listwise_weight)),
            ("infonce_weight", bool(self.infonce_weight)),
        )
        return (*super().beyond_sentence_transformers(), *(name for name, used in ours if used))

    def teacher_scale(self) -> float:
        """The listwise term's teacher scale, as used."""
        return self.listwise_teacher_scale if self.listwise_teacher_scale is not None else self.listwise_scale


class CachedEmbedDistillLoss(CachedLoss):
    name = "embed_distill"
    aliases = ("embed-distill",)
    st_names = ("EmbedDistillLoss",)
    settings_class = EmbedDistillSettings
    citations = (GRADCACHE_CITATION, EMBED_DISTILL_CITATION)
    equivalent_st_loss = "EmbedDistillLoss"
    #: one text column suffices (the arguments' dataset check reads it): each row is distilled on its own
    min_text_columns: ClassVar[int] = 1

    #: the learned projection into the teacher's space (``projection_dim``), or None
    projection: nn.Linear | None

    def __init__(
        self,
        model: nn.Module,
        distance_metric: str = "cosine",
        projection_dim: int | None = None,
        *,
        mini_batch_size: int | str = 32,
        mini_batch_num_tokens: int | str | None = None,
        teacher: nn.Module | None = None,
        pointwise_weight: float = 1.0,
        listwise_weight: float = 0.0,
        listwise_scale: float = 20.0,
        listwise_teacher_scale: float | None = None,
        infonce_weight: float = 0.0,
        infonce_scale: float = 20.0,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        **engine: Any,
    ) -> None:
        """
        sentence-transformers' ``EmbedDistillLoss`` with GradCache: each student embedding against the
        teacher's embedding of the same text (``distance_metric``, through a learned projection where the widths
        differ), with the memory of one encoder mini-batch; optionally plus a listwise term that distils the
        teacher's ranking of every candidate of the global batch, and a live frozen teacher instead of
        precomputed labels.

        The batch is embedded mini-batch by mini-batch without a graph; the loss and its gradients wrt every
        embedding (and the projection's) are computed from the cached rows; the encoder is then replayed with
        them. With the defaults it is the same loss and the same gradients as ``EmbedDistillLoss`` (every
        metric, with and without a projection, one or several columns), also inside ``MatryoshkaLoss``.

        The listwise term (``listwise_weight > 0``): for each anchor (column 0), the KL divergence of the
        student's softmax over every candidate (every row of the other columns, across processes every
        process's with ``gather_across_devices``) from the teacher's, the logits
        ``listwise_scale * cos(s_anchor, s_candidate)`` and ``listwise_teacher_scale * cos(t_anchor,
        t_candidate)``, the mean over the anchors. Computed in tiles with running log-sum-exps (never a
        ``B x C`` matrix); the student's and the teacher's widths may differ (it compares similarities, not
        embeddings, so it needs no projection).

        The constructor takes ``EmbedDistillLoss``'s arguments in their positional order, then ours,
        keyword-only, then the engine's knobs and the loss stage's plan
        ([`LossStageSettings`][st_cached_losses.losses.settings.LossStageSettings]; none changes the result).
        Every argument is a setting ([`EmbedDistillSettings`][st_cached_losses.losses.cached_embed_distill.EmbedDistillSettings]),
        read and assigned between steps.

        Args:
            model: the student ``SentenceTransformer`` to train.
            distance_metric: ``"cosine"`` (1 - cosine similarity, the default), ``"l2"`` (Euclidean distance,
                the EmbedDistill paper's) or ``"mse"`` (mean squared error).
            projection_dim: the teacher's width: a learned ``nn.Linear(student_dim, projection_dim)`` (the loss's
                ``projection``, trained with the student) maps the student's embeddings into the teacher's space
                before the distance. As theirs, it is not saved with the model: ``save_projection`` /
                ``load_projection`` keep it between runs. None (default): no projection.
            mini_batch_size: rows per encoder forward (or ``"auto"``); sets the memory, not the result.
            mini_batch_num_tokens: a budget of real tokens per encoder mini-batch instead.
            teacher: a frozen teacher ``SentenceTransformer``: it embeds every column in stage 1, mini-batch by
                mini-batch and without a graph (re-tokenising the texts when its tokenizer differs, as
                ``CachedGISTLoss``'s guide), instead of the teacher's embeddings in the labels; never trained.
                None (default): the labels.
            pointwise_weight: the pointwise term's weight (0: the listwise term alone).
            listwise_weight: the listwise term's weight (0, the default: the pointwise loss alone).
            listwise_scale: the student's listwise logits' scale (``1 / temperature``).
            listwise_teacher_scale: the teacher's listwise logits' scale (None: ``listwise_scale``).
            infonce_weight: the weight of an in-batch InfoNCE term added to the loss (sentence-transformers'
                ``MultipleNegativesRankingLoss`` of the same batch: the anchors against every row's candidates,
                the second column the positive, by cosine); 0 (the default): none. Needs two columns.
            infonce_scale: the InfoNCE term's scale (``1 / its temperature``).
            gather_across_devices: the pointwise term is the mean over every process's rows (each process's
                share), the listwise and InfoNCE terms rank every process's candidates (gathered, or passed
                around a ring of processes with ``path="tiled"``).
            show_progress_bar: tqdm bars over the mini-batches.

        References:
            - Kim et al., EmbedDistill: A Geometric Knowledge Distillation for Information Retrieval, 2023:
              https://huggingface.co/papers/2301.12005
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021:
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. The teacher's embeddings as the labels: ``(batch_size, teacher_dim)`` (every column targets the
               same embedding) or ``(batch_size, num_columns, teacher_dim)``; or ``teacher=`` and no labels.
            2. The listwise term: at least two columns (anchor, positive[, negatives...]).

        Inputs:
            | Texts | Labels |
            |---|---|
            | input | teacher embeddings ``(batch_size, teacher_dim)`` |
            | input_1, ..., input_N | teacher embeddings ``(batch_size, N, teacher_dim)`` |
            | input_1, ..., input_N | teacher embeddings ``(batch_size, teacher_dim)`` |
            | input_1, ..., input_N | none, with ``teacher=`` |

        Relations:
            - The same loss and gradients as ``EmbedDistillLoss`` (sentence-transformers) with the same
              arguments (and the defaults of ours).
            - [`CachedDistillKLDivLoss`][st_cached_losses.losses.cached_distill.CachedDistillKLDivLoss] distils a
              teacher's scores of each query's own candidates instead of its embeddings.

        Example:
            ```python
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_cached_losses import CachedEmbedDistillLoss

            student = SentenceTransformer("all-MiniLM-L6-v2")
            teacher = SentenceTransformer("all-mpnet-base-v2")
            # train_dataset: (anchor, positive) texts, no label column: the teacher embeds them at each step
            loss = CachedEmbedDistillLoss(
                student, "cosine", projection_dim=768, teacher=teacher, listwise_weight=1.0, mini_batch_size=64
            )
            trainer = SentenceTransformerTrainer(model=student, train_dataset=train_dataset, loss=loss)
            trainer.train()
            ```
        """
        self._model_tokenizer = getattr(model, "tokenizer", None)
        super().__init__(
            model,
            EmbedDistillSettings(
                distance_metric=distance_metric,
                projection_dim=projection_dim,
                mini_batch_size=mini_batch_size,
                mini_batch_num_tokens=mini_batch_num_tokens,
                teacher=teacher,
                pointwise_weight=pointwise_weight,
                listwise_weight=listwise_weight,
                listwise_scale=listwise_scale,
                listwise_teacher_scale=listwise_teacher_scale,
                infonce_weight=infonce_weight,
                infonce_scale=infonce_scale,
                gather_across_devices=gather_across_devices,
                show_progress_bar=show_progress_bar,
                **engine,
            ),
        )

    def _settings_changed(self, old: Any, new: Any) -> None:
        super()._settings_changed(old, new)
        if old is not None and old.projection_dim == new.projection_dim and "projection" in self._modules:
            return
        if new.projection_dim is None:
            self.projection = None
            return
        student_dim = embedding_dimension(self.model)
        if student_dim is None:
            raise ValueError(
                f"projection_dim: the model does not say its embedding width (get_embedding_dimension() gave "
                f"none), so the projection nn.Linear(student_dim, {new.projection_dim}) cannot be built; end the "
                "model with a Pooling (or Dense) module, or set projection_dim=None."
            )
        self.projection = nn.Linear(student_dim, new.projection_dim, device=model_device(self.model))

    def stage_inputs(self, training: bool = False) -> dict[str, Tensor]:
        """The projection's weight and bias (the stage returns their gradients), nothing without one."""
        projection = self._modules.get("projection")
        if projection is None:
            return {}
        assert isinstance(projection, nn.Linear)
        inputs = {PROJECTION_INPUTS[0]: projection.weight}
        if projection.bias is not None:
            inputs[PROJECTION_INPUTS[1]] = projection.bias
        return inputs

    def build_stage(self) -> Stage:
        s = self.settings
        teacher = None
        if s.teacher is not None:
            model = unwrap_model(self.model)
            retokenize = GuideModel.must_retokenize(s.teacher, model, self._model_tokenizer)
            teacher = GuideModel(s.teacher, retokenize, self._model_tokenizer)
        distill = EmbedDistill(
            owner=type(self).__name__,
            metric=s.distance_metric,
            pointwise_weight=s.pointwise_weight,
            listwise_weight=s.listwise_weight,
            listwise_scale=s.listwise_scale,
            teacher_scale=s.teacher_scale(),
            student_dim=embedding_dimension(self.model),
            teacher=teacher,
            gather=s.gather_across_devices,
            plan=s.plan(),
        )
        # with infonce_weight: the anchors against every row's candidates, the first candidate column the
        # positive (sentence-transformers' MultipleNegativesRankingLoss), by cosine at infonce_scale
        return distillation_stage(distill, s, similarity="cosine")

    # ------------------------------------------------------------------ the projection, as theirs

    def save_projection(self, path: str | os.PathLike[str]) -> None:
        """Write the projection's weights (safetensors) for a later run (``load_projection``): the trainer saves
        the model, not the loss's parameters.

        Args:
            path: the file to write.

        Raises:
            ValueError: the loss has no projection (``projection_dim`` is None).
        """
        from safetensors.torch import save_model

        if self.projection is None:
            raise ValueError(
                "No projection layer to save. Construct CachedEmbedDistillLoss with projection_dim=<int> if you "
                "want a learnable projection."
            )
        save_model(self.projection, str(path))

    def load_projection(self, path: str | os.PathLike[str]) -> None:
        """Load projection weights written by ``save_projection`` (theirs or ours: the same file). Without a
        projection one is made from the file's shape (``projection_dim`` set to its width).

        Args:
            path: a safetensors file written by ``save_projection``.

        Raises:
            ValueError: the saved shape does not fit the student's width or the configured projection.
        """
        from safetensors.torch import load_file

        state = load_file(str(path))
        out_features, in_features = state["weight"].shape
        if self.projection is None:
            student_dim = embedding_dimension(self.model)
            if in_features != student_dim:
                raise ValueError(
                    f"Saved projection expects student embeddings of dim {in_features}, but the current student "
                    f"model outputs {student_dim}-dim embeddings."
                )
            self.update_settings(projection_dim=out_features)
        assert self.projection is not None
        if self.projection.in_features != in_features or self.projection.out_features != out_features:
            raise ValueError(
                f"Saved projection shape ({in_features} -> {out_features}) does not match the configured projection "
                f"shape ({self.projection.in_features} -> {self.projection.out_features})."
            )
        self.projection.load_state_dict(state)
