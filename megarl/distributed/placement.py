"""Rollout and training ranks as two process sets of one launch (``trainer.mode=async``).

Every rank joins the world, then :func:`build_placement` creates, on all ranks in the same
order, one group per role (the last ``placement.rollout_ranks`` ranks generate, the others
train). :meth:`Placement.enter` makes this rank's role group the default group: from then on
``dist.get_rank()`` / ``get_world_size()``, megatron-core's ``initialize_model_parallel`` and
every collective without an explicit group see only the ranks of this role, so the training
ranks build their TP / DP groups among themselves and the rollout ranks theirs (a sub-world).
The two sets talk only point to point, over handles of world-wide groups whose ranks are the
global ranks (:attr:`Placement.objects`, gloo, for pickled batches and headers on the host;
:attr:`Placement.world`, the launch's backend, for weight buckets on the device); nothing asks whether a rank is rank 0: a rank's role is the
group it belongs to.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROLLOUT, TRAIN = "rollout", "train"


@dataclass
class Placement:
    """This rank's role, the ranks of each role (global ranks) and the groups."""

    role: str  # ROLLOUT | TRAIN
    rollout_ranks: list[int]
    train_ranks: list[int]
    world: dist.ProcessGroup  # the whole launch (nccl on GPUs): weight buckets; ranks = global ranks
    objects: dist.ProcessGroup  # the whole launch over gloo: pickled objects (batches, headers) on the host
    own: dist.ProcessGroup  # this role's ranks: the default group after enter()
    global_rank: int

    @property
    def is_rollout(self) -> bool:
        return self.role == ROLLOUT

    def enter(self) -> None:
        """Makes this role's group the default one (a sub-world of this role's ranks)."""
        c10d._world.default_pg = self.own

    def leave(self) -> None:
        """The world is the default group again (before destroy_process_group)."""
        c10d._world.default_pg = self.world

    def directory(self, coords: dict) -> list[dict]:
        """Every rank's ``coords`` (role, dp_rank, tp_rank, ...) by global rank; collective over the world."""
        mine = dict(coords, role=self.role, rank=self.global_rank)
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.objects.size())]
        self.objects.allgather([sizes], [size]).wait()
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
        self.objects.allgather([outs], [padded]).wait()
        return [pickle.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes)]


def build_placement(rollout_ranks: int) -> Placement:
    """Both role groups, created on every rank (collective over the world); the last ``rollout_ranks``
    ranks generate. Call once, right after the world is joined."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    rollout = list(range(world_size - rollout_ranks, world_size))
    train = [r for r in range(world_size) if r not in rollout]
    world = c10d._get_default_group()
    groups = {TRAIN: dist.new_group(train), ROLLOUT: dist.new_group(rollout)}
    objects = dist.new_group(list(range(world_size)), backend="gloo")
    role = ROLLOUT if rank in rollout else TRAIN
    return Placement(role, rollout, train, world, objects, groups[role], rank)
