"""Weights from the training ranks to the rollout ranks' policy copy, in flat buckets, resharded.

One push: the first training replica (data-parallel and context-parallel rank 0) of every pipeline
stage gathers each of its stage's parameters over its TP group and turns it into the Hugging Face
tensors it is made of (the exporter's ``merge_shards``: the layout every TP size agrees on); routed
experts are gathered over the expert-parallel and expert-TP groups too (the exporter's
``expert_hf_tensors``: every EP rank's experts, so the rollout copy, at EP 1, gets all of them), and
a LoRA actor's adapted weights go out merged, W + s B A, rounded as an export rounds them
(``adapted_weights``: the rollout copy has no adapters). The stage's TP rank 0 packs those tensors
into flat buckets of at most ``async.bucket_mb`` (``megarl_kernels.bucket.pack``) and sends each
bucket, after a small header naming its tensors, to every rollout rank. A rollout rank takes one
push from every stage's sender (:func:`push_sources`), views each bucket as tensors (``unpack``, no
copy) and cuts its own shard of each parameter for the rollout TP layout with the loader's
``read_shard`` (the same code that loads a checkpoint at that TP size), copied in place into the
parameters its engine reads: the engine keeps running, only its prefix cache is dropped. With
``rollout.engine=sglang`` the rollout ranks hold no Megatron copy: each received bucket's HF tensors
go straight into SGLang (:meth:`~megarl.rollout.sglang.SGLangEngine.load_weights`), which cuts its own
shards. A push that leaves an HF tensor out, or brings one the rollout side has no place for, is an error.

Every copy is exact (cat, split, slice, copy): the rollout's weights equal the trainer's bitwise
(SGLang's: the trainer's cast to ``rollout.sglang.dtype``, as the colocated stream casts them).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megarl_kernels.bucket import bucket_layout, pack, unpack

from megarl.distributed import device
from megarl.models.exporter import expert_hf_tensors, merge_shards, tp_shards
from megarl.models.loader import read_shard
from megarl.models.lora import adapted_weights
from megarl.models.weight_map import EXPERT_KINDS, model_rules
from megarl.trainer.async_channel import BUCKET_TAG, HEADER_TAG, Outbox, recv_object, recv_tensor, send_object, \
    send_tensor


def push_sources(ranks: list[dict]) -> list[int]:
    """The global ranks that send weights, in stage order: each pipeline stage's training rank at
    DP, CP and TP rank 0 (``ranks``: :meth:`Placement.directory` entries with those coordinates)."""
    senders = [r for r in ranks if r["role"] == "train" and r["dp_rank"] == r["tp_rank"] == 0
               and r.get("cp_rank", 0) == 0]
    return [r["rank"] for r in sorted(senders, key=lambda r: r.get("pp_rank", 0))]


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
    """Training side: one push per policy version (collective over each stage's first replica: its TP
    group, and for routed experts the expert-parallel and expert-TP groups that hold the others)."""

    def __init__(self, model, info, groups, placement, targets: list[int], bucket_bytes: int):
        self.model, self.info, self.groups = model, info, groups
        self.world, self.objects = placement.world, placement.objects  # buckets; headers
        self.targets = targets  # global ranks of the rollout ranks
        self.bucket_bytes = bucket_bytes
        self.gathers = groups.dp_rank == 0 and groups.cp_rank == 0  # the stage's replica whose weights go out
        self.sends = self.gathers and groups.tp_rank == 0
        # routed experts: the sender's expert-data-parallel replica (its EP and expert-TP groups) holds them all
        self.gathers_experts = info.moe is not None and dist.get_rank(groups.edp) == 0
        self.adapted = adapted_weights(model)  # LoRA: weight name -> its merged W + s B A (what is sent)
        self.outbox = Outbox()

    def push(self, version: int) -> dict[str, float]:
        """Sends the weights after ``version`` updates; returns weight_sync/* metrics (bytes: all stages)."""
        self.outbox.wait()  # the previous push's buffers are free once the rollout ranks have them
        if not (self.gathers or self.gathers_experts):
            return {"weight_sync/bytes": 0.0}
        self._header({"version": version, "stop": False})
        sent, pending = 0, {}
        rules = [(name, rule) for name, rule in model_rules(self.model, self.info).items() if rule.export]
        params = self.model.state_dict(keep_vars=True)
        for i, (name, rule) in enumerate(rules):
            pending.update(self._hf_tensors(name, rule, params[name]))
            last = i == len(rules) - 1
            if self.sends and (last or _nbytes(pending) >= self.bucket_bytes):
                sent += self._send_bucket(pending, last)
                pending = {}
        return {"weight_sync/bytes": self._all_stages(sent), "weight_sync/zero_copy": 0.0}

    def _hf_tensors(self, name: str, rule, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """One parameter's HF tensors on the sender (collective over the groups it is split over); {} elsewhere."""
        expert = rule.kind in EXPERT_KINDS
        if not (self.gathers_experts if expert else self.gathers):
            return {}
        weight = self.adapted[name]() if name in self.adapted else param
        if expert:
            tensors = expert_hf_tensors(rule, weight, self.groups)
            return tensors if self.sends else {}
        shards = tp_shards(weight, rule, self.groups)
        return merge_shards(rule, shards, self.info) if self.sends else {}

    def _all_stages(self, sent: int) -> float:
        """Bytes this push sent to each rollout rank, summed over the pipeline stages' senders."""
        if self.groups.pp_size == 1 or not self.gathers:
            return float(sent)
        total = torch.tensor([float(sent)], dtype=torch.float64, device=device())
        dist.all_reduce(total, group=self.groups.pp)
        return float(total.item())

    def stop(self) -> None:
        """Tells the rollout ranks to end (they are waiting for weights)."""
        self.outbox.wait()
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
        if last and not by_dtype:  # nothing left to send: an empty last bucket ends this stage's push
            spec = {"names": [], "shapes": [], "dtype": torch.float32, "last": True}
            for dst in self.targets:
                send_object(self.objects, spec, dst, BUCKET_TAG, self.outbox)
        return sent


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class PushReceiver:
    """Rollout side, the wire: receives each push from the global ranks ``sources`` (:func:`push_sources`, one
    per training pipeline stage) and hands its buckets, as they arrive, to a consumer: the rollout's Megatron
    copy (:class:`WeightReceiver`) or an engine that loads Hugging Face tensors itself (SGLang,
    :meth:`~megarl.rollout.sglang.SGLangEngine.load_weights`). ``names``: the HF tensors a push must bring;
    one it lacks, or one outside ``names``, is an error."""

    def __init__(self, names: set[str], placement, sources: list[int], device):
        self.names, self.sources, self.device = set(names), sources, device
        self.world, self.objects = placement.world, placement.objects  # buckets; headers

    def receive(self, consume) -> int | None:
        """Blocks for the next push (every source's); ``consume(buckets)`` takes an iterator over its buckets,
        ``{HF name: tensor}`` (views into the received bucket, in the pushed dtype), and must run it to the
        end. Returns the push's version, or None for a stop."""
        headers = [recv_object(self.objects, src, HEADER_TAG) for src in self.sources]
        if any(h["stop"] for h in headers):
            return None
        version = headers[0]["version"]
        if any(h["version"] != version for h in headers):
            raise RuntimeError(f"weight push: the stages sent versions {[h['version'] for h in headers]}")
        buckets = self._buckets(version)
        consume(buckets)
        if next(buckets, None) is not None:  # the rest of the push would be read as the next one
            raise RuntimeError(f"weight push {version}: its consumer stopped before the last bucket")
        return version

    def _buckets(self, version: int) -> Iterator[dict[str, torch.Tensor]]:
        missing, extra = set(self.names), []
        for src in self.sources:
            last = False
            while not last:
                spec = recv_object(self.objects, src, BUCKET_TAG)
                last = spec["last"]
                if not spec["names"]:
                    continue
                layout = bucket_layout(spec["shapes"], dtype=spec["dtype"])
                flat = torch.empty(layout.numel, dtype=spec["dtype"], device=self.device)
                recv_tensor(self.world, flat, src, BUCKET_TAG)
                tensors = dict(zip(spec["names"], unpack(flat, layout)))
                extra += [n for n in tensors if n not in self.names]
                missing.difference_update(tensors)
                yield {n: t for n, t in tensors.items() if n in self.names}
        if missing or extra:
            raise RuntimeError(f"weight push {version}: no tensors for {', '.join(sorted(missing)) or '-'}; "
                               f"tensors the rollout side has no place for: {', '.join(sorted(extra)) or '-'}")


class WeightReceiver:
    """Rollout side, the Megatron copy: each push (:class:`PushReceiver`) cut into ``model`` (this rank's TP
    shard) with the loader's ``read_shard``."""

    def __init__(self, model, info, groups, placement, sources: list[int]):
        self.info, self.groups = info, groups
        self.rules = model_rules(model, info)
        self.params = model.state_dict(keep_vars=True)
        names = {h for rule in self.rules.values() for h in rule.hf_names}
        self.wire = PushReceiver(names, placement, sources, next(iter(self.params.values())).device)

    def receive(self) -> int | None:
        """Blocks for the next push and copies it into the model; its version, or None for a stop."""
        return self.wire.receive(self._copy)

    def _copy(self, buckets: Iterator[dict[str, torch.Tensor]]) -> None:
        waiting, held = dict(self.rules), {}  # parameters not copied yet; tensors they need
        for tensors in buckets:
            held.update(tensors)
            held = self._apply(held, waiting)

    @torch.no_grad()
    def _apply(self, held: dict[str, torch.Tensor], waiting: dict) -> dict[str, torch.Tensor]:
        """Copies every waiting parameter whose HF tensors are all held (and drops it from ``waiting``);
        the held tensors a waiting parameter still needs (a parameter's tensors may span buckets)."""
        reader = TensorDict(held)
        for name in [n for n, rule in waiting.items() if all(h in held for h in rule.hf_names)]:
            param = self.params[name]
            param.copy_(read_shard(reader, waiting.pop(name), self.info, self.groups, param.shape[0]))
        needed = {h for rule in waiting.values() for h in rule.hf_names}
        return {n: t for n, t in held.items() if n in needed}
