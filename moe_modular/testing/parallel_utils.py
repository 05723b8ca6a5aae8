"""parallel_launch: the one multi-process harness every distributed test uses.

    parallel_launch(world_size, worker, *args, timeout_s=...)

spawns `world_size` processes (torch.multiprocessing, spawn context), initializes
torch.distributed in each (NCCL with one GPU per rank when CUDA is available and world_size <=
the device count, gloo on the CPU otherwise) and calls `worker(pgi, *args)` with a
ProcessGroupInfo. It returns when every rank returned; otherwise it raises ParallelLaunchError
naming every failed rank with its traceback. It never hangs: once one rank fails, the others get
`grace_s` seconds to finish or report, then are killed; the whole launch is bounded by timeout_s.

Workers and their arguments cross a process boundary: the worker must be a module-level function
and every argument picklable (checked before anything is spawned).
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_modular.testing.triton_interpreter import interpreter_requested, patch_triton_interpreter

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 10.0
_POLL_S = 0.05


@dataclass(frozen=True)
class ProcessGroupInfo:
    """What a worker knows about its place in the launch.

    rank / world_size: this process's rank in the default group and the group size.
    device: cuda:<rank> under NCCL, cpu under gloo.
    group: the process group the worker should use (the default WORLD group).
    """

    rank: int
    world_size: int
    device: torch.device
    group: Any


class ParallelLaunchError(RuntimeError):
    """One or more ranks failed, timed out or were killed.

    failures: rank -> what happened to it (a traceback, an exit code, or why it was killed),
    in the order the failures were observed (the first is usually the root cause).
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def choose_backend(world_size: int) -> str:
    """NCCL when every rank can own a GPU, gloo otherwise."""
    if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _child(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    result_queue: Any,
    worker: Callable[..., None],
    args: tuple,
) -> None:
    """Entry point of one spawned rank: init the group, run the worker, report to the parent."""
    status, detail = "ok", ""
    try:
        if interpreter_requested():  # the parent chose Triton's interpreter; this process needs its fixes too
            patch_triton_interpreter()
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            # The ranks share the machine's cores; one pool each avoids oversubscription.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_kwargs: dict[str, Any] = dict(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        if backend == "nccl":
            init_kwargs["device_id"] = device
        dist.init_process_group(**init_kwargs)
        pgi = ProcessGroupInfo(rank=rank, world_size=world_size, device=device, group=dist.group.WORLD)
        worker(pgi, *args)
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the parent
        status, detail = "error", traceback.format_exc()
    result_queue.put((status, rank, detail))
    if status == "ok" and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after success must not turn into a failure
            pass
    # On failure the process simply exits: its sockets close, so peers blocked in a collective
    # see the closed connection instead of waiting for the collective timeout.
    result_queue.close()
    result_queue.join_thread()


def _check_picklable(worker: Callable[..., None], args: tuple) -> None:
    try:
        pickle.dumps(worker)
    except Exception as exc:
        raise TypeError(
            f"worker ({getattr(worker, '__qualname__', worker)!r}) must be a picklable module-level function: {exc}"
        ) from None
    for i, a in enumerate(args):
        try:
            pickle.dumps(a)
        except Exception as exc:
            raise TypeError(f"argument {i} ({type(a).__name__}) of the worker must be picklable: {exc}") from None


def parallel_launch(
    world_size: int,
    worker: Callable[..., None],
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    backend: Optional[str] = None,
) -> None:
    """Run worker(pgi, *args) on world_size ranks; raise ParallelLaunchError if any rank fails.

    timeout_s: wall-clock bound for the whole launch (also the collective timeout in each rank).
    grace_s: after the first failure, how long the other ranks may take to finish or report before
      they are killed.
    backend: "gloo" or "nccl"; chosen by choose_backend() when None.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be an int >= 1")
    if timeout_s <= 0 or grace_s < 0:
        raise ValueError(f"timeout_s ({timeout_s}) must be > 0 and grace_s ({grace_s}) >= 0")
    backend = backend or choose_backend(world_size)
    allowed = ("gloo", "nccl")
    if backend not in allowed:
        raise ValueError(f"backend ({backend!r}) must be one of {list(allowed)}")
    if backend == "nccl" and not (torch.cuda.is_available() and world_size <= torch.cuda.device_count()):
        raise ValueError(
            f"backend (nccl) needs world_size ({world_size}) <= cuda device count ({torch.cuda.device_count()})"
        )
    _check_picklable(worker, args)

    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="parallel_launch_")
    init_method = "file://" + os.path.join(store_dir, "store")
    result_queue = ctx.Queue()
    procs = []
    failures: dict[int, str] = {}
    done: set[int] = set()
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, backend, init_method, timeout_s, result_queue, worker, args),
                daemon=True,
            )
            p.start()
            procs.append(p)

        start = time.monotonic()
        deadline = start + timeout_s
        first_failure_at: Optional[float] = None
        while len(done) < world_size:
            now = time.monotonic()
            if now >= deadline:
                for rank in range(world_size):
                    if rank not in done:
                        failures.setdefault(rank, f"timed out after {timeout_s:.0f} s (killed)")
                break
            if first_failure_at is not None and now >= first_failure_at + grace_s:
                first = next(iter(failures))
                for rank in range(world_size):
                    if rank not in done:
                        failures.setdefault(
                            rank, f"killed {grace_s:.0f} s after rank {first} failed (still running)")
                break
            try:
                status, rank, detail = result_queue.get(timeout=_POLL_S)
            except queue_mod.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill).
                for rank, p in enumerate(procs):
                    if rank not in done and not p.is_alive():
                        # Give its report a moment to arrive through the queue before judging.
                        try:
                            status, r2, detail = result_queue.get(timeout=0.5)
                        except queue_mod.Empty:
                            done.add(rank)
                            failures.setdefault(rank, f"exited with code {p.exitcode} without reporting")
                        else:
                            done.add(r2)
                            if status != "ok":
                                failures.setdefault(r2, detail)
                        if failures and first_failure_at is None:
                            first_failure_at = time.monotonic()
                        break
                continue
            done.add(rank)
            if status != "ok":
                failures.setdefault(rank, detail)
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=1.0 if not failures else 0.0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        result_queue.close()
        shutil.rmtree(store_dir, ignore_errors=True)

    # A rank that reported success but then crashed in teardown still counts as success.
    if failures:
        parts = [f"{len(failures)} of {world_size} ranks failed ({backend}):"]
        for rank, detail in failures.items():
            parts.append(f"--- rank {rank} ---\n{detail.rstrip()}")
        raise ParallelLaunchError("\n".join(parts), failures)
