"""Start the job: find the rank, pick the backend and device, join the world."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.distributed import cpu_compat
from megarl.distributed.ranks import RankInfo, discover


def init_distributed(timeout_minutes: int = 30) -> RankInfo:
    """Joins the process group: nccl with CUDA (one GPU per local rank), gloo without.

    Safe to call twice; the second call returns the same RankInfo.
    """
    info = discover()
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        cpu_compat.install()
        backend = "gloo"
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = info.master_addr
        os.environ["MASTER_PORT"] = str(info.master_port)
        dist.init_process_group(
            backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return info


def device() -> torch.device:
    """This rank's compute device."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
