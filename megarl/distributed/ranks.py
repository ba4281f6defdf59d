"""Who am I: rank discovery from torchrun, SLURM or MPI environments.

Each launcher leaves its own trail in the environment:

- torchrun (and ``python -m torch.distributed.run``): RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- SLURM ``srun``: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the node list;
  the master is the first node of the step's node list, the port derives from
  the job id so every task agrees without talking. Only a task of an srun step
  (SLURM_STEP_ID set) counts: the batch script itself also carries
  SLURM_PROCID=0 and SLURM_NTASKS=N, and a plain ``python`` there is one process.
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
    """First host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``.

    Handles several bracket groups and suffixes (``r[1-2]-n[07,9]-ib`` ->
    ``r1-n07-ib``); zero padding is kept.
    """
    text, host, i = nodelist.strip(), [], 0
    while i < len(text) and text[i] != ",":
        if text[i] == "[":
            end = text.find("]", i)
            if end < 0:
                raise ValueError(f"cannot parse SLURM node list {nodelist!r}: unclosed '['")
            host.append(re.split(r"[,-]", text[i + 1:end])[0])
            i = end + 1
        else:
            host.append(text[i])
            i += 1
    if not host:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return "".join(host)


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
    # the step's nodes (srun may use a subset of the job's); rank 0 runs on the first
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST") or "127.0.0.1")
    job_id = int(env.get("SLURM_JOB_ID", "0"))
    return RankInfo(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
        launcher="slurm",
    )


_MPI_RANK_KEYS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def _host_address(one_host: bool) -> str:
    """This host's address as the other ranks can reach it."""
    if one_host:
        return "127.0.0.1"
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return host
    # Debian maps the hostname to 127.0.1.1; other hosts must resolve the name
    return host if addr.startswith("127.") else addr


def _from_mpi(env) -> RankInfo:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            "launched by mpirun but mpi4py is missing; install it: pip install megarl[mpi]"
        ) from e
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank calls it
    master = None
    if comm.rank == 0:
        master = (env.get("MASTER_ADDR") or _host_address(node.size == comm.size),
                  int(env.get("MASTER_PORT") or free_port()))
    master_addr, master_port = comm.bcast(master, root=0)
    local_rank = env.get("OMPI_COMM_WORLD_LOCAL_RANK") or env.get("MPI_LOCALRANKID") or node.rank
    node.Free()
    return RankInfo(comm.rank, comm.size, int(local_rank), master_addr, master_port, "mpi")


def discover(env=None) -> RankInfo:
    """Reads the launcher's environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if in_step and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if any(k in env for k in _MPI_RANK_KEYS):
        return _from_mpi(env)
    return RankInfo(0, 1, 0, "127.0.0.1", free_port(), "single")
