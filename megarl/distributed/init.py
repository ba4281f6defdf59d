"""Start the job: find the rank, pick the backend and device, join the world.

Every collective has a timeout (``trainer.collective_timeout_s``): a rank whose
peer died or hangs fails loudly after that long instead of waiting forever.
The world group gets it here; :func:`megarl.distributed.groups.build_parallel_groups`
gives megatron-core's groups the same one (:func:`collective_timeout_s`).

Restarts under ``torchrun --max-restarts``: torchrun's default (static)
rendezvous keeps one store for every attempt, so a restarted worker would read
the dead attempt's gloo addresses and fail to connect. Each attempt therefore
joins under its own store prefix (``TORCHELASTIC_RESTART_COUNT``).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.distributed import cpu_compat
from megarl.distributed.ranks import RankInfo, discover

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
_timeout_s = DEFAULT_COLLECTIVE_TIMEOUT_S


def collective_timeout_s() -> float:
    """The timeout the world group was joined with (the default before that)."""
    return _timeout_s


def _attempt_store(info: RankInfo, timeout: datetime.timedelta):
    """The launcher's store (env:// rendezvous), under a prefix of this restart attempt."""
    store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megarl/attempt_{attempt}/", store)


def init_distributed(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> RankInfo:
    """Joins the process group: nccl with CUDA (one GPU per local rank), gloo without.

    ``timeout_s`` bounds every collective of the world group (and of the groups
    built later). Safe to call twice; the second call returns the same RankInfo.
    """
    global _timeout_s
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
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_attempt_store(info, timeout), rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
        _timeout_s = timeout_s
    return info


def device() -> torch.device:
    """This rank's compute device."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
