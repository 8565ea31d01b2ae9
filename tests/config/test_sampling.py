"""SameDatasetBatchSampler on its own (no processes): accelerate's own sharding (``BatchSamplerShard``, as the
trainer configures it: ``even_batches=False``) gives every process a batch of the same dataset at every step,
with datasets of uneven sizes, ``drop_last`` on and off, 1 to 4 processes and gradient accumulation; every
dataset (with ``drop_last=False`` every row) is trained on; the order is the seed's on every process and a
resume (accelerate's ``SkipBatchSampler``) continues it. sentence-transformers' ``RoundRobinBatchSampler``
under the same sharding mixes datasets (what the sampler is for)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from sentence_transformers.base.sampler import (
    DefaultBatchSampler,
    NoDuplicatesBatchSampler,
    RoundRobinBatchSampler,
)
from torch.utils.data import ConcatDataset, RandomSampler

from st_cached_losses import SameDatasetBatchSampler

SIZES = (37, 14, 5)  # rows; batch 4: 10 batches (last of 1), 4 (last of 2), 2 (last of 1)
BATCH = 4


def _build(
    sizes=SIZES, batch=BATCH, drop_last=False, cls=SameDatasetBatchSampler, seed=7, duplicates=False, **kw
):
    """The sampler as the trainer builds it: one generator shared by the datasets' batch samplers."""
    datasets = [[{"text": f"d{d}r{i}"} for i in range(n)] for d, n in enumerate(sizes)]
    generator = torch.Generator().manual_seed(seed)
    if duplicates:
        from datasets import Dataset

        datasets = [Dataset.from_list(rows) for rows in datasets]
        samplers = [
            NoDuplicatesBatchSampler(
                ds, batch_size=batch, drop_last=drop_last, generator=generator, seed=seed
            )
            for ds in datasets
        ]
    else:
        samplers = [
            DefaultBatchSampler(
                RandomSampler(ds, generator=generator), batch_size=batch, drop_last=drop_last, seed=seed
            )
            for ds in datasets
        ]
    return cls(ConcatDataset(datasets), samplers, generator=generator, seed=seed, **kw)


def _dataset_of(index: int, sizes=SIZES) -> int:
    ends = list(itertools.accumulate(sizes))
    return next(d for d, end in enumerate(ends) if index < end)


def _shards(make, world: int, skip: int = 0) -> list[list[list[int]]]:
    """Each process's batches, from its own sampler (same seed), sharded as the trainer's accelerate does
    (one process: not sharded)."""
    out = []
    for rank in range(world):
        shard = make() if world == 1 else BatchSamplerShard(make(), world, rank, even_batches=False)
        out.append(list(SkipBatchSampler(shard, skip) if skip else shard))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("order", ["proportional", "round_robin"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_every_step_holds_one_dataset_on_every_process(world, drop_last, order, accumulation):
    make = functools.partial(
        _build, drop_last=drop_last, order=order, world_size=world, gradient_accumulation_steps=accumulation
    )
    shards = _shards(make, world)
    steps = len(shards[0])
    # no process waits for a step the others do not take, and the length the trainer plans with is right
    assert all(len(s) == steps for s in shards) and steps > 0
    assert steps * world == len(make())
    if world > 1:
        assert all(
            len(s) == len(BatchSamplerShard(make(), world, r, even_batches=False))
            for r, s in enumerate(shards)
        )
    step_datasets = []
    for step in range(steps):
        batches = [shards[r][step] for r in range(world)]
        datasets = {_dataset_of(i) for batch in batches for i in batch}
        assert len(datasets) == 1, (step, batches)
        step_datasets.append(datasets.pop())
        assert all(0 < len(b) <= BATCH for b in batches)
        if drop_last:
            assert all(len(b) == BATCH for b in batches)
    # an optimizer step (gradient_accumulation_steps micro-steps) on one dataset too
    for start in range(0, steps, accumulation):
        assert len(set(step_datasets[start : start + accumulation])) == 1
    assert steps % accumulation == 0
    assert set(step_datasets) == {0, 1, 2}, "every dataset is trained on"
    seen = {i for s in shards for batch in s for i in batch}
    if not drop_last and order == "proportional":
        assert seen == set(range(sum(SIZES))), "every row of every dataset is trained on"
    if order == "round_robin":  # one group of each dataset in turn
        groups = step_datasets[::accumulation]
        assert groups == [0, 1, 2] * (len(groups) // 3)


@pytest.mark.parametrize("drop_last", [False, True])
def test_group_counts_and_the_short_batch(drop_last):
    sampler = _build(drop_last=drop_last, world_size=3)
    batches = list(sampler)
    # drop_last=False: 10, 4 and 2 batches -> ceil(/3) = 4, 2, 1 groups; True: 9, 3, 1 -> floor 3, 1 and
    # (the only one, kept) 1
    assert sampler.groups_per_dataset() == ([4, 2, 1] if not drop_last else [3, 1, 1])
    assert len(batches) == len(sampler) == 3 * sum(sampler.groups_per_dataset())
    short = [(k, len(b)) for k, b in enumerate(batches) if len(b) < BATCH]
    if drop_last:
        assert short == []
    else:  # each dataset's short last batch, first in its group (process 0's)
        assert sorted(n for _, n in short) == [1, 1, 2] and all(k % 3 == 0 for k, _ in short)


def test_a_dataset_smaller_than_a_group_or_a_batch_is_kept():
    # drop_last=True: dataset 0 has no batch at all (3 rows < 4): left out, with a warning at build time
    with pytest.warns(UserWarning, match=r"dataset\(s\) \[0\]"):
        sampler = _build(sizes=(3, 30), world_size=4, drop_last=True)
    assert sampler.groups_per_dataset() == [0, 1]
    assert len(sampler) == len(list(sampler)) == 4  # dataset 1's one group
    with pytest.warns(UserWarning, match="not trained on"):
        robin = _build(sizes=(3, 30), world_size=4, drop_last=True, order="round_robin")
    assert len(robin) == len(list(robin)) == 4  # the empty dataset does not stop the other
    sampler = _build(sizes=(3, 30), world_size=4, drop_last=False)
    batches = list(sampler)
    first = [b for b in batches if all(i < 3 for i in b)]
    # its one short batch (3 rows) and three full batches re-drawn from new passes (rows repeat)
    assert len(first) == 4 and sorted(len(b) for b in first) == [3, 4, 4, 4]


def test_the_order_is_the_seeds_on_every_process_and_changes_with_the_epoch():
    a, b = _build(world_size=2), _build(world_size=2)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again (the same epoch) repeats it
    c = _build(world_size=2)
    c.set_epoch(1)
    assert list(c) != list(a)
    assert list(_build(world_size=2, seed=8)) != list(a)


@pytest.mark.parametrize("world", [2, 3])
def test_a_resume_skipping_batches_continues_the_order(world):
    make = functools.partial(_build, world_size=world, gradient_accumulation_steps=2)
    full = _shards(make, world)
    resumed = _shards(make, world, skip=4)
    assert all(resumed[r] == full[r][4:] for r in range(world))


def test_no_duplicates_batches_within_batches():
    make = functools.partial(_build, world_size=2, duplicates=True)
    shards = _shards(make, 2)
    assert all(len({_dataset_of(i) for i in shards[0][s] + shards[1][s]}) == 1 for s in range(len(shards[0])))
    assert all(len(set(b)) == len(b) for s in shards for b in s)


def test_round_robin_of_sentence_transformers_mixes_datasets_across_processes():
    """The failure the sampler fixes: accelerate gives each process every N-th batch of one stream."""
    shards = _shards(functools.partial(_build, cls=RoundRobinBatchSampler), 2)
    mixed = [s for s in range(len(shards[0])) if _dataset_of(shards[0][s][0]) != _dataset_of(shards[1][s][0])]
    assert mixed


def test_the_world_size_is_read_from_the_running_processes():
    assert _build().world_size == 1 and _build().group_size == 1
    with pytest.raises(ValueError, match="order must be 'proportional' or 'round_robin'"):
        _build(order="random")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a whole number >= 1"):
        _build(gradient_accumulation_steps=0)


# ---------------------------------------------------------------------- through the arguments and the command line


@pytest.mark.parametrize("source", ["python", "command line", "yaml"])
def test_same_dataset_from_the_arguments_the_command_line_and_yaml(tmp_path, source):
    import pickle
    import warnings

    from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments

    fields = {
        "output_dir": str(tmp_path),
        "multi_dataset_batch_sampler": "same_dataset",
        "same_dataset_order": "round_robin",
        "same_dataset_per_optimizer_step": True,
        "gradient_accumulation_steps": 4,
        "per_device_train_batch_size": 64,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mini_batch_size vs batch: not this test's
        if source == "python":
            args = CachedLossTrainingArguments(**fields)
        elif source == "command line":
            argv = [x for k, v in fields.items() for x in (f"--{k}", str(v).lower())]
            (args,) = CachedLossArgumentParser().parse_command_line(argv)
        else:
            (tmp_path / "run.yaml").write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in fields.items()))
            (args,) = CachedLossArgumentParser().parse_yaml_file(tmp_path / "run.yaml")
    chosen = args.multi_dataset_batch_sampler
    assert chosen.func is SameDatasetBatchSampler
    assert chosen.keywords == {"order": "round_robin", "gradient_accumulation_steps": 4}
    # the checkpoint's training_args.bin holds it; the JSON / card leave the callable out, as for any
    assert pickle.loads(pickle.dumps(args)).multi_dataset_batch_sampler.keywords == chosen.keywords
    assert "multi_dataset_batch_sampler" not in args.to_dict()
    sampler = chosen(
        ConcatDataset([[0] * 8, [1] * 8]),
        batch_samplers=[DefaultBatchSampler(range(8), 2, False), DefaultBatchSampler(range(8), 2, False)],
        generator=torch.Generator(),
        seed=0,
    )
    assert sampler.group_size == 4 and sampler.order == "round_robin"


def test_the_options_without_the_sampler_and_a_bad_order_are_errors(tmp_path):
    from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments

    with pytest.raises(
        ValueError, match="same_dataset_order applies to multi_dataset_batch_sampler='same_dataset' only"
    ):
        CachedLossTrainingArguments(output_dir=str(tmp_path), same_dataset_order="round_robin")
    with pytest.raises(ValueError, match="same_dataset_order must be 'proportional' or 'round_robin'"):
        CachedLossTrainingArguments(
            output_dir=str(tmp_path), multi_dataset_batch_sampler="same_dataset", same_dataset_order="random"
        )
    # the stock values still work; --help names the new choice
    args = CachedLossTrainingArguments(output_dir=str(tmp_path), multi_dataset_batch_sampler="round_robin")
    assert args.multi_dataset_batch_sampler.value == "round_robin"
    assert "'same_dataset': SameDatasetBatchSampler" in CachedLossArgumentParser().format_help().replace(
        "\n", " "
    )
