"""End to end through ``accelerate launch`` with the stock trainer: two gloo processes on CPU, each
with half of every global batch and ``gather_across_devices=True``, log the same per-step losses and
end with the same parameters as one process training on the whole global batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist_utils import accelerate_launch
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
#: run as a module from ROOT (every run's working directory), so that it imports this checkout's tests.support
SCRIPT = ["-m", "tests.support.accelerate_train"]


def _run(cmd: list[str], out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_accelerate_launch_two_processes_matches_one(tmp_path):
    model = make_tiny_model(tmp_path / "bert")
    model.save(str(tmp_path / "st"))
    args = ["--model", str(tmp_path / "st"), "--global-batch", "8", "--steps", "3"]
    two = _run(
        [
            *accelerate_launch(2),
            *SCRIPT,
            *args,
            "--out",
            str(tmp_path / "two.json"),
        ],
        tmp_path / "two.json",
    )
    one = _run([sys.executable, *SCRIPT, *args, "--out", str(tmp_path / "one.json")], tmp_path / "one.json")
    for name in ("mnr", "clip", "tiled"):
        assert two[name]["world"] == 2 and one[name]["world"] == 1
        assert len(two[name]["losses"]) == 3
        assert two[name]["losses"] == pytest.approx(one[name]["losses"], rel=1e-5), name
        assert two[name]["param_sample"] == pytest.approx(one[name]["param_sample"], rel=1e-4, abs=1e-6), name
        assert two[name]["scale"] == pytest.approx(one[name]["scale"], rel=1e-5), name
