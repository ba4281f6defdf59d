"""Distributed start, process groups and the CPU compatibility layer.

Names load lazily: ``from megarl.distributed import discover`` does not import
megatron-core (about 10 s), so a bad config or ``--help`` answers at once.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "ParallelGroups": "groups", "build_parallel_groups": "groups",
    "device": "init", "init_distributed": "init",
    "RankInfo": "ranks", "discover": "ranks",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'megarl.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megarl.distributed.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
