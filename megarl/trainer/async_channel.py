"""Point-to-point messages between the rollout and the training ranks (``trainer.mode=async``).

Everything travels over the world group's handle with explicit peer ranks (global ranks), one
tag per stream so the streams never interleave: rollout batches (rollout -> training), and the
weight pushes (training -> rollout: a header per push, then buckets). Objects are pickled into
a uint8 tensor sent after its length; sends are asynchronous and return an :class:`Outbox` entry
that keeps the buffers alive until the peer has them.
"""
from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.trainer.rollout import Rollout

BATCH_TAG, HEADER_TAG, BUCKET_TAG, START_TAG = 11, 12, 13, 14


@dataclass
class QueuedBatch:
    """One step's rollout batch of one data-parallel replica, as the queue carries it."""

    step: int  # the training step (0-based) that trains on it
    version: int  # policy version that sampled it: the weights after this many updates
    rollout: Rollout  # scored (rewards and shaping applied on the rollout ranks)
    engine_stats: dict[str, float] = field(default_factory=dict)  # the rollout engine's counters of this batch
    step_metrics: dict[str, float] = field(default_factory=dict)  # the same on every replica (dapo/*: summed)
    sampler_state: dict | None = None  # the prompt sampler after this batch's prompts (dynamic sampling: rounds)
    partial_state: dict | None = None  # rollout.partial: the replica's groups in flight after this batch


@dataclass
class Outbox:
    """Sends in flight: their work handles and the tensors they read."""

    works: list = field(default_factory=list)
    buffers: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.buffers = [], []


def rollout_to(rollout: Rollout, device) -> Rollout:
    """``rollout`` with its tensors on ``device`` (CPU to cross the queue, the trainer's device after)."""
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    batch = rollout.batch
    for f in dataclasses.fields(batch):
        setattr(batch, f.name, move(getattr(batch, f.name)))
    rollout.group_ids, rollout.scores = move(rollout.group_ids), move(rollout.scores)
    return rollout


def _encode(obj) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


def send_object(pg: dist.ProcessGroup, obj, dst: int, tag: int, outbox: Outbox) -> None:
    """Pickles ``obj`` and sends it to global rank ``dst`` (asynchronous; ``outbox`` holds it)."""
    size, data = _encode(obj)
    send_tensor(pg, size, dst, tag, outbox)
    send_tensor(pg, data, dst, tag, outbox)


def send_tensor(pg: dist.ProcessGroup, tensor: torch.Tensor, dst: int, tag: int, outbox: Outbox) -> None:
    outbox.buffers.append(tensor)
    outbox.works.append(pg.send([tensor], dst, tag))


def recv_object(pg: dist.ProcessGroup, src: int, tag: int):
    """The next object from global rank ``src`` on stream ``tag`` (blocking)."""
    size = torch.zeros(1, dtype=torch.int64)
    recv_tensor(pg, size, src, tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    recv_tensor(pg, data, src, tag)
    return pickle.loads(data.numpy().tobytes())


def recv_tensor(pg: dist.ProcessGroup, tensor: torch.Tensor, src: int, tag: int) -> None:
    pg.recv([tensor], src, tag).wait()
