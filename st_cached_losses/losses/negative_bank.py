"""A loss's negative bank (ContAccum-style): the embeddings of this process's last rows, kept without
gradient and scored by the next steps as extra negatives ([`Bank`][st_cached_losses.functional.softmax.options.Bank]).

Gradient accumulation gives a small batch the memory of a large one but not its negatives: each
micro-batch sees only its own rows. A bank adds the last ``size`` candidate embeddings (positives and hard
negatives, and for a loss that scores positives against the anchors, the last ``size`` anchors) of the
previous steps as extra negative columns, streamed through the same tiles as the batch's own columns.

The rules, stated once:

* A *step* is one training call of the loss (a forward with gradients): one optimizer step, or one
  micro-batch of it under gradient accumulation. Evaluation neither reads nor fills the bank.
* A step scores its rows against the entries the bank holds when it starts, then adds its own rows'
  embeddings (detached, as the encoder gave them) and keeps the newest ``size``; a step never sees its own
  rows in the bank.
* An entry's *age* is the number of steps since the step that added it (1 at the next step). With
  ``max_age``, entries older than ``max_age`` steps are dropped at the start of each step: entries embedded
  by a model more than ``max_age`` updates ago are stale, and a stale negative is an easy one. ``max_age=1``
  keeps only the previous step's rows.
* Each process keeps its own rows (the bank is sharded like the batch); across processes the loss stage
  exchanges the shares as it exchanges the candidates.
* Embeddings of another width (``MatryoshkaLoss`` calling the loss at several dimensions) each have a bank
  of their own, aged together.

The bank is a submodule of its loss (``loss.negative_bank``) whose state is its extra state
(``get_extra_state``): ``loss.state_dict()`` holds it (``negative_bank._extra_state``), and a state dict saved
before it was there loads with the bank as it is.
[`LossStateCallback`][st_cached_losses.losses.callbacks.LossStateCallback] reads it from there and saves each
process's share with each checkpoint (one file per process), restores it on ``resume_from_checkpoint`` and
logs its size and age."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from st_cached_losses.functional.softmax.options import Bank

__all__ = ["NegativeBank"]


@dataclass
class _Entries:
    """The newest rows of one kind (candidates or anchors) at one width, with the step that added each."""

    rows: Tensor  # (n, d), detached
    added: Tensor  # (n,) long

    def keep(self, mask: Tensor) -> None:
        self.rows, self.added = self.rows[mask], self.added[mask]

    def push(self, rows: Tensor, step: int, size: int) -> None:
        added = torch.full((rows.shape[0],), step, dtype=torch.long, device=rows.device)
        rows = rows.detach().to(self.rows.device, self.rows.dtype)
        self.rows = torch.cat([self.rows, rows])[-size:]
        self.added = torch.cat([self.added, added.to(self.added.device)])[-size:]


class NegativeBank(nn.Module):
    """One process's negative bank of a loss (see the module's rules).

    Args:
        size: entries kept of each kind (candidates; anchors where the loss reads them), per process;
            0: no bank.
        max_age: steps an entry may age before it is dropped; None: only ``size`` decides.
    """

    def __init__(self, size: int = 0, max_age: int | None = None) -> None:
        super().__init__()
        self.size, self.max_age = size, max_age
        #: training steps begun (the age's clock)
        self.step = 0
        self._banks: dict[tuple[str, int], _Entries] = {}

    def begin_step(self) -> None:
        """A training step begins: the clock advances and entries past ``max_age`` are dropped."""
        self.step += 1
        self._expire()

    def _expire(self) -> None:
        if self.max_age is None:
            return
        for entries in self._banks.values():
            entries.keep(self.step - entries.added <= self.max_age)

    def resize(self, size: int, max_age: int | None) -> None:
        """New limits: the newest ``size`` entries of each kind are kept, and those past ``max_age``."""
        self.size, self.max_age = size, max_age
        if size == 0:
            self._banks.clear()
        for entries in self._banks.values():
            n = entries.added.shape[0]
            entries.keep(torch.arange(n, device=entries.added.device) >= n - size)
        self._expire()

    def clear(self) -> None:
        """Forget every entry (the clock keeps running)."""
        self._banks.clear()

    def view(self, like: Tensor, with_anchors: bool) -> Bank:
        """This process's entries at the width of ``like`` (``(b, d)`` embeddings) as the core's
        [`Bank`][st_cached_losses.functional.softmax.options.Bank], in ``like``'s dtype and device (empty: no
        entries yet); the anchors only ``with_anchors``."""

        def rows(kind: str) -> Tensor:
            entries = self._banks.get((kind, like.shape[1]))
            if entries is None:
                return like.detach()[:0]
            if entries.rows.device != like.device:  # restored from a checkpoint onto the CPU: moved once
                entries.rows, entries.added = entries.rows.to(like.device), entries.added.to(like.device)
            return entries.rows.to(like.dtype)

        # imported here: the callbacks checkpoint banks for every loss, and a loss outside the InfoNCE family
        # (SigLIP's) loads nothing of that family
        from st_cached_losses.functional.softmax.options import Bank

        return Bank(rows("candidates"), rows("anchors") if with_anchors else None)

    def push(self, anchors: Tensor, candidates: list[Tensor], with_anchors: bool) -> None:
        """Add one step's rows: every candidate column's embeddings row by row (row ``i``'s positive,
        then its hard negatives: the newest rows are kept whole), and the anchors ``with_anchors``. Columns of
        other lengths (lists of hard negatives, each row its own number) are added column after column: the
        positives, then the listed negatives."""
        if self.size == 0:
            return
        d = anchors.shape[1]
        if len({len(c) for c in candidates}) == 1:
            flat = torch.stack(candidates, dim=1).flatten(0, 1)  # (b * K, d), row-major
        else:
            flat = torch.cat(candidates)
        kinds = [("candidates", flat)]
        if with_anchors:
            kinds.append(("anchors", anchors))
        for kind, rows in kinds:
            entries = self._banks.get((kind, d))
            if entries is None:
                empty = rows.detach()[:0].clone()
                entries = self._banks[kind, d] = _Entries(
                    empty, torch.zeros(0, dtype=torch.long, device=rows.device)
                )
            entries.push(rows, self.step, self.size)

    def stats(self) -> dict[str, float]:
        """For the logs: the entries held (candidates, every width), their mean age and the oldest's age, in steps."""
        added = [e.added for (kind, _), e in self._banks.items() if kind == "candidates" and e.added.numel()]
        if not added:
            return {"negative_bank_rows": 0.0, "negative_bank_age": 0.0, "negative_bank_oldest": 0.0}
        ages = self.step - torch.cat(added).double()
        return {
            "negative_bank_rows": float(ages.numel()),
            "negative_bank_age": float(ages.mean()),
            "negative_bank_oldest": float(ages.max()),
        }

    def get_extra_state(self) -> dict[str, Any]:
        """The clock and every entry, on the CPU (what a checkpoint holds of this process's bank, and what
        ``loss.state_dict()`` holds of it)."""
        return {
            "step": self.step,
            "entries": {
                f"{kind}/{d}": {"rows": e.rows.detach().cpu(), "added": e.added.cpu()}
                for (kind, d), e in self._banks.items()
            },
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore a [`get_extra_state`][st_cached_losses.losses.negative_bank.NegativeBank.get_extra_state]
        (onto the CPU: moved to the embeddings' device when read); the current limits apply to it."""
        self.step = int(state["step"])
        self._banks = {}
        for key, e in state["entries"].items():
            kind, d = key.rsplit("/", 1)
            self._banks[kind, int(d)] = _Entries(e["rows"].to("cpu"), e["added"].to("cpu"))
        self.resize(self.size, self.max_age)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # a loss's state dict saved before its bank was part of it (or without one) loads: the bank as it is
        state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"size={self.size}, max_age={self.max_age}"
