"""Spawning gloo process groups on CPU from pytest.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each of which joins a gloo
group, asserts the world size, calls ``fn(rank, world_size, *args)`` and sends back what it returns
(or the exception it raised, re-raised here with the rank)."""

from __future__ import annotations

import io
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, queue) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        assert dist.get_world_size() == world_size, "the worker must see the whole group"
        result = fn(rank, world_size, *args)
        # serialised to bytes: a tensor sent as is travels as a shared-memory handle, which dies with
        # this process (a race with the parent's read)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}: {payload}")
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """The ``accelerate launch`` command line for ``num_processes`` gloo processes on this machine.

    accelerate's ``--cpu`` launcher starts a single process unless MPI is configured; the multi-process
    launcher (torchrun underneath) runs gloo on CPU when no GPU is present."""
    return [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
