"""Spawning gloo process groups on CPU from pytest.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on each of
``world_size`` processes of a gloo group and returns what each returned (or re-raises the exception a
rank raised, with the rank). Collecting the results has a deadline, so a worker that dies or hangs
fails the test instead of blocking pytest forever.

The processes are kept between calls, one group per world size for the whole pytest session: starting
a process and importing torch, transformers and sentence-transformers in it costs seconds, many times
over the work of a typical call. Between calls a worker puts back the state a call may leave behind
(accelerate's singletons, grad mode, the default dtype, the thread count). A group whose call failed
or timed out is killed and the next call starts a new one, so a broken collective never reaches the
next test. ``fresh=True`` runs a call in a group of its own, started and stopped for it.
"""

from __future__ import annotations

import atexit
import io
import itertools
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_between_calls() -> None:
    """Put back the process-wide state a call may change, so that calls do not see each other."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)


def _serve(rank: int, world_size: int, port: int, tasks, results, parent: int) -> None:
    """A worker: join the gloo group, then run the calls that arrive on ``tasks`` until told to stop
    (``None``) or until the parent is gone."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        assert dist.get_world_size() == world_size, "the worker must see the whole group"
    except BaseException as exc:
        results.put((None, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            try:
                task = tasks.get(timeout=2.0)
            except queue_module.Empty:
                if os.getppid() != parent:
                    return  # pytest is gone
                continue
            if task is None:
                return
            call, fn, args = task
            try:
                result = fn(rank, world_size, *args)
                # serialised to bytes: a tensor sent as is travels as a shared-memory handle, which dies
                # with this process (a race with the parent's read)
                buffer = io.BytesIO()
                torch.save(result, buffer)
                results.put((call, rank, "ok", buffer.getvalue()))
            except BaseException as exc:
                results.put((call, rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            _reset_between_calls()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: Seconds the other ranks get to report once a rank has failed or died without reporting.
_GRACE_AFTER_FAILURE = 10.0

_calls = itertools.count()


class _Group:
    """``world_size`` spawned workers of one gloo group (see :func:`_serve`)."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        # Queues, not SimpleQueues: only their get() takes a timeout
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, self.tasks[r], self.results, os.getpid()))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args: tuple, timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
        """One call on every rank: the ranks' results and errors. Raises ``TimeoutError`` when a rank
        neither reports nor fails within ``timeout`` (and the grace after another rank's failure)."""
        call = next(_calls)
        for q in self.tasks:
            q.put((call, fn, args))
        ws = self.world_size
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < ws:
            now = time.monotonic()
            missing = [r for r in range(ws) if r not in results and r not in errors]
            dead = {r: self.procs[r].exitcode for r in missing if not self.procs[r].is_alive()}
            if dead or errors:
                # a rank failed or died: the others may wait on it forever in a collective, so they get
                # a few seconds to report (their error says what the failure did to them)
                grace = _GRACE_AFTER_FAILURE if len(dead) < len(missing) else 2.0
                deadline = min(deadline, now + grace)
            if now >= deadline:
                why = f"exited with codes {dead}" if dead else f"no report within {timeout:.0f} s"
                reported = "\n".join(
                    f"rank {r}: {errors.get(r, 'ok')}" for r in range(ws) if r not in missing
                )
                raise TimeoutError(
                    f"ranks {missing} of {ws} did not report ({why}); what the others reported:\n"
                    f"{reported or '(nothing)'}"
                )
            try:
                # short slices, so that a dead worker is noticed without waiting for the deadline
                got, rank, status, payload = self.results.get(timeout=max(0.01, min(1.0, deadline - now)))
            except queue_module.Empty:
                continue
            if got not in (call, None):
                continue  # not this call's (cannot happen: a group is dropped after any failure)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
        return results, errors

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(0 if kill else 10.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [self.results, *self.tasks]:
            q.close()
            q.cancel_join_thread()


#: the kept groups, by world size
_GROUPS: dict[int, _Group] = {}

#: the running test's id when it is not marked ``distributed`` (tests/conftest.py sets it around each test):
#: process groups are refused there, so that a test the marking missed fails instead of slowing the fast lane
UNMARKED_TEST: str | None = None


@atexit.register
def _close_groups() -> None:
    while _GROUPS:
        _GROUPS.popitem()[1].close()


def run_distributed(
    fn, world_size: int, *args: Any, timeout: float = 300.0, fresh: bool = False
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; returns the per-rank results in rank order.

    ``fn`` must be importable by name (a module-level function). Every rank must report within
    ``timeout`` seconds of the start (all ranks together): a rank that dies without reporting (killed,
    a crash in native code) or hangs in a collective would otherwise block the parent's read forever.
    On a missed deadline, or when a rank raised, the group is killed (the next call starts a new one);
    a ``TimeoutError`` names the ranks that did not report, a ``RuntimeError`` carries the ranks'
    exceptions. ``fresh``: a group of its own for this call, as for a call that leaves process state
    :func:`_reset_between_calls` does not put back.
    """
    if UNMARKED_TEST is not None:
        raise RuntimeError(
            f"{UNMARKED_TEST} starts gloo process groups but is not marked `distributed`, so the fast lane "
            "(pytest's default) runs it: tests/support/lanes.py did not see the call in its code; mark the test "
            "with @pytest.mark.distributed"
        )
    group = _Group(world_size) if fresh else _GROUPS.pop(world_size, None) or _Group(world_size)
    ok = False
    try:
        results, errors = group.run(fn, args, timeout)
        ok = not errors
    finally:
        if ok and not fresh:
            _GROUPS[world_size] = group
        else:
            group.close(kill=not ok)
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


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


def run_launched(main: Callable[[], None]) -> None:
    """Run a script's ``main`` under ``accelerate launch`` / torchrun, then tear the process group down.

    Left to the interpreter's exit, a gloo rank can abort in a destructor ("terminate called without an
    active exception", exit code -6) after a run that passed, which fails the launch."""
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
