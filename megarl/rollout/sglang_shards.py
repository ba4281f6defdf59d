"""Each TP rank hands SGLang its own copy of a weight bucket.

SGLang 0.5.23's ``update_weights_from_tensor`` serializes a plain ``(name,
tensor)`` list once per SGLang TP worker, so with tensors living on TP rank 0
every worker maps rank 0's GPU memory (one CUDA IPC handle per tensor, read
across the GPUs). Its ``LocalSerializedTensor(values=[...])`` instead carries
one serialized tensor per SGLang TP rank, and worker ``i`` deserializes
``values[i]`` only. megarl's TP rank ``i`` shares its GPU with SGLang's TP
worker ``i`` (see megarl/rollout/sglang.py) and, after the weight stream's
all-gathers, holds the same full HF tensors on that GPU; so every TP rank
serializes its own tensors (a CUDA IPC handle: no copy) and TP rank 0 gathers
the handles. Each SGLang worker then reads its GPU-local copy and takes its
shard of it in ``load_weights``.

Lifetime: a rank must keep its bucket's tensors alive until SGLang has loaded
them; the caller holds the bucket until TP rank 0 has reported the bucket's
result to every TP rank.
"""
from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Callable, Optional

import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

from megarl.distributed import ParallelGroups
from megarl.rollout.weight_stream import NamedTensors


def serialize_tensor(t) -> bytes:
    """The tensor as ForkingPickler bytes (SGLang's MultiprocessingSerializer format): a CUDA IPC
    handle for a CUDA tensor, a shared-memory handle for a CPU one."""
    return bytes(ForkingPickler.dumps(t))


def gather_bucket(bucket: NamedTensors, groups: ParallelGroups,
                  wrap: Callable[[list[bytes]], object]) -> Optional[list[tuple[str, object]]]:
    """On TP rank 0: ``[(name, wrap([bytes of TP rank 0, 1, ...]))]`` in bucket order; None elsewhere.

    Collective over TP; every TP rank passes its own copy of the same bucket (same names, in order).
    """
    mine = [(name, serialize_tensor(t)) for name, t in bucket]
    if groups.tp_size == 1:
        return [(name, wrap([payload])) for name, payload in mine]
    everyone = [None] * groups.tp_size if groups.tp_rank == 0 else None
    dist.gather_object(mine, everyone, dst=groups.tp_src_rank, group=groups.tp)
    if groups.tp_rank != 0:
        return None
    names = [name for name, _ in mine]
    for rank, theirs in enumerate(everyone):
        if [name for name, _ in theirs] != names:
            raise RuntimeError(f"weight bucket of TP rank {rank} has other tensors than TP rank 0's")
    return [(name, wrap([theirs[k][1] for theirs in everyone])) for k, name in enumerate(names)]
