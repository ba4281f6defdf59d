"""Who am I: rank discovery from torchrun, SLURM or MPI environments.

Each launcher leaves its own trail in the environment:

- torchrun (and ``python -m torch.distributed.run``): RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- SLURM ``srun``: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the node list;
  the master is the first node of SLURM_JOB_NODELIST, the port derives from
  the job id so every task agrees without talking.
- ``mpirun``/``mpiexec``: OMPI_COMM_WORLD_* (Open MPI) or PMI_*/PMIX_* (MPICH,
  Intel MPI); through mpi4py rank 0 picks the master address and a free port
  and broadcasts them.

A plain ``python launch/ppo.py`` is a world of one.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _from_torchrun(env) -> RankInfo:
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", 29500)),
        launcher="torchrun",
    )


def _from_slurm(env) -> RankInfo:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    job_id = int(env.get("SLURM_JOB_ID", "0"))
    return RankInfo(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(env["SLURM_NTASKS"]),
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
        launcher="slurm",
    )


_MPI_RANK_KEYS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def _from_mpi(env) -> RankInfo:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            "launched by mpirun but mpi4py is missing; install it: pip install megarl[mpi]"
        ) from e
    comm = MPI.COMM_WORLD
    master = (socket.gethostbyname(socket.gethostname()), free_port()) if comm.rank == 0 else None
    master_addr, master_port = comm.bcast(master, root=0)
    local_rank = env.get("OMPI_COMM_WORLD_LOCAL_RANK") or env.get("MPI_LOCALRANKID")
    if local_rank is None:
        local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).rank
    return RankInfo(comm.rank, comm.size, int(local_rank), master_addr, master_port, "mpi")


def discover(env=None) -> RankInfo:
    """Reads the launcher's environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if any(k in env for k in _MPI_RANK_KEYS):
        return _from_mpi(env)
    return RankInfo(0, 1, 0, "127.0.0.1", free_port(), "single")
