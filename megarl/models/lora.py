"""LoRA adapters on megatron-core's tensor-parallel linears, in place.

    adapters = apply_lora(module, LoraOptions(rank=16, alpha=32, targets=("linear_qkv", "linear_proj")))
    # module's base weights are frozen; each targeted linear L computes
    #   L(x) + (alpha / rank) * x A^T B^T        A (r, in), B (out, r); B starts at 0

The adapters are parameters of the linears themselves (``linear_qkv.lora_a``,
``linear_qkv.lora_b``), added by a forward hook, so every name the loader,
exporter, rollout engine and checkpoints know stays where it was.

Tensor parallelism follows the base layer's split:
- column-parallel (QKV, fc1): W is split over output rows. A is replicated,
  B split like W: out_local += s * (x A^T) B_local^T. The gradient of x A^T is
  summed over TP (``copy_to_tensor_model_parallel_region``), so A's gradient is
  the same on every rank.
- row-parallel (proj, fc2): W is split over input columns and its output is
  all-reduced. A is split like W, B replicated: the rank-r partial products
  x_local A_local^T are all-reduced (``reduce_from_...``), then out += s * h B^T.
The full A is drawn from a seeded generator on the CPU and each rank keeps its
slice, so the adapters (and the whole run) do not depend on the TP layout.
Checkpoints shard B (column) / A (row) over TP like the base weight.

Mixtures of experts. Attention, dense MLPs and a shared expert are adapted as above. With
``experts`` the routed experts' fc1 / fc2 get adapters too, one A / B pair per expert: on
megatron-core's ``SequentialMLP`` (one ``MLP`` per local expert) the hook works unchanged; on
``GroupedMLP`` (all local experts in two weight tensors) the pairs are stacked and run as
grouped GEMMs (megarl/models/lora_grouped.py), expert e's slices equal to what SequentialMLP's
expert e would carry. Under expert parallelism each rank holds its own experts' adapters: each
expert's A comes from a stream of its (layer, global expert, fc1 | fc2), not of the rank's
enumeration, so EP1 and EP2 draw the same adapters; the adapters inherit the expert weights'
``allreduce = False``, so megatron-core's DDP and optimizer reduce them over the
expert-data-parallel group, and both modules' checkpoints map them to global experts under
the same keys.

Not supported (config errors): sequence parallelism, the TE layer spec (its
fused LayerNorm-linear hides the normed input from the hook).
"""
from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megarl.config import LORA_TARGETS as TARGETS
from megarl.models.lora_grouped import GroupedAdapter, attach_grouped, weight_deltas

COLUMN = {"linear_qkv", "linear_fc1"}


@dataclass(frozen=True)
class LoraOptions:
    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    seed: int = 0
    experts: bool = False  # also the routed experts' fc1 / fc2 (SequentialMLP or GroupedMLP)


@dataclass
class Adapter:
    """One adapted linear: its parameters and how it is split over TP."""

    name: str  # "decoder.layers.0.self_attention.linear_qkv"
    column: bool
    lora_a: torch.nn.Parameter  # column: (r, in); row: (r, in / tp)
    lora_b: torch.nn.Parameter  # column: (out / tp, r); row: (out, r)
    scale: float
    tp_group: object

    def delta(self) -> torch.Tensor:
        """This rank's share of s * B A, shaped like the base weight shard, fp32."""
        return self.scale * (self.lora_b.float() @ self.lora_a.float())


EXPERT_STREAMS = 1 << 30  # routed experts' A streams start here (dense linears count from 0)


def _targets(module, targets) -> list[tuple[str, torch.nn.Module]]:
    """The targeted linears outside routed experts, in module order."""
    return [(name, m) for name, m in module.named_modules()
            if name.rsplit(".", 1)[-1] in targets and ".experts." not in name]


def _moe_layers(module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in module.named_modules()
            if getattr(m, "router", None) is not None and getattr(m, "experts", None) is not None]


def _grouped_experts(module, opts: "LoraOptions") -> list["Adapter"]:
    """The stacked adapters of every GroupedMLP (megarl/models/lora_grouped.py), same streams as below."""
    out = []
    for name, moe in _moe_layers(module):
        experts = moe.experts
        if not hasattr(experts, "weight1"):
            continue
        _check(experts, f"{name}.experts")
        for full, ad in attach_grouped(f"{name}.experts", experts, moe.router.layer_number, opts, _full_a,
                                       EXPERT_STREAMS):
            out.append(Adapter(full, ad.column, ad.lora_a, ad.lora_b, ad.lora_scale, ad.tp_group))
    return out


def _expert_targets(module, targets) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, linear, A stream) of every SequentialMLP expert's targeted fc1 / fc2; the stream is a
    function of (global layer, global expert, linear), the same at every EP layout."""
    out = []
    for name, moe in _moe_layers(module):
        experts = moe.experts
        if hasattr(experts, "weight1"):  # GroupedMLP: _grouped_experts
            continue
        if not hasattr(experts, "local_experts"):
            raise ValueError(f"LoRA on the routed experts of {name}: {type(experts).__name__} has no per-expert "
                             "linear to adapt; build the model with moe_experts='sequential' or 'grouped'")
        total = experts.ep_group.size() * experts.num_local_experts
        first = experts.ep_group.rank() * experts.num_local_experts
        for i, expert in enumerate(experts.local_experts):
            for j, kind in enumerate(("linear_fc1", "linear_fc2")):
                if kind in targets:
                    stream = EXPERT_STREAMS + ((moe.router.layer_number * total) + first + i) * 2 + j
                    out.append((f"{name}.experts.local_experts.{i}.{kind}", getattr(expert, kind), stream))
    return out


def _full_a(rank: int, fan_in: int, seed: int, index: int) -> torch.Tensor:
    """(r, fan_in) fp32: kaiming-uniform(a=sqrt(5)) as torch.nn.Linear, one stream per linear."""
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g) * 2 - 1) * bound


def _check(linear, name: str) -> None:
    if getattr(linear.config, "sequence_parallel", False):
        raise ValueError(f"LoRA on {name}: sequence parallelism is not supported; set parallel.sequence_parallel=false")
    if hasattr(linear, "layer_norm_weight"):
        raise ValueError(f"LoRA on {name}: the TE spec fuses the norm into the linear; set model.layer_spec=local")


def apply_lora(module: torch.nn.Module, opts: LoraOptions) -> list[Adapter]:
    """Freezes every parameter of ``module`` and adds trainable adapters to the targeted linears."""
    if opts.rank < 1 or opts.alpha <= 0:
        raise ValueError(f"LoRA rank={opts.rank} must be >= 1 and alpha={opts.alpha} > 0")
    module.requires_grad_(False)
    targets = [(name, linear, index) for index, (name, linear) in enumerate(_targets(module, opts.targets))]
    if opts.experts:
        targets += _expert_targets(module, opts.targets)
    adapters = []
    for name, linear, index in targets:
        _check(linear, name)
        adapters.append(_attach(name, linear, index, opts))
    if opts.experts:
        adapters += _grouped_experts(module, opts)
    if not adapters:
        raise ValueError(f"LoRA targets {list(opts.targets)} match no linear of the model; use some of {list(TARGETS)}")
    return adapters


def _attach(name: str, linear, index: int, opts: LoraOptions) -> Adapter:
    column = name.rsplit(".", 1)[-1] in COLUMN
    group = linear.tp_group
    tp, tp_rank = group.size(), group.rank()
    out_local, in_local = linear.weight.shape
    fan_in = in_local if column else in_local * tp
    a = _full_a(opts.rank, fan_in, opts.seed, index)
    if not column:
        a = a.chunk(tp, dim=1)[tp_rank]
    b = torch.zeros(out_local, opts.rank)
    like = dict(dtype=linear.weight.dtype, device=linear.weight.device)
    linear.lora_a = torch.nn.Parameter(a.to(**like).contiguous())
    linear.lora_b = torch.nn.Parameter(b.to(**like))
    sharded = linear.lora_b if column else linear.lora_a
    sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = True, 0 if column else 1, 1
    for p in (linear.lora_a, linear.lora_b):  # an expert's: reduced over expert-DP, as its weight
        p.allreduce = getattr(linear.weight, "allreduce", True)
    adapter = Adapter(name, column, linear.lora_a, linear.lora_b, opts.alpha / opts.rank, group)
    linear.lora_scale, linear.lora_enabled = adapter.scale, True
    if getattr(linear, "explicit_expert_comm", False):  # a routed expert's: the dispatcher sums over expert-TP
        linear.register_forward_hook(functools.partial(_expert_lora_hook, column))
    else:
        region = copy_to_tensor_model_parallel_region if column else reduce_from_tensor_model_parallel_region
        linear.register_forward_hook(functools.partial(_lora_hook, region))
    gated = name.endswith("linear_fc1") and linear.config.gated_linear_unit
    linear.sharded_state_dict = types.MethodType(_sharded_with_lora(type(linear).sharded_state_dict, column, gated),
                                                 linear)
    return adapter


def _lora_hook(region, linear, inputs, output):
    """out + s (x A^T) B^T; ``region`` is the TP communication of x A^T (see the module docstring)."""
    if not linear.lora_enabled:
        return output
    out, bias = output
    h = region(F.linear(inputs[0], linear.lora_a), group=linear.tp_group)
    return out + linear.lora_scale * F.linear(h, linear.lora_b), bias


def _expert_lora_hook(column: bool, linear, inputs, output):
    """A routed expert's linear under expert-TP: its input is replicated (fc1) or split (fc2) over
    expert-TP and its output is a partial sum the token dispatcher adds up, so no activation is
    communicated: fc1 adds its columns s (x A^T) B_local^T, fc2 its partial s (x_local A_local^T) B^T.
    The replicated factor (fc1's A, fc2's B) gets its per-rank partial gradients summed over
    expert-TP (``copy_to_tensor_model_parallel_region``), as megarl/models/lora_grouped.py does."""
    if not linear.lora_enabled:
        return output
    out, bias = output
    a, b = linear.lora_a, linear.lora_b
    if column:
        a = copy_to_tensor_model_parallel_region(a, group=linear.tp_group)
    else:
        b = copy_to_tensor_model_parallel_region(b, group=linear.tp_group)
    return out + linear.lora_scale * F.linear(F.linear(inputs[0], a), b), bias


def _sharded_with_lora(base_fn, column: bool, gated: bool):
    """The base layer's sharded state dict, with lora_b (column) / lora_a (row) split over TP
    like the weight: gated fc1's B as [gate | up] halves (megatron's SwiGLU factory), so a
    checkpoint reshards to another TP size."""
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = base_fn(self, prefix, sharded_offsets, metadata)
        lora = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        sharded = make_sharded_tensors_for_checkpoint(
            lora, prefix, {"lora_b": 0} if column else {"lora_a": 1}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if gated:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        out.update(sharded)
        return out
    return sharded_state_dict


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module):
    """Inside: ``module`` is its frozen base model (the reference policy of a LoRA actor)."""
    linears = [m for m in module.modules() if hasattr(m, "lora_enabled")]
    before = [m.lora_enabled for m in linears]
    for m in linears:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, enabled in zip(linears, before):
            m.lora_enabled = enabled


class merged_lora:
    """Context: the base weights hold W + s B A (rounded to their dtype), restored bitwise on exit.

    For exports (HF checkpoints carry plain weights); the originals wait on the CPU. ``linears``:
    the adapted linears; ``grouped``: the GroupedMLPs whose stacked experts carry adapters.
    """

    def __init__(self, module: torch.nn.Module):
        adapted = [m for m in module.modules() if hasattr(m, "lora_enabled")]
        self.linears = [m for m in adapted if not isinstance(m, GroupedAdapter)]
        self.switches = adapted  # every module whose lora_enabled is turned off inside
        self.grouped = [m for m in module.modules() if any(isinstance(c, GroupedAdapter) for c in m.children())]
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.enabled: list[bool] = []

    def _deltas(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(base weight, fp32 s B A laid out like it) of every adapter."""
        out = [(m.weight, m.lora_scale * (m.lora_b.float() @ m.lora_a.float())) for m in self.linears]
        for experts in self.grouped:
            out += [(getattr(experts, k), d) for k, d in weight_deltas(experts, enabled_only=False).items()]
        return out

    def __enter__(self):
        with torch.no_grad():
            for weight, delta in self._deltas():
                self.saved.append((weight, weight.detach().to("cpu", copy=True)))
                weight.copy_((weight.float() + delta).to(weight.dtype))
            self.enabled = [m.lora_enabled for m in self.switches]
            for m in self.switches:
                m.lora_enabled = False
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for weight, original in self.saved:
                weight.copy_(original.to(weight.device))
            for m, enabled in zip(self.switches, self.enabled):
                m.lora_enabled = enabled
        self.saved.clear()
        return False
