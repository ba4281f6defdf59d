"""Rollout routing replay (R3): training forwards route every token to the experts the rollout used.

The native engine records, for each response token, the top-k expert ids of every MoE layer for
the row that sampled it (``GenerationResult.expert_ids``, megarl/rollout/runners.py), and for
prompt tokens 0 .. P - 2 the rows of their prefill (``GenerationResult.prompt_expert_ids``: a
prompt is prefilled once for its n samples, which all carry that prefill's ids, as their K/V are
that prefill's; tokens whose K/V pages come from the prefix cache carry the ids of the forward that
computed those pages, kept beside them: megarl/rollout/pages.py ``PageExperts``). In the batch they sit per *position*, as the model reads them:
``SampleBatch.expert_ids[i, t]`` (layers, k) are the experts that routed input token t of row i, so
prompt token t is at position t and the ids of response token j (prompt length P) are at position
P + j - 1 (the prompt's last token's row sampled response token 0). Positions the engine did not
record (a sequence's last token, padding) hold :func:`unrecorded`; there the router picks its own top-k.
A sequence built over several engine calls (multi-turn turns, an HTTP agent's calls, a partial
rollout resumed in a later step) carries one record merged call by call (megarl/rollout/expert_record.py).

:class:`ReplayRouters` installs a :class:`LayerReplay` as ``router_replay`` of every megatron-core
``TopKRouter`` of a model stage. megatron-core's ``topk_routing_with_score_function`` hands it the
scores the top-k is taken over — the router logits (Mixtral; Qwen with norm_topk_prob) or the
softmax over all experts (Qwen2-MoE's default) — and takes back ``(values, ids)``: with replay the
ids are the recorded ones and the values are the current scores gathered at them, so the gate
weights (softmax over those logits, or those probabilities) come from the current router and its
weight keeps its gradient. Before each micro-batch's forward :meth:`ReplayRouters.load` lays the
micro-batch's ids out in megatron's token order ([s, b] flattened, s major; a packed THD row is
b = 1), and each router reads its global layer (``layer_number - 1``): pipeline stages need
nothing else, and ids are global expert ids, which is what an EP rank's router routes to.

Full activation recompute runs each layer's forward twice: once under ``no_grad`` in the forward
pass, once in backward, in the same micro-batch order (1F1B). A router in training mode therefore
queues the ids of its ``no_grad`` forwards and its grad-enabled forwards take them back in order.

Every forward with ids loaded also counts, per layer, how many recorded (token, k) choices the
router's own top-k contains (:meth:`ReplayRouters.read`): the routing agreement between rollout
and training. ``replace=False`` (:meth:`ReplayRouters.observing`) counts without replaying.
Context parallelism: each CP rank's routers see its chunks of every sequence (megarl/models/
context_parallel.py); the ids are laid out on the global packed row and cut the same way. Sequence
parallelism (TP > 1, which megatron-core's MoE layer trains with): the embedding hands TP rank r the
r-th of tp equal slices of the [s, b] tokens along s (the packed row, or the padded rows' columns,
padded to a multiple of tp: ``RunOptions.pad_multiple``), and the residual stream stays split up to
the routers, so rank r's routers read the r-th contiguous slice of the flattened token order
(:func:`sequence_slice`). Without sequence parallelism (TP > 1 in forward-only phases of a model built
without it) every TP rank routes every token, the same on each. CP and sequence parallelism do not
combine for an MoE model (megarl/config_checks/moe.py).
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.distributed import device


def ids_dtype(num_experts: int) -> torch.dtype:
    """uint8 while every id and the unrecorded mark (255) fit; int16 (mark -1) from 256 experts."""
    return torch.uint8 if num_experts <= 255 else torch.int16


def unrecorded(dtype: torch.dtype) -> int:
    """The value of a position with no recorded ids."""
    return 255 if dtype == torch.uint8 else -1


def unrecorded_mark(dtype: np.dtype) -> int:
    """:func:`unrecorded` for a numpy dtype (the engine's arrays)."""
    return unrecorded(torch.uint8 if dtype == np.uint8 else torch.int16)


def recorded(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(..., layers, k) stored ids -> (...) bool: the position holds real expert ids (all layers or none)."""
    first = ids[..., 0, 0].long()
    return (first >= 0) & (first < num_experts)


def batch_expert_ids(results, width: int) -> Optional[torch.Tensor]:
    """Engine results -> (B, width, layers, k) per-position ids (module docstring), in the engine's dtype
    (:func:`ids_dtype`); None when no result carries ids. Result i's prompt ids (P - 1, layers, k) go to
    positions 0 .. P - 2, its response ids (R, layers, k) to positions P - 1 .. P + R - 2."""
    arrays = [r.expert_ids for r in results if r.expert_ids is not None]
    if not arrays:
        return None
    dtype = torch.uint8 if arrays[0].dtype == np.uint8 else torch.int16
    out = torch.full((len(results), width, *arrays[0].shape[1:]), unrecorded(dtype), dtype=dtype)

    def put(i: int, start: int, ids: Optional[np.ndarray]) -> None:
        if ids is not None and len(ids):
            out[i, start:start + len(ids)] = torch.from_numpy(np.ascontiguousarray(ids)).to(dtype)

    for i, r in enumerate(results):
        put(i, 0, r.prompt_expert_ids)  # prompt tokens 0 .. P - 2
        put(i, len(r.prompt_ids) - 1, r.expert_ids)  # the rows that sampled each response token
    return out


def all_stage_layers(ids: Optional[torch.Tensor], groups) -> Optional[torch.Tensor]:
    """(B, L, stage layers, k) this pipeline stage's recorded layers -> (B, L, all layers, k), stage
    order, on every stage (collective over the PP group; parallel.pp divides the layers, so every
    stage holds as many); as is at pp = 1."""
    if groups.pp_size == 1 or ids is None:
        return ids
    parts = [torch.empty_like(ids) for _ in range(groups.pp_size)]
    dist.all_gather(parts, ids.contiguous(), group=groups.pp)
    return torch.cat(parts, dim=2)


def pad_positions(ids: torch.Tensor, width: int) -> torch.Tensor:
    """(B, W, layers, k) right-padded (or cut) to ``width`` positions with :func:`unrecorded`."""
    if ids.size(1) >= width:
        return ids[:, :width]
    pad = ids.new_full((ids.size(0), width - ids.size(1), *ids.shape[2:]), unrecorded(ids.dtype))
    return torch.cat([ids, pad], dim=1)


def model_order(ids: torch.Tensor, lengths: torch.Tensor, inputs, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's (b, l, layers, k) per-position ids -> (tokens, layers, k) int64 and (tokens,) bool
    recorded, in the order the routers see tokens: [s, b] flattened (padded rows), or the packed row
    (``inputs.starts``; its padding segment unrecorded), under context parallelism this CP rank's
    chunks of the global packed row (``inputs.cp``, as its tokens are cut). Positions past a
    sequence's length are unrecorded whatever they hold."""
    b, width = ids.shape[:2]
    inside = torch.arange(width, device=ids.device)[None, :] < lengths.to(ids.device)[:, None]  # (b, l)
    valid = recorded(ids, num_experts) & inside
    long_ids = ids.long()
    if not inputs.packed:  # (b, l) -> (s, b) flattened; columns past l (sequence-parallel padding) unrecorded
        s = inputs.input_ids.size(1)
        long_ids, valid = F.pad(long_ids, (0, 0, 0, 0, 0, max(s - width, 0))), F.pad(valid, (0, max(s - width, 0)))
        return long_ids[:, :s].transpose(0, 1).reshape(s * b, *ids.shape[2:]), valid[:, :s].t().reshape(-1)
    total = inputs.input_ids.size(1) if inputs.cp is None else inputs.cp.total  # T of the global row
    index = inputs.starts.to(ids.device)[:, None] + torch.arange(width, device=ids.device)  # (b, l) in the row
    out = long_ids.new_zeros(total, *ids.shape[2:])
    mask = valid.new_zeros(total)
    out[index[inside]] = long_ids[inside]
    mask[index[inside]] = valid[inside]
    if inputs.cp is not None:  # (T, ...) -> (t, ...): this CP rank's chunks
        return inputs.cp.local(out[None])[0], inputs.cp.local(mask[None])[0]
    return out, mask


def sequence_slice(ids: torch.Tensor, valid: torch.Tensor, split: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, ...) ids and (tokens,) valid in the routers' token order over the whole sequence ->
    TP rank ``rank``'s contiguous 1 / ``split`` of them, the tokens its routers see under sequence
    parallelism (as is at split 1)."""
    if split == 1:
        return ids, valid
    if ids.size(0) % split:
        raise ValueError(f"router replay: {ids.size(0)} tokens do not split over {split} sequence-parallel "
                         "ranks (RunOptions.pad_multiple should be the TP size)")
    n = ids.size(0) // split
    return ids[rank * n:(rank + 1) * n], valid[rank * n:(rank + 1) * n]


class LayerReplay:
    """One router's replay: megatron-core calls :meth:`get_replay_topk` for its top-k."""

    def __init__(self, owner: "ReplayRouters", layer: int, router):
        self.owner, self.layer, self.router = owner, layer, router
        self.queue: deque = deque()  # (ids, valid) of no_grad training forwards, for full recompute
        self.agree = torch.zeros((), dtype=torch.float64)  # recorded choices the router's own top-k holds
        self.total = torch.zeros((), dtype=torch.float64)  # recorded choices seen

    def _current(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], bool]:
        """(ids, valid, count): this forward's replay ids; a recompute takes its first pass's."""
        o = self.owner
        if self.router.training and self.queue and torch.is_grad_enabled():
            return (*self.queue.popleft(), False)  # the recompute in backward: counted once already
        if o.ids is None:
            return None, None, False
        ids, valid = o.ids[:, self.layer], o.valid
        if self.router.training and not torch.is_grad_enabled():  # a checkpointed first pass
            self.queue.append((ids, valid))
        return ids, valid, True

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """scores (tokens, E) -> (values (tokens, k), ids (tokens, k)): recorded ids where recorded."""
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        ids, valid, count = self._current()
        if ids is None:
            return values, own
        if ids.shape[0] != scores.shape[0]:
            raise ValueError(f"router replay, layer {self.layer}: {ids.shape[0]} tokens of ids for "
                             f"{scores.shape[0]} routed tokens")
        ids, valid = ids.to(scores.device), valid.to(scores.device)
        if count:
            self._count(ids, own, valid)
        if not self.owner.replace:
            return values, own
        chosen = torch.where(valid[:, None], ids, own)  # (tokens, k)
        return scores.gather(1, chosen), chosen

    @torch.no_grad()
    def _count(self, ids: torch.Tensor, own: torch.Tensor, valid: torch.Tensor) -> None:
        hit = (ids[:, :, None] == own[:, None, :]).any(-1)  # (tokens, k): recorded choice in own top-k
        self.agree = self.agree.to(ids.device) + (hit & valid[:, None]).sum(dtype=torch.float64)
        self.total = self.total.to(ids.device) + valid.sum(dtype=torch.float64) * ids.shape[1]


class ReplayRouters:
    """Every MoE router of a model stage, replaying the micro-batch loaded last."""

    def __init__(self, module, groups, num_experts: int, topk: int, num_layers: int):
        self.groups, self.num_experts, self.topk, self.num_layers = groups, num_experts, topk, num_layers
        self.ids: Optional[torch.Tensor] = None  # (tokens, all layers, k) int64 of the current micro-batch
        self.valid: Optional[torch.Tensor] = None  # (tokens,) bool
        self.replace = True  # False: count agreement only, the routers choose
        self.layers: list[LayerReplay] = []
        for m in module.modules():
            if hasattr(m, "router") and hasattr(m, "token_dispatcher"):
                replay = LayerReplay(self, m.router.layer_number - 1, m.router)  # global layer, 0-based
                m.router.router_replay = replay
                self.layers.append(replay)
        sequence_parallel = any(layer.router.config.sequence_parallel for layer in self.layers)
        self.split = groups.tp_size if sequence_parallel else 1  # TP ranks the routers' tokens are split over

    def start(self) -> None:
        """A new run of micro-batches: nothing loaded, no recompute pending."""
        self.ids = self.valid = None
        for layer in self.layers:
            layer.queue.clear()

    def load(self, batch_ids: Optional[torch.Tensor], lengths: torch.Tensor, inputs) -> None:
        """The next forward's ids: a micro-batch's (b, l, layers, k) per position (None: routers choose)."""
        if batch_ids is None:
            self.ids = self.valid = None
            return
        layers, k = batch_ids.shape[2:]
        if (layers, k) != (self.num_layers, self.topk):
            raise ValueError(f"recorded expert ids cover {layers} layers x top-{k}; the model routes "
                             f"{self.num_layers} layers x top-{self.topk} (rollouts of another model?)")
        ids, valid = model_order(batch_ids, lengths, inputs, self.num_experts)  # (tokens, layers, k), (tokens,)
        self.ids, self.valid = sequence_slice(ids, valid, self.split, self.groups.tp_rank)

    @contextmanager
    def observing(self):
        """Forwards inside count agreement with the loaded ids but route by the router's own top-k."""
        self.replace = False
        try:
            yield
        finally:
            self.replace = True

    def reset(self) -> None:
        for layer in self.layers:
            layer.agree, layer.total = layer.agree.new_zeros(()), layer.total.new_zeros(())

    def read(self, prefix: str = "r3") -> dict[str, float]:
        """Agreement since the last read, over every rank (collective over the world):
        ``{prefix}/agreement/layer_N`` and their mean ``{prefix}/agreement``; {} when nothing was recorded."""
        counts = torch.zeros(self.num_layers, 2, dtype=torch.float64)
        for layer in self.layers:
            counts[layer.layer] += torch.stack([layer.agree.cpu(), layer.total.cpu()])
        self.reset()
        counts = counts.to(device())
        dist.all_reduce(counts)  # layers of every stage, tokens of every DP rank (routers see disjoint tokens)
        counts = counts.cpu()
        if counts[:, 1].sum() == 0:
            return {}
        per_layer = {f"{prefix}/agreement/layer_{i}": float(a / t) for i, (a, t) in enumerate(counts.tolist()) if t}
        return {f"{prefix}/agreement": sum(per_layer.values()) / len(per_layer), **per_layer}
