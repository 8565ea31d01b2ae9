"""SameDatasetBatchSampler on its own (no processes), under accelerate's own sharding (``BatchSamplerShard``, as the
trainer configures it: ``even_batches=False``; ``True`` too), 1 to 4 shards, gradient accumulation 1 to 3,
``drop_last`` on and off, sentence-transformers' default, no-duplicates and group-by-label batch samplers, and a
property test over random dataset sizes and duplicate patterns. What the sampler's docstring promises:

* every process the same number of batches, ``len(sampler) / N``;
* every step, and every optimizer step, on one dataset;
* no row twice in a group (an optimizer step on every process), no row twice in an epoch;
* with ``drop_last=False`` (proportional order) every row a dataset's batch sampler yields trained exactly once,
  wherever sentence-transformers' own sampler trains it (its pass holds no more batches than its length);
* a cut batch is a part of one batch the batch sampler made (no duplicates still; group-by-label's pairs whole).

The order is the seed's on every process and a resume (accelerate's ``SkipBatchSampler``) continues it.
sentence-transformers' ``RoundRobinBatchSampler`` under the same sharding mixes datasets (what the sampler is for).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections import Counter

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from datasets import Dataset
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sentence_transformers.base.sampler import (
    DefaultBatchSampler,
    GroupByLabelBatchSampler,
    NoDuplicatesBatchSampler,
    RoundRobinBatchSampler,
)
from torch.utils.data import ConcatDataset, RandomSampler

from st_cached_losses import SameDatasetBatchSampler

SIZES = (37, 14, 5)  # rows; batch 4: 10 batches (last of 1), 4 (last of 2), 2 (last of 1)
BATCH = 4
KINDS = ("default", "no_duplicates", "group_by_label")


class Recorded:
    """A batch sampler that records the batches of each of its passes (what the stock sampler would yield)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.passes: list[list[list[int]]] = []

    batch_size = property(lambda self: self.inner.batch_size)
    drop_last = property(lambda self: self.inner.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        record: list[list[int]] = []
        self.passes.append(record)
        for batch in self.inner:
            record.append(list(batch))
            yield batch


def _rows(sizes, kind, values=None):
    """Each dataset's rows: distinct texts, or (``values``) the anchor (no_duplicates) / label (group_by_label)
    of each row, so that rows share them."""
    out = []
    for d, n in enumerate(sizes):
        vals = values[d] if values is not None else list(range(n))
        if kind == "group_by_label":
            out.append([{"text": f"d{d}r{i}", "label": int(vals[i])} for i in range(n)])
        else:
            out.append([{"anchor": f"d{d}v{vals[i]}", "positive": f"d{d}p{i}"} for i in range(n)])
    return out


def _arrow(rows: list[dict]) -> Dataset:
    """A ``datasets.Dataset`` of the rows, made once per distinct rows (building one takes tens of ms)."""
    return _arrow_of(tuple(tuple(sorted(r.items())) for r in rows))


@functools.cache
def _arrow_of(rows: tuple) -> Dataset:
    return Dataset.from_list([dict(r) for r in rows])


def _build(
    sizes=SIZES,
    batch=BATCH,
    drop_last=False,
    cls=SameDatasetBatchSampler,
    seed=7,
    kind="default",
    values=None,
    record=False,
    **kw,
):
    """The sampler as the trainer builds it: one generator shared by the datasets' batch samplers."""
    rows = _rows(sizes, kind if kind != "default" or values is not None else "default", values)
    generator = torch.Generator().manual_seed(seed)
    common = {"batch_size": batch, "drop_last": drop_last, "generator": generator, "seed": seed}
    if kind == "default":
        datasets = rows
        samplers = [
            DefaultBatchSampler(RandomSampler(ds, generator=generator), batch, drop_last, seed=seed)
            for ds in rows
        ]
    elif kind == "no_duplicates":
        datasets = [_arrow(r) for r in rows]
        samplers = [NoDuplicatesBatchSampler(ds, **common) for ds in datasets]
    else:
        datasets = [_arrow(r) for r in rows]
        samplers = [GroupByLabelBatchSampler(ds, valid_label_columns=["label"], **common) for ds in datasets]
    if record:
        samplers = [Recorded(s) for s in samplers]
    return cls(ConcatDataset(datasets), samplers, generator=generator, seed=seed, **kw)


def _dataset_of(index: int, sizes=SIZES) -> int:
    ends = list(itertools.accumulate(sizes))
    return next(d for d, end in enumerate(ends) if index < end)


def _shards(make, world: int, skip: int = 0, even_batches: bool = False) -> list[list[list[int]]]:
    """Each process's batches, from its own sampler (same seed), sharded by accelerate's BatchSamplerShard as
    the trainer shards them (one shard included)."""
    out = []
    for rank in range(world):
        shard = BatchSamplerShard(make(), world, rank, even_batches=even_batches)
        out.append(list(SkipBatchSampler(shard, skip) if skip else shard))
    return out


def _check_steps(shards, world, accumulation, sizes, some=True) -> list[int]:
    """Every step, and every optimizer step, holds one dataset on every process; each process has the same
    number of steps (``some``: at least one). Returns each step's dataset."""
    steps = len(shards[0])
    assert all(len(s) == steps for s in shards) and (steps > 0 or not some)
    assert steps % accumulation == 0
    step_datasets = []
    for step in range(steps):
        batches = [shards[r][step] for r in range(world)]
        datasets = {_dataset_of(i, sizes) for batch in batches for i in batch}
        assert len(datasets) == 1, (step, batches)
        assert all(batch for batch in batches), "no empty batch"
        step_datasets.append(datasets.pop())
    for start in range(0, steps, accumulation):
        assert len(set(step_datasets[start : start + accumulation])) == 1
    return step_datasets


def _check_no_repeat(shards, world, accumulation) -> None:
    """No row twice in an optimizer step (on every process together), nor in the epoch."""
    steps = len(shards[0])
    for start in range(0, steps, accumulation):
        rows = [
            i for step in range(start, start + accumulation) for r in range(world) for i in shards[r][step]
        ]
        assert len(rows) == len(set(rows)), ("a row twice in an optimizer step", start, rows)
    every = [i for s in shards for batch in s for i in batch]
    assert len(every) == len(set(every)), "a row twice in the epoch"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_every_step_holds_one_dataset_and_every_row_is_trained_once(world, drop_last, accumulation, kind):
    sizes = (37, 14, 16)
    values = None
    if kind == "no_duplicates":  # rows sharing an anchor: no_duplicates makes short batches mid-pass
        values = [[i % 9 if i % 4 == 0 else 100 + i for i in range(n)] for n in sizes]
    elif kind == "group_by_label":  # labels of uneven counts (dataset 0), one of a single row (never yielded)
        values = [
            [(0 if i < 5 else i % 3) if d == 0 else i % 2 for i in range(n - 1)] + [99]
            for d, n in enumerate(sizes)
        ]
    make = functools.partial(
        _build,
        sizes=sizes,
        drop_last=drop_last,
        kind=kind,
        values=values,
        world_size=world,
        gradient_accumulation_steps=accumulation,
        record=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither rows left out nor repeated here
        shards = _shards(make, world)
        assert _shards(make, world, even_batches=True) == shards  # the stream is whole groups: nothing padded
    step_datasets = _check_steps(shards, world, accumulation, sizes)
    assert len(shards[0]) * world == len(make())
    assert set(step_datasets) == {0, 1, 2}, "every dataset is trained on"
    _check_no_repeat(shards, world, accumulation)
    reference = make()
    list(reference)
    trained = Counter(i for s in shards for batch in s for i in batch)
    offsets = [0, *itertools.accumulate(sizes)]
    roomy = []  # datasets with two rows for each of their batches
    for d, sampler in enumerate(reference.batch_samplers):
        (stock,) = sampler.passes  # what the dataset's batch sampler yielded this epoch, once
        yielded = {offsets[d] + i for batch in stock for i in batch}
        mine = {i for i in trained if _dataset_of(i, sizes) == d}
        assert mine <= yielded
        if not drop_last:
            assert len(stock) <= len(sampler)  # sentence-transformers trains every row of it: so do we
            assert mine == yielded, (d, sorted(yielded - mine))
        if len(mine) >= 2 * reference.groups_per_dataset()[d] * world * accumulation:
            roomy.append(d)
    batches = [b for s in shards for b in s]
    if world * accumulation <= 2:
        assert roomy == [0, 1, 2]
    if kind == "group_by_label":  # a cut batch keeps its pairs, where the dataset has two rows per batch
        labels = [v for d, n in enumerate(sizes) for v in values[d]]
        for batch in (b for b in batches if _dataset_of(b[0], sizes) in roomy):
            assert all(c >= 2 for c in Counter(labels[i] for i in batch).values()), batch
    own = {
        tuple(offsets[d] + i for i in b) for d, s in enumerate(reference.batch_samplers) for b in s.passes[0]
    }
    for batch in (b for b in batches if _dataset_of(b[0], sizes) in roomy):
        # a batch of one row is the batch sampler's, never a cut where the dataset has two rows per batch
        assert len(batch) >= 2 or tuple(batch) in own, batch
    if kind == "no_duplicates":
        anchors = [v for d, n in enumerate(sizes) for v in values[d]]
        for batch in (b for s in shards for b in s):
            keys = [(_dataset_of(i, sizes), anchors[i]) for i in batch]
            assert len(keys) == len(set(keys)), batch


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
    assert steps * world == len(make())
    assert all(
        len(s) == len(BatchSamplerShard(make(), world, r, even_batches=False)) for r, s in enumerate(shards)
    )
    step_datasets = _check_steps(shards, world, accumulation, SIZES)
    if world * accumulation <= 5:  # else dataset 2 (5 rows) has fewer rows than a group has batches
        _check_no_repeat(shards, world, accumulation)
    if drop_last:  # full batches, but in a dataset whose full batches do not fill its only group (cut)
        full = [d for d, n in enumerate(SIZES) if n // BATCH >= world * accumulation]
        assert world * accumulation > 3 or 0 in full  # not vacuous
        assert all(len(b) == BATCH for s in shards for b in s if _dataset_of(b[0]) in full)
    assert set(step_datasets) == {0, 1, 2}, "every dataset is trained on"
    seen = {i for s in shards for batch in s for i in batch}
    if not drop_last and order == "proportional":
        assert seen == set(range(sum(SIZES))), "every row of every dataset is trained on"
    if order == "round_robin":  # one group of each dataset in turn
        groups = step_datasets[::accumulation]
        assert groups == [0, 1, 2] * (len(groups) // 3)


def _issue_case(seed: int):
    """The issue's datasets: 12 rows of which rows 1, 3, 6 and 11 share an anchor, and 12 distinct rows;
    no_duplicates, batch 4, 2 processes, accumulation 2."""
    values = [[0 if i in (1, 3, 6, 11) else 10 + i for i in range(12)], list(range(12))]
    return functools.partial(
        _build,
        sizes=(12, 12),
        kind="no_duplicates",
        values=values,
        seed=seed,
        world_size=2,
        gradient_accumulation_steps=2,
    )


def test_the_issue_reproduction_no_duplicates_short_batches_under_two_processes():
    """Issue 50: a 12-row dataset whose four rows share an anchor, no_duplicates, batch 4 (batches of 4, 4, 3
    and 1), 2 processes, accumulation 2: every row trained, once; each process 4 batches; one dataset per
    optimizer step (accelerate withheld the pair whose last batch was short: rows lost, datasets mixed)."""
    make = _issue_case(seed=7)
    reference = make(record=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(reference)
        shards = _shards(make, 2)
    assert [len(b) for b in reference.batch_samplers[0].passes[0]] == [4, 4, 3, 1]
    assert [len(s) for s in shards] == [4, 4]
    _check_steps(shards, 2, 2, (12, 12))
    _check_no_repeat(shards, 2, 2)
    assert sorted(i for s in shards for b in s for i in b) == list(range(24))


def test_batches_past_the_length_are_left_out_with_a_warning():
    """A no_duplicates pass of more batches than a dataset's groups hold (here 6 where its length says 3,
    each of the four rows sharing an anchor alone in a batch, and one group of 4): the shortest past the
    groups are left out, with a warning (sentence-transformers' samplers stop at the length too)."""
    make = _issue_case(seed=0)
    reference = make(record=True)
    with pytest.warns(UserWarning, match=r"dataset 0 yielded 6 batches .* more than its length \(3\)"):
        list(reference)
    assert sorted(len(b) for b in reference.batch_samplers[0].passes[0]) == [1, 1, 1, 1, 4, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = _shards(make, 2)
    _check_steps(shards, 2, 2, (12, 12))
    _check_no_repeat(shards, 2, 2)
    lost = set(range(24)) - {i for s in shards for b in s for i in b}
    assert len(lost) == 2 and lost <= {1, 3, 6, 11}


def test_a_batch_sampler_out_of_rows_skips_its_groups_on_every_process():
    """no_duplicates with drop_last on four rows of one anchor yields no batch where its length says 1:
    the dataset's group is skipped on every process alike, with a warning, rather than failing mid-epoch."""
    values = [[0, 0, 0, 0], list(range(12))]
    make = functools.partial(
        _build, sizes=(4, 12), kind="no_duplicates", values=values, drop_last=True, world_size=2
    )
    with pytest.warns(UserWarning, match="dataset 0 yielded no more rows in this epoch"):
        shards = _shards(make, 2)
    _check_steps(shards, 2, 1, (4, 12))
    assert [len(s) for s in shards] == [1, 1] and len(make()) == 4  # a group of 2 batches each, one skipped
    assert {i for s in shards for b in s for i in b} <= set(range(4, 16))


@pytest.mark.parametrize("drop_last", [False, True])
def test_group_counts_and_the_cut_batches(drop_last):
    sampler = _build(drop_last=drop_last, world_size=3)
    batches = list(sampler)
    # drop_last=False: 10, 4 and 2 batches -> ceil(/3) = 4, 2, 1 groups; True: 9, 3, 1 -> floor 3, 1 and
    # (the only one, kept) 1
    assert sampler.groups_per_dataset() == ([4, 2, 1] if not drop_last else [3, 1, 1])
    assert len(batches) == len(sampler) == 3 * sum(sampler.groups_per_dataset())
    assert sampler.batch_size is None  # batches of any length: accelerate withholds none
    lengths = [[len(b) for b in batches if _dataset_of(b[0]) == d] for d in range(3)]
    if drop_last:  # full batches, but dataset 2's only group: its one full batch cut into 3
        assert lengths[0] == [4] * 9 and lengths[1] == [4] * 3 and sorted(lengths[2]) == [1, 1, 2]
    else:  # the last group of too few batches: the largest of its batches (and the group's before) cut
        assert sum(lengths[0]) == 37 and sorted(lengths[0]) == [1] + [2] * 4 + [4] * 7
        assert sum(lengths[1]) == 14 and sorted(lengths[1]) == [2] * 5 + [4]
        assert sorted(lengths[2]) == [1, 2, 2]


def test_a_dataset_smaller_than_a_group_or_a_batch_is_kept():
    # drop_last=True: dataset 0 has no batch at all (3 rows < 4): left out, with a warning at build time
    with pytest.warns(UserWarning, match=r"dataset\(s\) \[0\]"):
        sampler = _build(sizes=(3, 30), world_size=4, drop_last=True)
    assert sampler.groups_per_dataset() == [0, 1]
    assert len(sampler) == len(list(sampler)) == 4  # dataset 1's one group
    with pytest.warns(UserWarning, match="not trained on"):
        robin = _build(sizes=(3, 30), world_size=4, drop_last=True, order="round_robin")
    assert len(robin) == len(list(robin)) == 4  # the empty dataset does not stop the other
    # drop_last=False: 3 rows for a group of 4 batches: they repeat, said at build time and when iterated
    with pytest.warns(UserWarning, match=r"dataset\(s\) \[0\] .* hold fewer rows than a group"):
        sampler = _build(sizes=(3, 30), world_size=4, drop_last=False)
    with pytest.warns(UserWarning, match="its rows repeat within a step"):
        batches = list(sampler)
    first = [b for b in batches if all(i < 3 for i in b)]
    assert len(first) == 4 and Counter(i for b in first for i in b).keys() == {0, 1, 2}


def test_the_order_is_the_seeds_on_every_process_and_changes_with_the_epoch():
    a, b = _build(world_size=2), _build(world_size=2)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again (the same epoch) repeats it
    c = _build(world_size=2)
    c.set_epoch(1)
    assert list(c) != list(a)
    assert list(_build(world_size=2, seed=8)) != list(a)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_skipping_batches_continues_the_order(world, kind):
    values = [[i % 2 for i in range(n)] for n in SIZES] if kind != "default" else None
    make = functools.partial(
        _build, world_size=world, gradient_accumulation_steps=2, kind=kind, values=values
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # group_by_label: dataset 2's 5 rows repeat in a group of 6
        full = _shards(make, world)
        resumed = _shards(make, world, skip=4)
    assert all(resumed[r] == full[r][4:] for r in range(world))


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


# ---------------------------------------------------------------------- the property test


@st.composite
def _scenarios(draw):
    kind = draw(st.sampled_from(KINDS))
    n_datasets = draw(st.integers(1, 3))
    batch = 4 if kind == "group_by_label" else draw(st.integers(1, 5))
    sizes = tuple(draw(st.integers(4 if kind == "group_by_label" else 1, 30)) for _ in range(n_datasets))
    distinct = draw(st.integers(2, 12))  # few distinct values: many duplicates (no_duplicates, labels)
    values = [[draw(st.integers(0, distinct)) for _ in range(n)] for n in sizes]
    return {
        "kind": kind,
        "sizes": sizes,
        "batch": batch,
        "values": values if kind != "default" else None,
        "drop_last": draw(st.booleans()),
        "world": draw(st.integers(1, 4)),
        "accumulation": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 3)),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenarios())
def test_property_one_dataset_per_step_no_row_twice_every_row_once(case):
    world, accumulation, sizes = case["world"], case["accumulation"], case["sizes"]
    make = functools.partial(
        _build,
        sizes=sizes,
        batch=case["batch"],
        drop_last=case["drop_last"],
        seed=case["seed"],
        kind=case["kind"],
        values=case["values"],
        world_size=world,
        gradient_accumulation_steps=accumulation,
        record=True,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = make()
    except ValueError:  # group_by_label without two labels of two rows: refused by sentence-transformers
        assume(False)
    group = world * accumulation
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(reference)
        shards = _shards(make, world)
    messages = [str(w.message) for w in caught]
    assume(len(reference) > 0)
    ran_out = any("yielded no more rows" in m for m in messages)
    step_datasets = _check_steps(shards, world, accumulation, sizes, some=not ran_out)
    if ran_out:  # no_duplicates + drop_last ran out of rows: the epoch is shorter on every process
        assert len(shards[0]) * world < len(reference)
    else:
        assert len(shards[0]) * world == len(reference)
    offsets = [0, *itertools.accumulate(sizes)]
    counts = reference.groups_per_dataset()
    trained = Counter(i for s in shards for batch in s for i in batch)
    for d, sampler in enumerate(reference.batch_samplers):
        if not counts[d]:
            assert d not in step_datasets
            continue
        stock = sampler.passes[0]
        yielded = {offsets[d] + i for batch in stock for i in batch}
        mine = Counter({i: c for i, c in trained.items() if _dataset_of(i, sizes) == d})
        repeated = any(f"dataset {d} has" in m and "repeat" in m for m in messages)
        # rows repeat only in a dataset short of rows for its batches (warned), which a batch sampler that
        # yields at least its length in rows of its own never is otherwise: not no_duplicates with drop_last,
        # which yields fewer batches (6.2) or fills its length with rows of earlier batches (6.3's resampling)
        fresh = sum(len(batch) for batch in stock) == len(yielded)
        if fresh and len(stock) >= len(sampler) and len(yielded) >= counts[d] * group:
            assert not repeated
        if not repeated:
            assert set(mine.values()) <= {1}, "no row twice in the epoch"
        assert set(mine) <= yielded
        if not case["drop_last"] and reference.order == "proportional" and len(stock) <= len(sampler):
            # sentence-transformers' sampler trains every row of this pass: so do we, exactly once
            assert set(mine) == yielded
        if len(stock) <= len(sampler):
            assert not any(f"dataset {d} yielded" in m and "more than its length" in m for m in messages)
    if not any("repeat" in m for m in messages):
        _check_no_repeat(shards, world, accumulation)


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
