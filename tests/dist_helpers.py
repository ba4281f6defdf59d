"""Run a function on N CPU processes over gloo, the way torchrun would.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes with the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
on a free port), calls ``fn(rank, *args)`` in each and returns the list of
return values by rank. A failure on any rank fails the caller with that
rank's traceback; one start whose port was taken before rank 0 listened on it
is tried again on another port.
"""
from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from megarl.distributed.ranks import free_port


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the chosen port: something took it after ``free_port`` saw it free."""


def spawn(fn, world_size: int, *args, timeout: float = 600, attempts: int = 3):
    """Results by rank; a start whose rendezvous port was taken in the meantime (a race with other
    tests' sockets under pytest-xdist) is retried on a new port, up to ``attempts`` times."""
    for attempt in range(attempts):
        try:
            return _spawn_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt + 1 == attempts:
                raise


def _spawn_once(fn, world_size: int, args: tuple, timeout: float):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                kind = _PortTaken if "EADDRINUSE" in value else RuntimeError
                raise kind(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def worker_actor(ckpt: str, tp: int = 1, pp: int = 1):
    """Inside a spawned worker: the process group, megatron's groups at (tp, pp) and an actor built from
    ``ckpt`` with the default config (one optimizer step planned). Returns (actor, groups)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(tp, pp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    return build_actor(cfg, groups, optimizer_steps=1), groups
