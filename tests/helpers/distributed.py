"""Run a function in W gloo processes on this machine and bring back each rank's result.

    results = run_distributed(fn, world_size=2, args=(...,))    # [fn(0, 2, ...), fn(1, 2, ...)]

`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name for `spawn`); it runs
after the default process group is initialised (gloo, CPU, one intra-op thread per process so that W
processes share a small CI machine fairly). Rendezvous goes through a TCPStore that the parent opens on port 0,
so the OS picks a free port and there is no window for another job to take it. A child's exception is sent to
the parent with its traceback and re-raised there; a child that dies silently or a run that passes `timeout`
seconds fails the test instead of hanging it.

The ranks are forked from a ``forkserver`` that imported torch once, instead of spawned fresh: a spawned rank
spends about 2 s of CPU importing torch before it does anything, which over the suite's few dozen launches of
2-3 ranks was minutes of a 2-core machine. The server is a clean process of its own (no threads, no process
group, nothing of the test process), so forking from it is as safe as spawning; each rank still starts with
the state its own code sets (environment, threads, process group). It is started once per test process, so a
rank sees the environment the server started with, not later changes of the test process's.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing"]


class ChildProcessError_(RuntimeError):
    """A rank failed; the message holds the rank's own traceback."""


def _dumps(obj: Any) -> bytes:
    # torch.save to bytes: tensors travel as plain bytes, so a child may exit before the parent reads them.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    cuda: bool = False,
) -> None:
    from ddp_rank.distributed import end_process_group

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    if not cuda:  # CPU processes on gloo whatever the machine has (set before CUDA starts)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            value = fn(rank, world, *args)
        finally:
            end_process_group()
        results.put((rank, True, _dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    cuda: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return the results in rank order.

    ``cuda=True`` leaves the machine's GPUs visible to the ranks (they still talk over gloo: several ranks may
    share one GPU, which NCCL refuses); by default the ranks see none."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    store = dist.TCPStore(_HOST, 0, world_size=None, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child, args=(r, world_size, store.port, fn, tuple(args), results, cuda), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    outcome: dict[int, Any] = {}
    while len(outcome) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise ChildProcessError_(f"a rank died without reporting (exit codes {dead})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"distributed run did not finish in {timeout:.0f} s; ranks done: {sorted(outcome)}"
                ) from None
            continue
        if not ok:
            raise ChildProcessError_(f"rank {rank} of {world_size} failed:\n{payload}")
        outcome[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [outcome[r] for r in range(world_size)]
