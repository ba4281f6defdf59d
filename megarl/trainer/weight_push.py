"""Weights from the training ranks to the rollout ranks' policy copy, in flat buckets, resharded.

One push: the first training replica (data-parallel rank 0) gathers each parameter over its TP
group and turns it into the Hugging Face tensors it is made of (the exporter's ``merge_shards``:
the layout every TP size agrees on); its TP rank 0 packs those tensors into flat buckets of at
most ``async.bucket_mb`` (``megarl_kernels.bucket.pack``) and sends each bucket, after a small
header naming its tensors, to every rollout rank. A rollout rank views the bucket as tensors
(``unpack``, no copy) and cuts its own shard of each parameter for the rollout TP layout with the
loader's ``read_shard`` (the same code that loads a checkpoint at that TP size), copied in place
into the parameters its engine reads: the engine keeps running, only its prefix cache is dropped.

Every copy is exact (cat, split, slice, copy): the rollout's weights equal the trainer's bitwise.
"""
from __future__ import annotations

import torch
from megarl_kernels.bucket import bucket_layout, pack, unpack

from megarl.models.exporter import merge_shards, tp_shards
from megarl.models.loader import read_shard
from megarl.models.weight_map import model_rules
from megarl.trainer.async_channel import BUCKET_TAG, HEADER_TAG, Outbox, recv_object, recv_tensor, send_object, \
    send_tensor


class TensorDict:
    """The reader ``read_shard`` expects, over tensors already in memory (a received bucket's views)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor:
        t = self.tensors[name]
        t = t[slice(*rows)] if rows else t
        return t[:, slice(*cols)] if cols else t


class WeightPusher:
    """Training side: one push per policy version (collective over the first replica's TP group)."""

    def __init__(self, model, info, groups, placement, targets: list[int], bucket_bytes: int):
        self.model, self.info, self.groups = model, info, groups
        self.world, self.objects = placement.world, placement.objects  # buckets; headers
        self.targets = targets  # global ranks of the rollout ranks
        self.bucket_bytes = bucket_bytes
        self.gathers = groups.dp_rank == 0 and groups.cp_rank == 0  # the replica whose weights go out
        self.sends = self.gathers and groups.tp_rank == 0
        self.outbox = Outbox()

    def push(self, version: int) -> dict[str, float]:
        """Sends the weights after ``version`` updates; returns weight_sync/* metrics."""
        self.outbox.wait()  # the previous push's buffers are free once the rollout ranks have them
        if not self.gathers:
            return {"weight_sync/bytes": 0.0}
        self._header({"version": version, "stop": False})
        sent, pending = 0, {}
        rules = model_rules(self.model, self.info)
        params = self.model.state_dict(keep_vars=True)
        for i, (name, rule) in enumerate(rules.items()):
            shards = tp_shards(params[name], rule, self.groups)
            if self.sends:
                pending.update(merge_shards(rule, shards, self.info))
                last = i == len(rules) - 1
                if last or _nbytes(pending) >= self.bucket_bytes:
                    sent += self._send_bucket(pending, last)
                    pending = {}
        return {"weight_sync/bytes": float(sent), "weight_sync/zero_copy": 0.0}

    def stop(self) -> None:
        """Tells the rollout ranks to end (they are waiting for weights)."""
        self.outbox.wait()
        if self.gathers:
            self._header({"version": -1, "stop": True})
        self.outbox.wait()

    def _header(self, header: dict) -> None:
        if self.sends:
            for dst in self.targets:
                send_object(self.objects, header, dst, HEADER_TAG, self.outbox)

    def _send_bucket(self, tensors: dict[str, torch.Tensor], last: bool) -> int:
        """One flat bucket per dtype among ``tensors``; returns bytes sent per target."""
        sent = 0
        by_dtype: dict[torch.dtype, dict] = {}
        for name, t in tensors.items():
            by_dtype.setdefault(t.dtype, {})[name] = t.contiguous()
        for j, (dtype, group) in enumerate(by_dtype.items()):
            flat = pack(list(group.values()), bucket_layout(list(group.values())))
            spec = {"names": list(group), "shapes": [tuple(t.shape) for t in group.values()], "dtype": dtype,
                    "last": last and j == len(by_dtype) - 1}
            for dst in self.targets:
                send_object(self.objects, spec, dst, BUCKET_TAG, self.outbox)
                send_tensor(self.world, flat, dst, BUCKET_TAG, self.outbox)
            sent += flat.numel() * flat.element_size()
        return sent


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class WeightReceiver:
    """Rollout side: receives pushes from global rank ``source`` into ``model`` (this rank's TP shard)."""

    def __init__(self, model, info, groups, placement, source: int):
        self.model, self.info, self.groups, self.source = model, info, groups, source
        self.world, self.objects = placement.world, placement.objects  # buckets; headers
        self.rules = model_rules(model, info)
        self.params = model.state_dict(keep_vars=True)
        self.device = next(iter(self.params.values())).device

    def receive(self) -> int | None:
        """Blocks for the next push and copies it into the model; its version, or None for a stop."""
        header = recv_object(self.objects, self.source, HEADER_TAG)
        if header["stop"]:
            return None
        done = set()
        while True:
            spec = recv_object(self.objects, self.source, BUCKET_TAG)
            layout = bucket_layout(spec["shapes"], dtype=spec["dtype"])
            flat = torch.empty(layout.numel, dtype=spec["dtype"], device=self.device)
            recv_tensor(self.world, flat, self.source, BUCKET_TAG)
            done |= self._apply(TensorDict(dict(zip(spec["names"], unpack(flat, layout)))))
            if spec["last"]:
                break
        missing = sorted(set(self.rules) - done)
        if missing:
            raise RuntimeError(f"weight push {header['version']} lacked tensors for {', '.join(missing)}")
        return header["version"]

    @torch.no_grad()
    def _apply(self, reader: TensorDict) -> set[str]:
        """Copies every parameter whose HF tensors are all in ``reader``; their names."""
        done = set()
        for name, rule in self.rules.items():
            if all(h in reader.tensors for h in rule.hf_names):
                param = self.params[name]
                param.copy_(read_shard(reader, rule, self.info, self.groups, param.shape[0]))
                done.add(name)
        return done
