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

    A dataset has ``ceil(len(batch sampler) / group)`` groups (``drop_last=False``, the trainer's
    ``dataloader_drop_last``), or ``floor`` of it, at least 1 (``drop_last=True``: the incomplete group is
    dropped, as an incomplete batch is, unless it is the dataset's only one: no dataset is left out). Its
    groups hold its batch sampler's batches in the order it yields them, except where its batches do not fill
    its last group: there the largest of the last group's batches are cut in two (at an even row, so that
    ``group_by_label``'s pairs stay together) until every process has a batch, reaching into the groups before
    only when the last one holds fewer than two rows per batch (a batch of one row has no in-batch negative).
    A cut batch is a part of one the batch sampler made, so ``no_duplicates`` still holds in it.

    Guarantees, under accelerate's own sharding (``BatchSamplerShard``, ``even_batches`` on or off, as the
    trainer uses it) with any number of processes dividing ``world_size`` and the default, ``no_duplicates``,
    ``group_by_label`` or any other batch sampler (``tests/config/test_sampling.py`` checks each, a property
    test over random dataset sizes and duplicate patterns included):

    * Every process gets ``len(self) / N`` batches, the length the trainer plans its steps by: no process
      waits at a collective for a step the others do not take.
    * Each step (and each run of ``gradient_accumulation_steps`` steps) holds batches of one dataset on every
      process.
    * No row is twice in a group (a step on every process, or an optimizer step with
      ``gradient_accumulation_steps``): a row's copy would be a negative scored exactly as its positive. A row
      the batch sampler yields again in one epoch (``no_duplicates``' resampled passes) is trained once.
    * With ``drop_last=False`` and ``order="proportional"``, every row the datasets' batch samplers yield in
      the epoch is trained exactly once, wherever sentence-transformers' own sampler trains it (where a batch
      sampler yields more batches than its length, which only ``no_duplicates`` on data with many duplicates
      does, the shortest batches past the dataset's groups are left out with a warning, as sentence-
      transformers' samplers, stopping at that length, leave them out).

    The batches vary in length (a dataset's short last batch, ``no_duplicates``' and cut batches), so the
    sampler's ``batch_size`` is None, accelerate's word for it: given a batch size, accelerate's sharding
    withholds every ``N`` consecutive batches whose last is shorter, losing their rows (hence, also,
    accelerate's ``split_batches=True``, which needs a batch size, is not for this sampler: it already puts
    one batch, so one dataset, on every process). A dataset with fewer rows in an epoch than a group has
    batches cannot give every batch rows of its own: its rows repeat across the group's batches, with a
    warning. A batch sampler that runs out of rows before its length's batches (``no_duplicates`` with
    ``drop_last`` on rows of too few distinct values) has its dataset's remaining groups skipped, with a
    warning: the epoch ends earlier than planned, on every process alike.

    Args:
        dataset: the concatenation of the datasets (the trainer builds it from a ``DatasetDict``).
        batch_samplers: one batch sampler per dataset, in the same order (the trainer's, from
            ``batch_sampler``: the default, ``no_duplicates``, ``group_by_label`` or a custom one).
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
        # None: batches of any length (what accelerate's sharding reads; see the class's docstring)
        self.batch_size = None  # type: ignore[assignment]
        empty = [i for i, sampler in enumerate(batch_samplers) if len(sampler) == 0]
        if empty:
            warnings.warn(
                f"SameDatasetBatchSampler: dataset(s) {empty} (in the DatasetDict's order) hold no batch "
                f"(fewer rows than a batch with drop_last=True, or none): they are not trained on.",
                UserWarning,
                stacklevel=2,
            )
        tiny = [
            i
            for i, (rows, sampler) in enumerate(zip(_sizes(dataset), batch_samplers))
            if len(sampler) and rows < self.group_size
        ]
        if tiny:
            warnings.warn(
                f"SameDatasetBatchSampler: dataset(s) {tiny} (in the DatasetDict's order) hold fewer rows than "
                f"a group has batches ({self.group_size} = world_size x gradient_accumulation_steps), so their "
                "rows repeat within a step, where a row's copy is a negative as strong as its positive; give "
                "them more rows or train them apart.",
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
        counts, sizes = self.groups_per_dataset(), _sizes(self.dataset)
        streams: dict[int, Iterator[list[list[int]]]] = {}
        for d in self.dataset_order():
            if d not in streams:
                streams[d] = _dataset_groups(self.batch_samplers[d], sizes[d], counts[d], self.group_size, d)
            for batch in next(streams[d]):
                yield [offsets[d] + i for i in batch]


def _sizes(dataset: ConcatDataset) -> list[int]:
    """The rows of each dataset of the concatenation."""
    ends = list(dataset.cumulative_sizes)
    return [end - start for start, end in zip([0, *ends], ends)]


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


def _dataset_groups(
    sampler: BatchSampler, rows: int, groups: int, size: int, dataset: int
) -> Iterator[list[list[int]]]:
    """A dataset's ``groups`` groups of ``size`` batches for one epoch, from one pass of its batch sampler.

    A row the pass yields again is left out of the later batch (an emptied batch is skipped). A group is
    handed out as the sampler made it while more than a group of batches follows it; once the pass ends,
    what is left is fitted to the groups still due ([`_fit`][st_cached_losses.config.sampling._fit]). The pass
    is read at most about two groups ahead."""
    seen = bytearray(rows)
    source = iter(sampler)
    buffer: list[list[int]] = []
    yielded = 0  # batches the batch sampler yielded, emptied ones included
    done = False

    def pull() -> None:
        nonlocal done, yielded
        for batch in source:
            yielded += 1
            fresh = []
            for i in batch:
                if not seen[i]:
                    seen[i] = 1
                    fresh.append(i)
            if fresh:
                buffer.append(fresh)
                return
        done = True

    for g in range(groups):
        remaining = groups - g
        while not done and (remaining == 1 or len(buffer) < 2 * size):
            pull()
        if not done:  # at least a group more follows this one: it goes as the sampler made it
            yield buffer[:size]
            del buffer[:size]
            continue
        if not buffer:  # every process alike: the epoch ends earlier than planned, on all of them
            warnings.warn(
                f"SameDatasetBatchSampler: the batch sampler of dataset {dataset} yielded no more rows in this "
                f"epoch, where its length ({len(sampler)} batches) promised {remaining} more group(s) of {size} "
                "batches: they are skipped, so this epoch is shorter than the trainer planned (no_duplicates "
                "with drop_last yields no batch from rows of too few distinct values).",
                UserWarning,
                stacklevel=2,
            )
            for _ in range(remaining):
                yield []
            return
        extra = len(buffer) - remaining * size
        if extra > 0 and yielded > len(sampler):
            dropped = sorted(len(b) for b in buffer)[:extra]
            warnings.warn(
                f"SameDatasetBatchSampler: the batch sampler of dataset {dataset} yielded {yielded} batches in "
                f"this epoch, more than its length ({len(sampler)}), by which the trainer plans its steps; its "
                f"{extra} shortest batches past the dataset's groups ({sum(dropped)} rows) are not trained on in "
                "this epoch, as sentence-transformers' own samplers, stopping at that length, leave them out "
                "(no_duplicates makes extra short batches on data with many duplicate values).",
                UserWarning,
                stacklevel=2,
            )
        plan = _fit(buffer, remaining, size, dataset)
        for k in range(remaining):
            yield plan[k * size : (k + 1) * size]
        return


def _fit(batches: list[list[int]], groups: int, size: int, dataset: int) -> list[list[int]]:
    """``batches`` (in order, none empty) made into exactly ``groups x size`` batches.

    Too many: the shortest are left out (the latest of equal ones: ``drop_last``'s incomplete group). Too few:
    the fewest trailing groups whose rows can give each of their batches two rows (else one) keep the batches
    before them as they are, and their largest batch (the latest of equal ones) is cut in two until they are
    enough. Fewer rows than batches: each batch one row, the rows repeated (warned)."""
    target = groups * size
    if len(batches) >= target:
        by_length = sorted(range(len(batches)), key=lambda j: (len(batches[j]), -j))
        dropped = set(by_length[: len(batches) - target])
        return [b for j, b in enumerate(batches) if j not in dropped]
    # the fewest trailing groups whose rows give each of their batches two rows (a batch of one row has no
    # in-batch negative), else one
    fits = (
        ((groups - trailing) * size, trailing)
        for need in (2, 1)
        for trailing in range(1, groups + 1)
        if (groups - trailing) * size < len(batches)
        and sum(len(b) for b in batches[(groups - trailing) * size :]) >= need * trailing * size
    )
    start, trailing = next(fits, (-1, 0))
    if start < 0:
        rows = [i for b in batches for i in b]
        warnings.warn(
            f"SameDatasetBatchSampler: dataset {dataset} has {len(rows)} rows left in this epoch for {target} "
            "batches, so its rows repeat within a step (a row's copy is a negative as strong as its positive).",
            UserWarning,
            stacklevel=3,
        )
        return [[rows[k % len(rows)]] for k in range(target)]
    head, tail = batches[:start], list(batches[start:])
    while len(tail) < trailing * size:
        j = max(range(len(tail)), key=lambda k: (len(tail[k]), k))
        cut = _cut(len(tail[j]))
        tail[j : j + 1] = [tail[j][:cut], tail[j][cut:]]
    return head + tail


def _cut(length: int) -> int:
    """Where a batch of ``length >= 2`` rows is cut: half, rounded up to an even row where both parts keep a
    row (``group_by_label`` lays its rows out in pairs of one label: a part of 2k rows keeps them whole)."""
    cut = (length + 1) // 2
    if length % 2 == 0 and cut % 2 and cut + 1 < length:
        cut += 1
    return cut
