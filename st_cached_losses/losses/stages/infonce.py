"""The InfoNCE stage: the package's one InfoNCE core ([`st_cached_losses.functional`][st_cached_losses.functional])
over a loss's logit terms, on one process, gathered across processes, or by ring exchange.

What a loss says of it: its terms (sentence-transformers' ranking options, GIST's guided terms), its score,
its scale (a tensor in ``step.inputs["scale"]`` when learned, whose gradient the stage returns), the loss
stage's plan, whether rows are scored against every row's candidates or their own only
(``in_batch_negatives``, chosen once here: the terms and the column check), duplicate masks, a guide
(a model's embeddings, or the step's own: self-guided GIST), a negative bank and a false-negative filter (the
loss's own similarities judging, with the count of what it removed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from st_cached_losses.engine.cache_form import CacheForm
from st_cached_losses.engine.features import input_ids_by_row, model_device
from st_cached_losses.engine.lists import every_column
from st_cached_losses.engine.multimodal import input_keys, media_inputs
from st_cached_losses.functional import InfoNCEOptions, infonce
from st_cached_losses.functional.distributed import is_distributed
from st_cached_losses.functional.placement import mean_scale_grad, ring_path
from st_cached_losses.functional.score import Score
from st_cached_losses.functional.softmax.options import Bank, FalseNegativeFilter, Guide
from st_cached_losses.functional.softmax.parallel import (
    gathered_infonce,
    loss_and_grad,
    pad_to_common_tokens,
)
from st_cached_losses.functional.softmax.positives import (
    gathered_several_positives_loss_and_grad,
    ring_several_positives_loss_and_grad,
    several_positives_loss_and_grad,
)
from st_cached_losses.functional.softmax.terms import TermSet
from st_cached_losses.losses.base import CachedLoss, Stage, StageInput, StageOutput, StepData, check_columns
from st_cached_losses.losses.negative_bank import NegativeBank
from st_cached_losses.losses.ranking import check_own_candidates
from st_cached_losses.losses.settings import DEFAULT_PLAN, PLAN_FIELDS, Plan

__all__ = ["SELF_GUIDED", "FalseNegativeCount", "GuideModel", "InfoNCE", "several_positives"]

#: the guide of a self-guided GIST loss: the step's own embeddings
SELF_GUIDED = "self"


def several_positives(step: StepData) -> Tensor | None:
    """The positives' per-row counts ``(B,)`` when a row of the step has other than one positive, else None."""
    return step.counts[1] if step.counts is not None and len(step.counts) > 1 else None


class FalseNegativeCount:
    """A loss's count of what its false-negative filter removed in the current training step (every call of
    the stage in the step, a MatryoshkaLoss's truncations included), on this process's rows: the stage adds
    each call's tally; a training step's ``prepare`` starts a new count. Kept as a tensor on the embeddings'
    device, read (one synchronisation) only when asked."""

    def __init__(self) -> None:
        self.tally: Tensor | None = None  # (2,) int64: removed, negatives seen
        self._last: Tensor | None = None

    def begin_step(self) -> None:
        """A training step begins: the finished step's count is the one reported until this one is counted."""
        if self.tally is not None:
            self._last = self.tally
        self.tally = None

    def sink(self, device: torch.device) -> Tensor:
        """The tally a call of the current step adds to."""
        if self.tally is None:
            self.tally = torch.zeros(2, dtype=torch.long, device=device)
        return self.tally

    @property
    def fraction(self) -> float | None:
        """Removed / seen negatives of the latest counted step (the current one once a call counted), None before
        any (or with no negative seen)."""
        tally = self.tally if self.tally is not None else self._last
        if tally is None:
            return None
        removed, seen = tally.tolist()
        return removed / seen if seen else None


@dataclass(eq=False)
class GuideModel:
    """A frozen guide model (GIST) that embeds each column once per step, mini-batch by mini-batch and without
    a graph, where the trained model's embeddings are; re-tokenising the texts when its tokenizer differs
    (``retokenize``: another vocabulary, or a guide that reads fewer tokens, sentence-transformers' rule)."""

    model: nn.Module
    retokenize: bool
    #: the trained model's tokenizer (it decodes the texts to re-tokenise)
    tokenizer: Any

    @staticmethod
    def must_retokenize(guide: nn.Module, model: nn.Module, model_tokenizer: Any) -> bool:
        """sentence-transformers' rule for a guide (or a teacher) of ``model``: it reads the texts re-tokenised
        when its vocabulary differs from ``model_tokenizer``'s or it reads fewer tokens than the model."""
        try:
            same_vocab = model_tokenizer.get_vocab() == cast(Any, guide).tokenizer.get_vocab()
        except AttributeError:
            return True
        return not same_vocab or getattr(guide, "max_seq_length", 0) < getattr(model, "max_seq_length", 0)

    def check(self, features: Sequence[Any], owner: str) -> None:
        """Refuse columns with images, videos or audio when the guide re-tokenises the decoded text, which
        holds none of them (sentence-transformers' guide drops them silently)."""
        if not self.retokenize:
            return
        media = {k: media_inputs(f) for k, f in enumerate(features) if media_inputs(f)}
        if media:
            raise ValueError(
                f"{owner}: the guide reads another vocabulary (or fewer tokens) than the model, so its inputs are "
                "re-tokenised from the decoded text, which holds no images, videos or audio; column(s) "
                f"{sorted(media)} have {sorted({k for keys in media.values() for k in keys})}. Use a guide that "
                "reads the model's inputs (its processor and max_seq_length), or guide=None (the model guides "
                "itself)."
            )

    def embed(self, loss: CachedLoss, features: list[dict[str, Any]]) -> list[Tensor]:
        """The guide's embeddings of every column of the step, on the trained model's device."""
        guide = cast(Any, self.model)
        if self.retokenize:
            decode = self.tokenizer.batch_decode
            features = [
                guide.preprocess(decode(input_ids_by_row(f), skip_special_tokens=True)) for f in features
            ]
        device = model_device(guide)
        moved = [{k: v.to(device) if isinstance(v, Tensor) else v for k, v in f.items()} for f in features]
        with torch.no_grad():
            guided = loss.cache.embed(guide, moved)
        return [g.to(model_device(loss.model)) for g in guided]


@dataclass(eq=False, kw_only=True)
class InfoNCE(Stage):
    """InfoNCE over a loss's terms (see the module's notes).

    Args:
        owner: the loss's class name, for messages.
        terms: ``terms(n_columns=...)``: the logit terms of a step with ``n_columns`` candidate columns
            ([`st_cached_losses.functional.softmax.terms`][st_cached_losses.functional.softmax.terms]; a ``functools.partial`` of
            ``mnrl_terms`` / ``gist_terms``, which a loss's stage keeps picklable).
        similarity: the core's score (``"cosine"``, ``"dot"``, a function, a token score).
        scale: the scale when it is not learned (``step.inputs["scale"]`` otherwise).
        plan: the loss stage's plan, whole (``settings.plan()``: the path, across processes ``"tiled"`` the
            ring exchange and the others a gather; the tile size; the memory budget; the products' precision).
        gather: score each process's rows against every process's candidates.
        in_batch: every row's candidates (default), or each row's own only (a batch then needs hard-negative
            columns).
        mask_duplicates: mask false negatives found by equal inputs (keys from the features).
        bank: a negative bank, read and filled by training steps.
        bank_anchors: the bank keeps past anchors too (the terms score rows against the anchors).
        guide: a [`GuideModel`][st_cached_losses.losses.stages.infonce.GuideModel], ``"self"`` (the step's
            own embeddings, detached), or None (unguided terms).
        form: the engine's cache form the stage reads (token rows).
        false_negatives: the false-negative filter
            ([`FalseNegativeFilter`][st_cached_losses.functional.softmax.options.FalseNegativeFilter]) of every call, or
            None; ``false_negative_count``: where its training calls count what it removed.
        false_negative_count: see ``false_negatives``.
        refuse_lists: the loss takes list-valued columns: ``refuse_lists(several, across)`` is the message
            refusing a batch with lists (``several``: several positives per row; ``across``: across processes)
            under the loss's settings, None where they are taken. Across processes every process learns in the
            step's first collective whether any has lists, so that all take the same path, or all raise.
    """

    plan_fields: ClassVar[frozenset[str]] = frozenset(PLAN_FIELDS)

    owner: str
    terms: Callable[..., TermSet]
    similarity: Any
    scale: float
    plan: Plan = DEFAULT_PLAN
    gather: bool = False
    in_batch: bool = True
    mask_duplicates: bool = False
    bank: NegativeBank | None = None
    bank_anchors: bool = False
    guide: GuideModel | str | None = None
    form: CacheForm | None = None
    false_negatives: FalseNegativeFilter | None = None
    false_negative_count: FalseNegativeCount | None = None
    refuse_lists: Callable[[bool, bool], str | None] | None = None

    def check(self, features: Sequence[Any]) -> None:
        check_columns(features, self.owner)
        if not self.in_batch:
            check_own_candidates(len(features), self.owner)
        if isinstance(self.guide, GuideModel):
            self.guide.check(features, self.owner)

    def prepare(self, loss: CachedLoss, features: list[Any], inputs: Sequence[Any]) -> StepData:
        if self.bank is not None and torch.is_grad_enabled():  # a training step begins: the bank ages
            self.bank.begin_step()
        if self.false_negative_count is not None and torch.is_grad_enabled():
            self.false_negative_count.begin_step()
        # false negatives are recognised by their token ids (embeddings differ under dropout)
        keys = [input_keys(f) for f in features] if self.mask_duplicates else None
        guide = self.guide.embed(loss, features) if isinstance(self.guide, GuideModel) else None
        return StepData(keys=keys, guide=guide)

    def with_embeddings(self, step: StepData, embeddings: list[Tensor]) -> StepData:
        """Self-guided: the model's own rows of the step, at full width and detached, are the guide's. In
        GradCache's stage 2 they are the first pass's rows, which the replay reproduces (its random state
        restored), so the mask is the one of the very forward that is differentiated; taken before
        ``calculate_loss``, so that a wrapper calling it on truncations (MatryoshkaLoss) guides every width with
        them, as ``GISTEmbedLoss`` with a frozen copy of the model as guide does."""
        if self.guide == SELF_GUIDED and step.guide is None:
            step.guide = [e.detach() for e in embeddings]
        return step

    def options(
        self,
        step: StepData,
        embeddings: list[Tensor],
        scale: float | Tensor,
        bank: Bank | None,
        count: bool = False,
    ) -> InfoNCEOptions:
        """The core's options of one call: the terms, the score, the scale, the plan, the keys of these rows
        (a wrapper may call the stage on other rows: it masks nothing then), the guide, the bank and the
        false-negative filter (``count``: a training call, whose removals the loss's count adds)."""
        n_rows, n_columns = len(embeddings[0]), len(embeddings) - 1
        keys = step.keys if step.keys is not None and len(step.keys[0]) == n_rows else None
        false_negatives = self.false_negatives
        if false_negatives is not None and count and self.false_negative_count is not None:
            false_negatives = replace(
                false_negatives, tally=self.false_negative_count.sink(embeddings[0].device)
            )
        return InfoNCEOptions(
            scale=scale,
            similarity=self.similarity,
            terms=self.terms(n_columns=n_columns),
            guide=self._guide(step, embeddings),
            **self.plan.options(),
            anchor_keys=keys[0] if keys is not None else None,
            candidate_keys=keys[1:] if keys is not None else None,
            bank=bank,
            # lists of hard negatives (each row its own number): candidates of every row, no row's own
            listed_negatives=step.counts is not None,
            false_negatives=false_negatives,
        )

    def _guide(self, step: StepData, embeddings: list[Tensor]) -> Guide | None:
        if self.guide is None:
            return None
        guide = step.guide
        fits = guide is not None and len(guide) == len(embeddings) and len(guide[0]) == len(embeddings[0])
        if self.guide == SELF_GUIDED:
            # the step's own full-width rows (``with_embeddings``); called directly (``calculate_loss`` without
            # the step's rows), the given ones, detached
            if guide is None or not fits:
                guide = [e.detach() for e in embeddings]
        elif guide is None or not fits:
            raise ValueError(
                f"{self.owner} needs the guide's embeddings of the same batch: call the loss on the features "
                "(loss(features, labels)), which embeds them with the guide, rather than calculate_loss directly."
            )
        return Guide(guide[0], guide[1:])

    def __call__(self, batch: StageInput, with_grad: bool) -> StageOutput:
        embeddings, step = batch.embeddings, batch.step
        if self._agrees_on_lists():
            full, kept = self._every_column(batch)
            # a list column this process did not embed: (0, d) rows, as every process has it
            if kept is not None:
                assert step.counts is not None  # a column left out is a list column
                counts: list[Tensor | None] = [None] * len(full)
                for k, c in zip(kept, step.counts):
                    counts[k] = c
                inner = replace(
                    step,
                    kept=None,
                    counts=counts,
                    guide=self._every_guide(step.guide, kept, len(full)),
                    keys=self._every_keys(step.keys, kept, len(full)),
                )
                every = self(StageInput(full, batch.labels, inner, batch.owner), with_grad)
                step.parts = inner.parts
                if every.grads is not None:
                    every.grads = [every.grads[k] for k in kept]
                return every
            sizes = batch.sizes(self.gather, self._lists_tag(step))
            listed = self._check_agreed_lists(batch.tag(self.gather))
            if batch.tag(self.gather) & 2:  # several positives on some process: every process scores pairs
                return self._several_positives(batch, with_grad, sizes)
        else:
            if several_positives(step) is not None:
                return self._several_positives(batch, with_grad)
            sizes = batch.sizes(self.gather)
            listed = step.counts is not None
        scale = step.inputs.get("scale", self.scale)
        # a training step scores this process's bank entries as extra negatives; then its rows join the bank
        bank = (
            self.bank.view(embeddings[0], self.bank_anchors) if with_grad and self.bank is not None else None
        )
        options = replace(self.options(step, embeddings, scale, bank, with_grad), listed_negatives=listed)
        ring = ring_path(self.plan.path)
        out = loss_and_grad(embeddings[0], embeddings[1:], sizes, options, ring=ring, with_grad=with_grad)
        if bank is not None:
            assert self.bank is not None
            self.bank.push(embeddings[0], embeddings[1:], self.bank_anchors)
        if not with_grad:
            return StageOutput(out.loss)
        assert out.grad_anchors is not None  # asked for
        grad_scale = out.grad_scale
        if grad_scale is not None and sizes is None:
            # each process scored only its own rows, and the scale belongs to the loss, outside any
            # wrapper: average its gradient as DDP / FSDP / DeepSpeed average the model's, or every
            # process would step to another scale (the gathered and ring paths average it themselves)
            grad_scale = mean_scale_grad(grad_scale)
        input_grads = {"scale": grad_scale} if grad_scale is not None else {}
        return StageOutput(out.loss, [out.grad_anchors, *out.grad_candidates], input_grads)

    def _agrees_on_lists(self) -> bool:
        """Whether the processes agree on lists in this stage's first collective: a loss that takes them,
        gathering across processes."""
        return self.refuse_lists is not None and self.gather and is_distributed()

    @staticmethod
    def _lists_tag(step: StepData) -> int:
        """This process's bits of the lists agreement: 1 lists, 2 several positives per row."""
        return (1 if step.counts is not None else 0) | (2 if several_positives(step) is not None else 0)

    def _check_agreed_lists(self, tag: int) -> bool:
        """Every process raises the same refusal where a process has lists the settings cannot take across
        processes; whether any has lists (all then score them as lists)."""
        if tag and self.refuse_lists is not None:
            message = self.refuse_lists(bool(tag & 2), True)
            if message:
                raise ValueError(f"{message} (a batch of some process holds lists; every process stops here)")
        return bool(tag)

    @staticmethod
    def _every_column(batch: StageInput) -> tuple[list[Tensor], list[int] | None]:
        """The step's columns with a ``(0, d)`` one where a list column was not embedded on this process (none
        of its rows here holds a text), and the embedded columns' indices among them (None: every column)."""
        return every_column(batch.embeddings, batch.step.kept, batch.step.given)

    @staticmethod
    def _every_guide(guide: list[Tensor] | None, kept: list[int], given: int) -> list[Tensor] | None:
        """A guide's embeddings of the embedded columns (``kept``) with a ``(0, d)`` one where a list column was
        not embedded, as [`_every_column`][st_cached_losses.losses.stages.infonce.InfoNCE._every_column] gives
        the rows (None, or another length: as given)."""
        if guide is None or len(guide) != len(kept):
            return guide
        return every_column(guide, kept, given)[0]

    @staticmethod
    def _every_keys(keys: list[Tensor] | None, kept: list[int], given: int) -> list[Tensor] | None:
        """The duplicate keys of the embedded columns (``kept``) with none (``(0,)``) where a list column was not
        embedded, as [`_every_column`][st_cached_losses.losses.stages.infonce.InfoNCE._every_column] gives the
        rows (None, or another length: as given)."""
        if keys is None or len(keys) != len(kept):
            return keys
        full = [keys[0][:0] for _ in range(given)]
        for k, key in zip(kept, keys):
            full[k] = key
        return full

    def _several_positives(
        self, batch: StageInput, with_grad: bool, sizes: list[int] | None = None
    ) -> StageOutput:
        """Several positives per row ([`positives`][st_cached_losses.functional.softmax.positives]): on one
        process, or across processes (``sizes``: every process's row count, agreed on) against every process's
        candidates, a process whose rows have one positive each scoring them as pairs too."""
        embeddings, step = batch.embeddings, batch.step
        counts = several_positives(step)
        if counts is None:  # one positive per row here, several on another process
            counts = torch.ones(len(embeddings[0]), dtype=torch.long)
        if sizes is None:
            batch.sizes(False)  # the finiteness check of the rows
        scale = step.inputs.get("scale", self.scale)
        options = self.options(step, embeddings, scale, None, with_grad)
        if sizes is None:
            out = several_positives_loss_and_grad(
                embeddings[0], embeddings[1:], counts, options, with_grad=with_grad
            )
        else:  # against every process's candidates, all-gathered or passed around the ring
            strategy = (
                ring_several_positives_loss_and_grad
                if ring_path(self.plan.path)
                else gathered_several_positives_loss_and_grad
            )
            out = strategy(embeddings[0], embeddings[1:], counts, sizes, options, with_grad=with_grad)
        if not with_grad:
            return StageOutput(out.loss)
        assert out.grad_anchors is not None  # asked for
        # each process's own rows: average the scale's gradient as DDP averages the model's (the gathered
        # and ring strategies average it themselves)
        grad_scale = mean_scale_grad(out.grad_scale) if sizes is None else out.grad_scale
        input_grads = {"scale": grad_scale} if grad_scale is not None else {}
        return StageOutput(out.loss, [out.grad_anchors, *out.grad_candidates], input_grads)

    def autograd(self, batch: StageInput) -> Tensor:
        """The core's InfoNCE with autograd (its backward recomputes the tiles); gathered with autograd
        across processes. Lists (several positives per row; across processes, lists on any process): the stage's
        gradients as the graph."""
        step = batch.step
        if self._agrees_on_lists():
            # lists agreed on in the step's first collective; lists on any process take the stage's path
            if step.kept is not None and len(step.kept) != step.given:
                return super().autograd(batch)
            batch.sizes(self.gather, self._lists_tag(step))
            if batch.tag(self.gather):
                return super().autograd(batch)
        elif several_positives(step) is not None:
            return super().autograd(batch)
        embeddings, step = batch.embeddings, batch.step
        sizes = batch.sizes(self.gather)
        scale = step.inputs.get("scale", self.scale)
        options = self.options(step, embeddings, scale, None, torch.is_grad_enabled())
        if sizes is None:
            if isinstance(scale, Tensor) and scale.requires_grad and is_distributed():
                # each process's own rows: average the scale's gradient as DDP averages the model's
                scale.register_hook(mean_scale_grad)
            return infonce(embeddings[0], embeddings[1:], options, check_finite=False)
        if Score(self.similarity).packed:  # token rows: every process's padded to one width per column
            embeddings = pad_to_common_tokens(embeddings)
        return gathered_infonce(embeddings[0], embeddings[1:], sizes, options)
