"""Distributed start, process groups and the CPU compatibility layer."""
from megarl.distributed.groups import ParallelGroups, build_parallel_groups
from megarl.distributed.init import device, init_distributed
from megarl.distributed.ranks import RankInfo, discover

__all__ = [
    "ParallelGroups", "RankInfo", "build_parallel_groups", "device", "discover", "init_distributed",
]
