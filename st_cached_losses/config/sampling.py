"""One dataset per global batch: a multi-dataset batch sampler under which every process trains on the same
dataset in each step.

With several training datasets, sentence-transformers' ``ROUND_ROBIN`` and ``PROPORTIONAL`` samplers order
the batches of one stream, and accelerate hands process ``k`` of ``N`` the batches ``k, k + N, k + 2N, ...``
of that stream: in one step each process holds a batch of a different dataset, so negatives gathered across
processes mix tasks and each process calls a different loss of a dict of losses.
`SameDatasetBatchSampler` emits the batches in groups of ``N`` (times the gradient accumulation steps,
by an option) consecutive batches of one dataset, so that accelerate's sharding gives every process a batch
of the same dataset at every step. FlagEmbedding's ``same_dataset_within_batch`` and PyLate's
``split_batches`` work-around do this elsewhere.

Give the class to the stock trainer's arguments (``multi_dataset_batch_sampler=SameDatasetBatchSampler``), a
``functools.partial`` of it for its options, or ``multi_dataset_batch_sampler="same_dataset"`` to
[`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] (and the command line).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from sentence_transformers.base.sampler import MultiDatasetDefaultBatchSampler
from torch.utils.data import BatchSampler, ConcatDataset

__all__ = ["DATASET_ORDERS", "SameDatasetBatchSampler", "current_world_size"]

#: how the groups of batches choose their dataset
DATASET_ORDERS = ("proportional", "round_robin")


def current_world_size() -> int:
    """The number of training processes: accelerate's (once an ``Accelerator`` exists, as it does when the
    trainer builds its data loader), else the initialised ``torch.distributed`` group's, else 1."""
    from accelerate.state import AcceleratorState, is_initialized

    if is_initialized():
        return int(AcceleratorState().num_processes)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


class SameDatasetBatchSampler(MultiDatasetDefaultBatchSampler):
    """Batches of several datasets such that every process trains on the same dataset in each step.

    The batches come in *groups* of ``world_size x gradient_accumulation_steps`` consecutive batches of one
    dataset. Accelerate gives process ``k`` the batches ``k, k + N, ...`` of the stream (``N`` processes), so
    each step, and with ``gradient_accumulation_steps`` set to the trainer's, each optimizer step, holds
    batches of one dataset on every process: in-batch negatives gathered across processes come from one task,
    and every process calls the same loss of a dict of losses.

    The order of the groups depends on the seed and the epoch only, so it is the same on every process and
    after a resume from a checkpoint (the trainer skips the batches already seen; in a later epoch too, whose
    number the sampler reads from the resumed data loader, the trainer giving it to neither wrapper):

    * ``order="proportional"`` (sentence-transformers' default): the groups of all datasets in a random
      order, a dataset with more groups chosen more often; every batch of every dataset is trained on.
    * ``order="round_robin"``: one group of each dataset in turn, until the dataset with the fewest groups
      is exhausted (each dataset trained on equally, as sentence-transformers' ``ROUND_ROBIN``; a dataset
      without a single batch is left out, with a warning, rather than stopping the others).

    A dataset whose batches do not fill its last group: with ``drop_last=False`` (the trainer's
    ``dataloader_drop_last``) the group is completed with batches re-drawn from a new pass over that dataset
    (so every process gets a batch of it and every row is trained on); with ``drop_last=True`` the
    incomplete group is dropped, unless it is the dataset's only one (a dataset is never left out). The
    re-drawn batches are full (a dataset with fewer rows than a batch repeats rows in them). A dataset's
    short last batch (``drop_last=False``) goes first in its group: accelerate withholds a group of ``N``
    whose last batch is short, so it lands on process 0, which takes a shorter batch (the cached losses
    weight every process's rows exactly). The stream always holds a multiple of ``N`` batches, so no
    process waits for a step the others do not take.

    Args:
        dataset: the concatenation of the datasets (the trainer builds it from a ``DatasetDict``).
        batch_samplers: one batch sampler per dataset, in the same order (the trainer's, from
            ``batch_sampler``; ``no_duplicates`` works).
        generator: the generator the batch samplers draw from; reseeded with ``seed + epoch`` at every epoch.
        seed: the seed of the order (the trainer passes ``args.seed``).
        order: ``"proportional"`` or ``"round_robin"``, see above.
        gradient_accumulation_steps: the micro-batches per process that share a dataset: 1 (default) keeps
            each step on one dataset; the trainer's ``gradient_accumulation_steps`` keeps each optimizer step
            on one dataset.
        world_size: the number of processes; default (None): read when the sampler is built, from
            accelerate (the trainer builds it after its ``Accelerator``), else ``torch.distributed``, else
            1. Any multiple of the real number of processes is correct too.

    Raises:
        ValueError: for an unknown ``order``, a count below 1, or (when iterated) a ``world_size`` that is
            no multiple of the number of processes running.

    Example:

    ```python
    import functools
    from st_cached_losses import SameDatasetBatchSampler

    args = SentenceTransformerTrainingArguments(
        output_dir="out",
        multi_dataset_batch_sampler=SameDatasetBatchSampler,  # or, with its options:
        # functools.partial(SameDatasetBatchSampler, order="round_robin", gradient_accumulation_steps=4)
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=DatasetDict(...), loss=...)
    ```
    """

    def __init__(
        self,
        dataset: ConcatDataset,
        batch_samplers: list[BatchSampler],
        generator: torch.Generator | None = None,
        seed: int = 0,
        *,
        order: str = "proportional",
        gradient_accumulation_steps: int = 1,
        world_size: int | None = None,
    ) -> None:
        super().__init__(dataset, batch_samplers, generator=generator, seed=seed)
        if order not in DATASET_ORDERS:
            raise ValueError(
                f"order must be 'proportional' or 'round_robin' (how the datasets take turns), got {order!r}."
            )
        for name, value in (
            ("gradient_accumulation_steps", gradient_accumulation_steps),
            ("world_size", world_size),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}.")
        self.order = order
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size = current_world_size() if world_size is None else world_size
        empty = [i for i, sampler in enumerate(batch_samplers) if len(sampler) == 0]
        if empty:
            warnings.warn(
                f"SameDatasetBatchSampler: dataset(s) {empty} (in the DatasetDict's order) hold no batch "
                f"(fewer rows than a batch with drop_last=True, or none): they are not trained on.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def group_size(self) -> int:
        """Consecutive batches of one dataset: ``world_size x gradient_accumulation_steps``."""
        return self.world_size * self.gradient_accumulation_steps

    def groups_per_dataset(self) -> list[int]:
        """Each dataset's number of groups in an epoch (from its batch sampler's length)."""
        size = self.group_size
        counts = []
        for sampler in self.batch_samplers:
            batches = len(sampler)
            if batches == 0:
                counts.append(0)
            elif self.drop_last:
                counts.append(max(1, batches // size))
            else:
                counts.append(-(-batches // size))
        return counts

    def dataset_order(self) -> list[int]:
        """The dataset of each group of this epoch, in order (the same on every process)."""
        counts = self.groups_per_dataset()
        if self.order == "round_robin":  # a dataset without a batch is left out (it would stop every other)
            kept = [d for d, count in enumerate(counts) if count]
            return [d for _ in range(min((counts[d] for d in kept), default=0)) for d in kept]
        chosen = [d for d, count in enumerate(counts) for _ in range(count)]
        # a generator of its own: the order does not depend on how much the batch samplers draw
        generator = torch.Generator().manual_seed(self._seed + self.epoch)
        return [chosen[i] for i in torch.randperm(len(chosen), generator=generator).tolist()]

    @property
    def _seed(self) -> int:
        return 0 if self.seed is None else int(self.seed)

    def __len__(self) -> int:
        counts = [count for count in self.groups_per_dataset() if count]
        groups = min(counts, default=0) * len(counts) if self.order == "round_robin" else sum(counts)
        return groups * self.group_size

    def __iter__(self) -> Iterator[list[int]]:
        resumed = _resumed_epoch()
        if resumed is not None and resumed != self.epoch:
            self.set_epoch(resumed)  # the datasets' batch samplers too
        running = current_world_size()
        if self.group_size % running != 0:
            raise ValueError(
                f"SameDatasetBatchSampler: world_size={self.world_size} (x gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}) is no multiple of the {running} processes running, so "
                "processes would train on different datasets in a step; leave world_size=None (read from "
                "accelerate) or set it to the number of processes."
            )
        if self.generator is not None:
            self.generator.manual_seed(self._seed + self.epoch)
        offsets = [0, *self.dataset.cumulative_sizes]
        streams: dict[int, Iterator[list[int]]] = {}
        for d in self.dataset_order():
            if d not in streams:
                streams[d] = _batches_then_refills(self.batch_samplers[d], self.batch_size, d)
            group = [next(streams[d]) for _ in range(self.group_size)]
            # accelerate withholds a group of N whose last batch is short: a short one goes first
            group.sort(key=lambda batch: len(batch) == self.batch_size)
            for batch in group:
                yield [offsets[d] + i for i in batch]


def _resumed_epoch() -> int | None:
    """The epoch of the trainer's data loader when it resumes mid-epoch from a checkpoint, else None.

    Resuming, the trainer wraps the sharded sampler in accelerate's ``SkipBatchSampler`` and sets the epoch
    on the data loader, which passes it to neither wrapper's sampler: this sampler would start every resumed
    epoch in epoch 0's order (and so would sentence-transformers' own samplers). The data loader being
    iterated (accelerate's ``GradientState().active_dataloader``, registered before it draws its first batch)
    holds the epoch as its ``iteration``; only a loader that skips batches (a resumed one: evaluation loaders
    never do) is read, so that evaluations keep their one order."""
    from accelerate.data_loader import SkipBatchSampler
    from accelerate.state import GradientState, is_initialized

    if not is_initialized():
        return None
    references = GradientState().dataloader_references
    loader = references[-1] if references else None
    if loader is None or not isinstance(getattr(loader, "batch_sampler", None), SkipBatchSampler):
        return None
    iteration = getattr(loader, "iteration", None)
    return iteration if isinstance(iteration, int) else None


def _batches_then_refills(sampler: BatchSampler, batch_size: int, dataset: int) -> Iterator[list[int]]:
    """A dataset's batches for one epoch, then, to complete its last group, full batches cut from further
    passes over it (the indices of consecutive passes, so a dataset smaller than a batch repeats rows)."""
    yield from sampler
    pending: list[int] = []
    while True:
        drawn = False
        for batch in sampler:
            drawn = True
            pending.extend(batch)
            while len(pending) >= batch_size:
                yield pending[:batch_size]
                pending = pending[batch_size:]
        if not drawn:
            raise ValueError(
                f"SameDatasetBatchSampler: the batch sampler of dataset {dataset} yields no batch when drawn "
                "again, so its last group cannot be completed; use a batch sampler that can be iterated more "
                "than once (every sentence-transformers sampler can)."
            )
