"""LoRA on megatron-core's ``GroupedMLP`` experts: one A / B pair per expert, stacked, in grouped GEMMs.

    experts.lora_fc1.lora_a  (E_local, r, h)          replicated over expert-TP
    experts.lora_fc1.lora_b  (E_local, 2F/etp, r)     split like weight1's columns (gate | up halves)
    experts.lora_fc2.lora_a  (E_local, r, F/etp)      split like weight2's rows
    experts.lora_fc2.lora_b  (E_local, h, r)          replicated over expert-TP

Expert e's slices are exactly the ``lora_a`` / ``lora_b`` a ``SequentialMLP`` expert's
``linear_fc1`` / ``linear_fc2`` carries (megarl/models/lora.py), drawn from the same
(layer, global expert, fc1 | fc2) streams, so both modules start from the same adapters at
every EP size. The forward (megarl/models/moe.py ``grouped_experts_forward``) adds
``s * (x A_e^T) B_e^T`` to each expert's rows with two grouped GEMMs per linear over the
expert-sorted rows the base GEMM uses; :func:`grouped_lora_ref` is the per-expert loop they
equal. ``torch._grouped_mm`` wants 16-byte strides, so a rank whose row of ``r`` elements is not
a multiple of 16 bytes is padded with zero rows of A / columns of B inside the forward: the
padded columns of ``x A^T`` are exact zeros and add nothing (the parameters keep rank r).

Expert-TP (etp > 1): GroupedMLP's outputs are partial sums that the token dispatcher adds over
expert-TP. fc1: ``x A^T`` is the full product on every etp rank (x is replicated there), and
the rank's columns ``s (x A^T) B_local^T`` are exact; fc2: ``(act_local A_local^T) B^T`` is this
rank's partial, summed by the dispatcher like the base product. The replicated factor (fc1's A,
fc2's B) enters through ``copy_to_tensor_model_parallel_region``, so its gradient (a per-rank
partial) is summed over expert-TP.

Checkpoints: the stacked factors are written under SequentialMLP's keys and global shapes
(``...mlp.experts.experts.linear_fc1.lora_a`` (E, r, h) and so on, gated ``lora_b`` as
[gate | up] halves as megatron's SwiGLU factory writes them), so a checkpoint moves between
GroupedMLP and SequentialMLP and between EP / expert-TP sizes.
"""
from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from torch import nn

STRIDE_BYTES = 16  # torch._grouped_mm: every operand's leading stride a multiple of 16 bytes
LINEARS = ("linear_fc1", "linear_fc2")


class GroupedAdapter(nn.Module):
    """The adapters of one of GroupedMLP's two GEMMs, all local experts stacked."""

    def __init__(self, target: str, a: torch.Tensor, b: torch.Tensor, scale: float, tp_group, allreduce: bool):
        super().__init__()
        self.lora_target = target  # "linear_fc1" | "linear_fc2"
        self.column = target == "linear_fc1"  # fc1 splits its output over expert-TP, fc2 its input
        self.lora_a = nn.Parameter(a)  # (E, r, in_local)
        self.lora_b = nn.Parameter(b)  # (E, out_local, r)
        self.lora_scale, self.lora_enabled, self.tp_group = scale, True, tp_group
        sharded, dim = (self.lora_b, 1) if self.column else (self.lora_a, 2)
        sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = True, dim, 1
        for p in (self.lora_a, self.lora_b):  # reduced over expert-DP, as the expert weights
            p.allreduce = allreduce

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (E, r', in), B (E, out, r')) as the grouped GEMMs take them: the replicated factor
        through expert-TP's copy region, r' the rank padded to 16-byte rows (zeros)."""
        a, b = self.lora_a, self.lora_b
        if self.tp_group.size() > 1:
            if self.column:
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        pad = padded_rank(a.shape[1], a.element_size()) - a.shape[1]
        if pad:
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        return a, b

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, gmm) -> torch.Tensor:
        """(T, in) expert-sorted rows -> (T, out) their ``s (x A_e^T) B_e^T``."""
        a, b = self.factors()
        return grouped_lora(x, a, b, tokens_per_expert, self.lora_scale, gmm)

    def delta(self) -> torch.Tensor:
        """(E, out_local, in_local) fp32: s B_e A_e, in SequentialMLP's orientation."""
        return self.lora_scale * torch.bmm(self.lora_b.float(), self.lora_a.float())


def padded_rank(rank: int, element_size: int) -> int:
    """The smallest r' >= rank whose row of r' elements is a multiple of 16 bytes."""
    step = STRIDE_BYTES // math.gcd(STRIDE_BYTES, element_size)
    return -(-rank // step) * step


def grouped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens_per_expert: torch.Tensor,
                 scale: float, gmm) -> torch.Tensor:
    """:func:`grouped_lora_ref` in two grouped GEMMs; ``gmm`` is megatron's ``gg.ops.gmm``."""
    h = gmm(x, a, tokens_per_expert, trans_b=True)  # (T, r)
    return scale * gmm(h, b, tokens_per_expert, trans_b=True)  # (T, out)


def grouped_lora_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens_per_expert: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The spec: expert e's rows of ``x`` (T, in) times A_e^T (r, in) then B_e^T (out, r), scaled."""
    rows = torch.split(x, tokens_per_expert.tolist())
    outs = [scale * F.linear(F.linear(xe, a[e]), b[e]) for e, xe in enumerate(rows)]
    return torch.cat(outs) if outs else x.new_zeros(0, b.shape[1])


def attach_grouped(name: str, experts, layer_number: int, opts, full_a, first_stream: int) -> list:
    """Adds ``experts.lora_fc1`` / ``lora_fc2`` (the targeted ones) to a GroupedMLP; returns
    ``(name, adapter)`` pairs. ``full_a(rank, fan_in, seed, stream)`` draws a whole A (fp32)."""
    if getattr(experts, "activation_recompute", False):
        raise ValueError(f"LoRA on the grouped experts of {name}: moe_act recompute is not supported; leave "
                         "recompute_modules without moe_act")
    cfg, tp = experts.config, experts.tp_group
    local, h = experts.num_local_experts, cfg.hidden_size
    total, first = experts.ep_group.size() * local, experts.ep_group.rank() * local
    fc1_out, fc2_in = experts.weight1.shape[1] // local, experts.weight2.shape[0] // local
    like = dict(dtype=experts.weight1.dtype, device=experts.weight1.device)
    out = []
    for j, target in enumerate(LINEARS):
        if target not in opts.targets:
            continue
        a = []
        for e in range(local):
            stream = first_stream + ((layer_number * total) + first + e) * 2 + j
            full = full_a(opts.rank, h if j == 0 else fc2_in * tp.size(), opts.seed, stream)
            a.append(full if j == 0 else full.chunk(tp.size(), dim=1)[tp.rank()])
        b = torch.zeros(local, fc1_out if j == 0 else h, opts.rank)
        adapter = GroupedAdapter(target, torch.stack(a).to(**like), b.to(**like), opts.alpha / opts.rank, tp,
                                 getattr(experts.weight1, "allreduce", True))
        setattr(experts, f"lora_{target[len('linear_'):]}", adapter)
        out.append((f"{name}.lora_{target[len('linear_'):]}", adapter))
    experts.sharded_state_dict = types.MethodType(_sharded_with_lora(type(experts).sharded_state_dict), experts)
    return out


def grouped_adapters(experts) -> dict:
    """{"fc1" | "fc2": GroupedAdapter} of a GroupedMLP (empty without adapters)."""
    return {k: getattr(experts, f"lora_{k}") for k in ("fc1", "fc2") if hasattr(experts, f"lora_{k}")}


def weight_deltas(experts, enabled_only: bool = True) -> dict[str, torch.Tensor]:
    """{"weight1" | "weight2": fp32 s B A laid out like that GroupedMLP weight} of its adapters
    (``enabled_only``: those not switched off by ``adapters_off``)."""
    out = {}
    for kind, adapter in grouped_adapters(experts).items():
        if enabled_only and not adapter.lora_enabled:
            continue
        name = "weight1" if kind == "fc1" else "weight2"
        d = adapter.delta().transpose(1, 2).contiguous()  # (E, in, out): w[e] of the grouped GEMM
        out[name] = d.view(getattr(experts, name).shape)  # weight1 (h, E*2F/etp) / weight2 (E*F/etp, h) bytes
    return out


def _sharded_with_lora(base_fn):
    """GroupedMLP's sharded state dict with the stacked adapters under SequentialMLP's keys."""
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if (metadata or {}).get("singleton_local_shards", False):
            raise ValueError("LoRA on grouped experts: singleton_local_shards checkpoints are not supported")
        out = {k: v for k, v in base_fn(self, prefix, sharded_offsets, metadata).items() if ".lora_" not in k}
        for kind, adapter in grouped_adapters(self).items():
            for factor in ("lora_a", "lora_b"):
                key = f"{prefix}experts.linear_{kind}.{factor}"
                out[f"{prefix}lora_{kind}.{factor}"] = _sharded_factor(self, adapter, factor, key, sharded_offsets)
        return out
    return sharded_state_dict


def _sharded_factor(experts, adapter: GroupedAdapter, factor: str, key: str, sharded_offsets):
    """One stacked factor (E_local, d1, d2) as the global (E, D1, D2) tensor SequentialMLP writes."""
    tensor = getattr(adapter, factor)
    n = len(sharded_offsets)  # the expert axis comes after the prepended axes
    ep, tp = experts.ep_group, experts.tp_group
    split_dim = {("lora_b", True): 1, ("lora_a", False): 2}.get((factor, adapter.column))
    replica_id = (0, 0 if split_dim else tp.rank(), experts.dp_group.rank())
    expert_axis = (n, ep.rank(), ep.size())
    gated = split_dim == 1 and experts.config.gated_linear_unit
    if not gated:
        tp_axis = ((n + split_dim, tp.rank(), tp.size()),) if split_dim else ()
        return ShardedTensor.from_rank_offsets(key, tensor, *sharded_offsets, expert_axis, *tp_axis,
                                               replica_id=replica_id, prepend_axis_num=n)
    build = functools.partial(_build_gated, sharded_offsets=sharded_offsets, expert_axis=expert_axis,
                              tp_rank=tp.rank(), tp_size=tp.size())
    return ShardedTensorFactory(key, tensor, build, _merge_gated, replica_id)


@torch.no_grad()
def _build_gated(key, t, replica_id, flattened_range, *, sharded_offsets, expert_axis, tp_rank, tp_size):
    """fc1's B (E_local, 2F/etp, r) = [gate | up] rows of this rank: two pieces of the global
    [all gate | all up] (E, 2F, r), as megatron's ``apply_swiglu_sharded_factory`` splits a dense fc1."""
    n = len(sharded_offsets)
    gate, up = torch.chunk(t, 2, dim=1)
    return [ShardedTensor.from_rank_offsets(key, piece.contiguous(), *sharded_offsets, expert_axis,
                                            (n + 1, chunk, 2 * tp_size), replica_id=replica_id, prepend_axis_num=n)
            for piece, chunk in ((gate, tp_rank), (up, tp_size + tp_rank))]


@torch.no_grad()
def _merge_gated(pieces):
    return torch.cat(pieces, dim=1)
