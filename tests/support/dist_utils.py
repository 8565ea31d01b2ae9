"""Spawning gloo process groups on CPU from pytest.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each of which joins a gloo
group, asserts the world size, calls ``fn(rank, world_size, *args)`` and sends back what it returns
(or the exception it raised, re-raised here with the rank). Collecting the results has a deadline,
so a worker that dies or hangs fails the test instead of blocking pytest forever."""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import sys
import time
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


#: Seconds the other ranks get to report once a rank has died without reporting.
_GRACE_AFTER_DEATH = 10.0


def run_distributed(fn, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; returns the per-rank results in rank order.

    Every rank must report within ``timeout`` seconds of the start (all ranks together): a rank that
    dies without reporting (killed, a crash in native code) or hangs in a collective would otherwise
    block the parent's read forever. On a missed deadline the workers are killed and a
    ``TimeoutError`` names the ranks that did not report.
    """
    ctx = mp.get_context("spawn")
    # a Queue, not a SimpleQueue: only its get() takes a timeout
    results_queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results_queue))
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            missing = [r for r in range(world_size) if r not in results and r not in errors]
            dead = {r: procs[r].exitcode for r in missing if not procs[r].is_alive()}
            if dead:
                # a rank died without reporting: the others get a few seconds to report (their error
                # says what the death did to them), not the whole deadline, as they may wait on it forever;
                # when only dead ranks are missing, just long enough for a report still in the pipe
                grace = _GRACE_AFTER_DEATH if len(dead) < len(missing) else 2.0
                deadline = min(deadline, now + grace)
            if now >= deadline:
                why = f"exited with codes {dead}" if dead else f"no report within {timeout:.0f} s"
                reported = "\n".join(
                    f"rank {r}: {errors.get(r, 'ok')}" for r in range(world_size) if r not in missing
                )
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not report ({why}); what the others reported:\n"
                    f"{reported or '(nothing)'}"
                )
            try:
                # short slices, so that a dead worker is noticed without waiting for the deadline
                report = results_queue.get(timeout=max(0.01, min(1.0, deadline - now)))
            except queue_module.Empty:
                continue
            _record(*report, results, errors)
    finally:
        for p in procs:
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        results_queue.close()
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _record(rank: int, status: str, payload: Any, results: dict[int, Any], errors: dict[int, str]) -> None:
    """File one worker's report: its result, or the exception it raised."""
    if status == "ok":
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    else:
        errors[rank] = payload


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """The ``accelerate launch`` command line for ``num_processes`` gloo processes on this machine.

    accelerate's ``--cpu`` launcher starts a single process unless MPI is configured; the multi-process
    launcher (torchrun underneath) runs gloo on CPU when no GPU is present. A free port, not torchrun's
    fixed default, so that two launches at once (pytest -n 2) do not meet on one rendezvous."""
    return [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--main_process_port",
        str(_free_port()),
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
