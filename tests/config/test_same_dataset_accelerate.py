"""SameDatasetBatchSampler end to end: the stock SentenceTransformerTrainer under ``accelerate launch`` (2 and 3
gloo processes), three datasets of 26, 14 and 9 rows (batch 4 per process: uneven last batches), a dict of
``CachedMNRLoss(gather_across_devices=True)``, one per dataset (``tests/support/multi_dataset_train.py``).

At every optimizer step, every micro-step of every process holds rows of one dataset and calls that dataset's
loss; every row of every dataset is trained on (proportional order, ``dataloader_drop_last=False``); the step's
gradient equals one process's gradient of the naive InfoNCE on the same global batch; with gradient
accumulation (per optimizer step) and after a resume from a checkpoint mid-epoch, in the first or the second
epoch (the same steps, rows and gradients as the run that was not interrupted). sentence-transformers' ROUND_ROBIN, under the same launch,
mixes datasets across processes in a step: what the sampler fixes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.dist_utils import accelerate_launch
from tests.support.multi_dataset_train import SIZES
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
ROWS = {}
_start = 0
for _name, _n in SIZES.items():
    ROWS[_name] = set(range(_start, _start + _n))
    _start += _n


def _launch(
    tmp_path: Path, world: int, scenarios: str, accumulation: int, save_steps: int, epochs: int
) -> dict:
    model = make_tiny_model(tmp_path / "bert")
    model.save(str(tmp_path / "st"))
    out = tmp_path / "result.json"
    cmd = [
        *accelerate_launch(world),
        *["-m", "tests.support.multi_dataset_train", "--model", str(tmp_path / "st"), "--out", str(out)],
        *["--scenarios", scenarios, "--accumulation", str(accumulation), "--save-steps", str(save_steps)],
        *["--epochs", str(epochs)],
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # a gloo rank can abort in a destructor after every scenario finished and rank 0 wrote the results (seen
    # once in a whole-suite run, 2026-12-06): the results, checked in full below, are what the test is about
    aborted_after = out.exists() and "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or aborted_after, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_one_dataset_per_step(run: dict, world: int, accumulation: int) -> list[str]:
    """Every micro-step of every process in an optimizer step: one dataset, its loss, its rows; the step's
    gradient is the oracle's. Returns each step's dataset."""
    chosen = []
    for step in run["steps"]:
        assert len(step["datasets"]) == accumulation and all(len(m) == world for m in step["datasets"])
        names = {name for micro in step["datasets"] for name in micro}
        assert len(names) == 1, step["datasets"]
        (name,) = names
        rows = {r for micro in step["rows"] for rank in micro for r in rank}
        assert rows <= ROWS[name], (name, sorted(rows - ROWS[name]))
        assert step["grad_norm"] > 1e-4 and step["grad_error"] < 1e-5, step
        chosen.append(name)
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "accumulation", "scenarios", "save_steps", "epochs"),
    [
        # two epochs of 8 steps, resumed 2 steps into the second
        (2, 1, "same,same_resume,same_rr_accum,round_robin", 10, 2),
        # one epoch of 4 optimizer steps (2 micro-steps each), resumed after 2
        (3, 2, "same,same_resume,round_robin", 2, 1),
    ],
)
def test_every_process_trains_on_one_dataset_per_step(
    tmp_path, world, accumulation, scenarios, save_steps, epochs
):
    result = _launch(tmp_path, world, scenarios, accumulation, save_steps, epochs)
    same = result["same"]
    assert same["world"] == world and same["global_step"] == len(same["steps"]) > save_steps
    per_epoch = len(same["steps"]) // epochs
    if epochs == 2:  # each epoch its own order (so that resuming in the second one shows which it follows)
        assert [s["rows"] for s in same["steps"][:per_epoch]] != [
            s["rows"] for s in same["steps"][per_epoch:]
        ]
        assert save_steps > per_epoch
    chosen = _check_one_dataset_per_step(same, world, accumulation)
    assert set(chosen) == set(SIZES), "every dataset is trained on"
    seen = {r for step in same["steps"] for micro in step["rows"] for rank in micro for r in rank}
    assert seen == set().union(*ROWS.values()), "every row of every dataset is trained on"
    # a process held a short batch in some step (the datasets' last batches), and nobody hung on it
    sizes = {len(rank) for step in same["steps"] for micro in step["rows"] for rank in micro}
    assert min(sizes) < 4 == max(sizes)

    # resumed mid-epoch from the checkpoint at save_steps: the same steps as the uninterrupted run (in the second
    # epoch: its order, not the first's, which the trainer's resume alone would replay)
    resumed = result["same_resume"]
    assert resumed["global_step"] == same["global_step"]
    _check_one_dataset_per_step(resumed, world, accumulation)
    assert [s["rows"] for s in resumed["steps"]] == [s["rows"] for s in same["steps"][save_steps:]]
    assert [s["loss"] for s in resumed["steps"]] == pytest.approx(
        [s["loss"] for s in same["steps"][save_steps:]]
    )

    if "same_rr_accum" in result:  # round-robin, two micro-batches per optimizer step on one dataset
        chosen = _check_one_dataset_per_step(result["same_rr_accum"], world, 2)
        assert chosen == ["a", "b", "c"] * (len(chosen) // 3) and chosen

    # sentence-transformers' ROUND_ROBIN: the processes train on different datasets in a step
    stock = result["round_robin"]["steps"]
    mixed = [s for s in stock if len({n for micro in s["datasets"] for n in micro}) > 1]
    assert len(mixed) == len(stock) > 0
    assert all(
        s["grad_error"] < 1e-5 for s in stock
    )  # the oracle is the same for mixed batches: the gradients alone cannot show the mixing
