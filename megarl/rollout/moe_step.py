"""The MLP of a mixture-of-experts layer in the rollout engine, on the actor's MoE modules in place.

One layer's step: the router (its fp32 logits and top-k, as megatron-core's ``TopKRouter``
computes them, so rollout and training pick the same experts), the routed experts in one
`fused_moe` call over the layer's expert weights, and Qwen2-MoE's shared expert scaled by
``sigmoid(gate(x))``. Routing mirrors ``moe_utils.topk_routing_with_score_function`` with the
softmax score: ``pre_softmax`` (Qwen2-MoE without norm_topk_prob) takes the softmax over all
experts, then the k largest probabilities; otherwise the k largest logits, then a softmax over
those k (Mixtral; Qwen with norm_topk_prob) — megarl/models/moe.py maps the families onto it.

Expert weights. ``GroupedMLP`` (CUDA bf16) keeps all local experts in ``weight1`` (H, E * 2F)
and ``weight2`` (E * F, H): ``w13`` (E, 2F, H) and ``w2`` (E, H, F) are strided views of them, no
copy. ``SequentialMLP`` (one ``MLP`` per expert, CPU / fp32) has no common storage, so its
weights are stacked into engine-owned tensors by :meth:`MoeWeights.refresh`, which the engine
calls at the start of every generate call (a copy of the experts, taken after the last update).
LoRA on routed experts (per-expert linears' adapters on SequentialMLP, megarl/models/lora.py;
stacked ones on GroupedMLP, megarl/models/lora_grouped.py) is merged into such a copy, W + s B A
rounded once as the HF export merges it: a GroupedMLP with adapters gets an engine-owned stacked
copy too, views only without them. A shared expert's adapters run unmerged, as the dense MLP's
(``shared_lora``).

Expert parallelism (EP > 1): each rank holds experts [first, first + E_local). Every rank of the
EP group routes its own rows, the group all-gathers the rows (padded to the group's largest row
count, pads routed to no expert) with their routing, each rank adds its experts' share of every
row (`fused_moe_local`), and an all-reduce sums the shares; each rank keeps its own rows. The
ranks must therefore run their MoE layers in lockstep: every step opens with :meth:`EpStep.agree`,
a two-integer all-reduce MAX on the host (a gloo group over the EP ranks, built once:
`host_group`), so the loop never waits for the device and can plan ahead; and a rank with nothing
left runs idle steps (no rows of its own, its experts still serve the others) until the whole group
is done — and so does a rank of ``serve`` that waits for follow-up requests (an agent's next call, a
tool's result) whose caller says more may come (``FollowUps.pending``), so the others decode on
meanwhile. Every rank thus makes the same sequence of collectives.

CUDA graphs at EP across DP. Each rank brings its step's row count and whether it can take a graph
step (a decode that fits the decode graphs, or idle on an engine that has them). If every rank can,
the step is a graph step: every rank replays its decode graph of the group's largest bucket
(``StepShape.rows``), idle ranks with no real rows, so the exchange inside the graph has a fixed row
count and the graph's key is the agreed bucket: every rank captures the same buckets at the same
steps (a capture runs the body twice before recording it, which must be matched on every rank).
Otherwise every rank runs the step eagerly with the agreed row count (a decode or a small prefill
still through the graphs' static buffers, uncaptured, so its tokens stay on the device and run-ahead
keeps working; prefills are never captured at EP, as their (tokens, rows) keys differ per rank).
Padded rows — those that write their K/V to slot 0, the scratch page that the page pool never hands
out — are routed to no expert (id ``num_experts``): they cost no expert work and touch no real row.
The captured path at EP is not verified on a GPU here (the CPU tests run the same buffers eagerly).

Tensor parallelism (TP > 1). Every rank of a TP group holds the same rows after attention, so its
router picks the same experts. The experts' FFN is split over the expert-tensor group (ETP, by
default = TP: the same ranks, megatron-core numbering both axes from the stage's first rank): each
rank's ``w13`` (E_local, 2F/etp, h) / ``w2`` (E_local, h, F/etp) give a partial sum, completed by an
all-reduce over ETP (:class:`MoeSums`). The shared expert is a dense MLP split over TP (fc1 by
columns, fc2 by rows, its gate replicated): its output is a partial sum over TP; where ETP = TP one
all-reduce completes routed + shared. ETP must divide TP (its ranks then lie in one TP group and hold
the same rows); megarl/config_checks/moe.py refuses other layouts. An EP group may hold TP peers
(ETP < TP). Inside one TP group (TP2 x EP2 x ETP1 on 2 ranks: EP = TP) its ranks already hold the same
rows: each adds its experts' share and the shares are all-reduced like a TP partial, no rows
exchanged, no lockstep (CUDA graphs stay on). Across TP groups (TP2 x EP4 x ETP1 on 4 ranks) a TP
group's rows arrive once per peer in the gather; only the first peer's copy (``EpStep.slot``) is
routed to experts and every peer reads its output there (each copy's own slot would sum right too,
at tp / etp times the expert work). A TP group's ranks are always in the same state (same scheduler,
same steps), so a TP group that is done runs its idle steps together, which need only the EP exchange.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models.lora import linear_delta, merged_weight
from megarl.models.lora_grouped import grouped_adapters, weight_deltas
from megarl_kernels.fused_moe import fused_moe_local
from megarl_kernels.swiglu import silu_mul


@dataclass
class MoeWeights:
    """One MoE layer's parameters: references, except the stacked copy of a SequentialMLP's experts."""

    router: torch.Tensor  # (E, h)
    w13: torch.Tensor  # (E_local, 2F, h): gate rows, then up rows
    w2: torch.Tensor  # (E_local, h, F)
    first_expert: int  # global id of local expert 0
    topk: int
    pre_softmax: bool  # softmax over all experts before the top-k (no renormalization)
    shared_fc1: Optional[torch.Tensor]  # (2 Fs, h)
    shared_fc2: Optional[torch.Tensor]  # (h, Fs)
    shared_gate: Optional[torch.Tensor]  # (1, h)
    experts: object = None  # SequentialMLP, or GroupedMLP with adapters, to restack from (None: views)
    shared_lora: dict = field(default_factory=dict)  # "fc1" / "fc2" -> the shared expert's adapter (stage.LoraWeights)

    def refresh(self) -> None:
        """Copies the experts' current weights (LoRA merged) into the stacked ``w13`` / ``w2``."""
        if self.experts is None:
            return
        with torch.no_grad():
            if hasattr(self.experts, "weight1"):  # GroupedMLP with adapters
                w13, w2 = _grouped_views(self.experts, _merged_grouped(self.experts))
                self.w13.copy_(w13)
                self.w2.copy_(w2)
                return
            for e, mlp in enumerate(self.experts.local_experts):
                self.w13[e].copy_(_merged(mlp.linear_fc1))
                self.w2[e].copy_(_merged(mlp.linear_fc2))

    def tensors(self) -> list[torch.Tensor]:
        out = [self.router, self.w13, self.w2, self.shared_fc1, self.shared_fc2, self.shared_gate]
        out += [t for ad in self.shared_lora.values() for t in (ad.a, ad.b)]
        return [t for t in out if t is not None]


def _merged(linear) -> torch.Tensor:
    """A linear's weight, plus s B A (in fp32, rounded once, as the export) where it carries an enabled adapter."""
    if not getattr(linear, "lora_enabled", False):
        return linear.weight
    return merged_weight(linear.weight, linear_delta(linear))


def _merged_grouped(experts) -> dict[str, torch.Tensor]:
    """A GroupedMLP's weight1 / weight2, plus s B A (fp32, rounded once) of its enabled adapters."""
    deltas = weight_deltas(experts)
    return {name: merged_weight(getattr(experts, name), deltas[name]) if name in deltas else getattr(experts, name)
            for name in ("weight1", "weight2")}


def _grouped_views(experts, weights: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupedMLP weight1 (h, E*2F) / weight2 (E*F, h) -> w13 (E, 2F, h), w2 (E, h, F) views."""
    local, h = experts.num_local_experts, experts.config.hidden_size
    w13 = weights["weight1"].view(local, h, -1).transpose(1, 2)
    w2 = weights["weight2"].view(local, -1, h).transpose(1, 2)
    return w13, w2


def moe_weights(mlp, groups) -> Optional[MoeWeights]:
    """The :class:`MoeWeights` of a megatron ``MoELayer`` (None for a dense MLP)."""
    router = getattr(mlp, "router", None)
    if router is None:
        return None
    cfg, experts = mlp.config, mlp.experts
    local = experts.num_local_experts
    if hasattr(experts, "weight1"):  # GroupedMLP: views, no copy; with adapters a stacked merged copy
        w13, w2 = _grouped_views(experts, {"weight1": experts.weight1, "weight2": experts.weight2})
        source = experts if grouped_adapters(experts) else None
        if source is not None:
            w13, w2 = w13.new_empty(w13.shape), w2.new_empty(w2.shape)  # (E, 2F, h), (E, h, F) contiguous
    else:  # SequentialMLP: stacked (refresh copies the current weights in)
        fc1, fc2 = experts.local_experts[0].linear_fc1.weight, experts.local_experts[0].linear_fc2.weight
        w13 = fc1.new_empty((local, *fc1.shape))
        w2 = fc2.new_empty((local, *fc2.shape))
        source = experts
    shared = getattr(mlp, "shared_experts", None)
    weights = MoeWeights(
        router=router.weight, w13=w13, w2=w2, first_expert=groups.ep_rank * local, topk=cfg.moe_router_topk,
        pre_softmax=cfg.moe_router_pre_softmax,
        shared_fc1=shared.linear_fc1.weight if shared is not None else None,
        shared_fc2=shared.linear_fc2.weight if shared is not None else None,
        shared_gate=getattr(shared, "gate_weight", None) if shared is not None else None,
        experts=source)
    weights.refresh()
    return weights


def route(h: torch.Tensor, mw: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, h) -> (weights (T, k) fp32, ids (T, k) int32): megatron-core's fp32 softmax top-k router."""
    logits = F.linear(h.float(), mw.router.float())  # (T, E) fp32, as moe_router_dtype="fp32"
    if mw.pre_softmax:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, mw.topk, dim=1)
    else:
        scores, ids = torch.topk(logits, mw.topk, dim=1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return weights, ids.to(torch.int32)


def shared_expert(h: torch.Tensor, mw: MoeWeights) -> torch.Tensor:
    """(T, h) Qwen2-MoE's shared expert: fc2(SwiGLU(fc1(h))) * sigmoid(h gate^T)."""
    fc1, fc2 = mw.shared_lora.get("fc1"), mw.shared_lora.get("fc2")
    up = F.linear(h, mw.shared_fc1)
    act = silu_mul(up if fc1 is None else up + fc1(h))
    out = F.linear(act, mw.shared_fc2)
    out = out if fc2 is None else out + fc2(act)
    if mw.shared_gate is not None:
        out = out * torch.sigmoid(F.linear(h, mw.shared_gate))
    return out


@dataclass(frozen=True)
class MoeSums:
    """The all-reduces that complete an MoE layer's output at this layout (none where nothing is split)."""

    routed: tuple  # groups the routed experts' partials are summed over, in turn (expert-TP; EP inside TP)
    shared: Optional[dist.ProcessGroup]  # the TP group (tp > 1): the shared expert's partial

    def complete(self, routed: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
        """(T, h) partials -> (T, h) the layer's output: routed + shared, each summed over its groups."""
        if shared is not None and self.routed == (self.shared,):  # routed over exactly TP: one all-reduce
            out = routed + shared
            if self.shared is not None:
                dist.all_reduce(out, group=self.shared)
            return out
        for group in self.routed:
            dist.all_reduce(routed, group=group)
        if shared is None:
            return routed
        if self.shared is not None:
            dist.all_reduce(shared, group=self.shared)
        return routed + shared


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def ep_inside_tp(groups) -> bool:
    """Every rank of the EP group is a TP peer (TP2 x EP2 x ETP1 on 2 ranks): they hold the same rows, so
    no rows are exchanged and no lockstep is needed; the experts' shares are summed like a TP partial."""
    return groups.ep_size > 1 and set(_ranks(groups.ep)) <= set(_ranks(groups.tp))


def moe_sums(groups) -> MoeSums:
    """The :class:`MoeSums` of ``groups``; raises unless the expert-tensor group lies in the TP group."""
    tp = groups.tp if groups.tp_size > 1 else None
    routed = []
    if groups.etp_size > 1:
        etp_ranks, tp_ranks = _ranks(groups.etp), _ranks(groups.tp)
        if not set(etp_ranks) <= set(tp_ranks):
            raise ValueError(f"the rollout engine splits experts over expert-tensor ranks {etp_ranks}, which must "
                             f"lie in the TP group {tp_ranks}: parallel.etp={groups.etp_size} must divide "
                             f"parallel.tp={groups.tp_size}")
        routed.append(groups.etp)
    if ep_inside_tp(groups):
        routed.append(groups.ep)
    if len(routed) == 1 and _ranks(routed[0]) == _ranks(groups.tp):
        routed = [tp]  # the TP group itself (ETP = TP, or EP = TP at ETP 1)
    return MoeSums(tuple(routed), tp)


def rows_slot(groups) -> int:
    """The EP slot whose rows this rank's experts compute for its TP group: the first EP rank that is a TP
    peer of this one (itself, unless the EP group holds TP peers)."""
    tp_ranks = set(_ranks(groups.tp))
    return next(i for i, r in enumerate(_ranks(groups.ep)) if r in tp_ranks)


_HOST_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def host_group(group) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks for agreements on the host (``group`` itself where it is gloo).
    Built once per set of ranks, by those ranks only (``use_local_synchronization``)."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(_ranks(group))
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


@dataclass(frozen=True)
class StepShape:
    """What the EP group agreed for one step."""

    rows: int  # rows every rank's exchange carries: the largest rank's (0: no rank has a step to run)
    graph: bool  # every rank replays its decode graph of ``rows`` rows (else every rank runs eagerly)
    waiting: bool = False  # some rank has nothing to run but waits for follow-up requests (``serve``)


class EpStep:
    """The EP group's exchange of one step: the agreed row count, then per layer gather / reduce.
    ``slot``: the EP rank whose copy of this rank's rows is computed (`rows_slot`; ``rank`` if alone)."""

    def __init__(self, group, size: int, rank: int, num_experts: int, slot: Optional[int] = None,
                 host: Optional[dist.ProcessGroup] = None):
        self.group, self.size, self.rank, self.num_experts = group, size, rank, num_experts
        self.slot = rank if slot is None else slot
        self.host = host if host is not None else group  # where `agree` runs (gloo)
        self.rows = 0  # the group's largest row count this step

    @classmethod
    def of(cls, groups, num_experts: int) -> Optional["EpStep"]:
        """The lockstep of ``groups``' EP group (None at EP 1 or with EP inside TP: `ep_inside_tp`)."""
        if groups.ep_size == 1 or ep_inside_tp(groups):
            return None
        return cls(groups.ep, groups.ep_size, groups.ep_rank, num_experts, rows_slot(groups), host_group(groups.ep))

    def agree(self, rows: int, graph_ok: bool = False, waiting: bool = False) -> StepShape:
        """This rank's step in, the group's out, on the host. ``rows``: the rows of this rank's forward
        (a graph's bucket; 0: none); ``graph_ok``: it can take a graph step (a decode graph of ``rows``
        rows, or idle with decode graphs); ``waiting``: it has none but may get follow-ups. A graph step
        when every rank can; the group is done when no rank has rows or waits."""
        t = torch.tensor([rows, int(not graph_ok), int(waiting)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host)
        most, eager, anyone_waiting = t.tolist()
        self.rows = most
        return StepShape(most, most > 0 and not eager, bool(anyone_waiting))

    def start(self, rows: int) -> None:
        """A forward of ``rows`` <= the agreed rows begins."""
        if rows > self.rows:
            raise RuntimeError(f"an EP step of {rows} rows, but the group agreed on {self.rows}: "
                               "EpStep.agree must run before every step")

    def experts(self, h: torch.Tensor, weights, ids, mw: MoeWeights) -> torch.Tensor:
        """(T, h) own rows and routing -> (T, h) their routed-expert output, summed over the group."""
        t, n = h.shape[0], self.rows
        rows = h.contiguous() if t == n else torch.cat([h, h.new_zeros(n - t, h.shape[1])])  # (n, h)
        routing = torch.full((n, 2 * mw.topk), float(self.num_experts), dtype=torch.float32, device=h.device)
        if self.slot == self.rank:  # a TP peer's copy (slot elsewhere) goes to no expert: computed once
            routing[:t, :mw.topk], routing[:t, mw.topk:] = weights, ids.float()  # ids < 2^24: exact in fp32
        all_rows = h.new_empty(self.size * n, h.shape[1])
        all_routing = routing.new_empty(self.size * n, 2 * mw.topk)
        dist.all_gather_into_tensor(all_rows, rows, group=self.group)
        dist.all_gather_into_tensor(all_routing, routing, group=self.group)
        share = fused_moe_local(all_rows, mw.w13, mw.w2, all_routing[:, :mw.topk].contiguous(),
                                all_routing[:, mw.topk:].to(torch.int32), mw.first_expert)  # (size * n, h)
        dist.all_reduce(share, group=self.group)
        return share[self.slot * n:self.slot * n + t]  # (T, h): a partial over ETP when etp > 1


def moe_mlp(h: torch.Tensor, mw: MoeWeights, ep: Optional[EpStep], record: Optional[list] = None,
            sums: MoeSums = MoeSums((), None), real: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(T, h) -> (T, h): routed experts (+ the shared expert), partials summed by ``sums``. ``record``
    collects the (T, k) ids; rows not ``real`` (T,) bool (a graph's padding) go to no expert."""
    weights, ids = route(h, mw)
    if record is not None:
        record.append(ids)
    if real is not None:  # id E (router (E, h)): past every rank's experts, fused_moe_local skips it
        ids = torch.where(real[:, None], ids, mw.router.shape[0])
    if ep is None:
        routed = fused_moe_local(h, mw.w13, mw.w2, weights, ids, mw.first_expert)
    else:
        routed = ep.experts(h, weights, ids, mw)
    shared = shared_expert(h, mw) if mw.shared_fc1 is not None else None
    return sums.complete(routed, shared)


def idle_layer(mw: MoeWeights, ep: EpStep, hidden: int, dtype, device) -> None:
    """A rank with no rows of its own: its share of the group's exchange for one MoE layer (an eager
    step of ``ep.rows`` rows, agreed)."""
    empty = torch.zeros(0, hidden, dtype=dtype, device=device)
    ep.experts(empty, torch.zeros(0, mw.topk, device=device), torch.zeros(0, mw.topk, dtype=torch.int32,
                                                                           device=device), mw)
