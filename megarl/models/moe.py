"""Mixture-of-experts pieces of the builder: megatron-core's MoE fields, the experts' GEMMs, expert load.

Routing (:class:`~megarl.models.hf_config.MoeInfo`) maps onto megatron-core's top-k
router (``moe/router.py``, ``moe_utils.topk_routing_with_score_function``):
``renormalize`` (Mixtral; Qwen with norm_topk_prob) is ``moe_router_pre_softmax=False``,
a softmax over the k largest logits, which equals HF's softmax over all experts, top-k,
divided by their sum; otherwise ``moe_router_pre_softmax=True``, softmax over all
experts and the k largest probabilities as they are (Qwen2-MoE's default). Qwen2-MoE's
shared expert scaled by ``sigmoid(shared_expert_gate(x))`` is megatron-core's
``SharedExpertMLP`` with ``moe_shared_expert_gate=True`` (``gate_weight`` [1, hidden]).
The router computes its logits in fp32 (``moe_router_dtype``) whatever the parameter
dtype, so bf16 runs pick experts from fp32 scores.

Experts' GEMMs. Without transformer-engine, megatron-core offers ``SequentialMLP``
(one ``MLP`` per local expert, a Python loop) and the legacy ``GroupedMLP`` (all
local experts' weights in two tensors, one grouped GEMM each way) whose GEMM comes
from the ``grouped_gemm`` package, which has no wheel on PyPI (CUDA source build).
On CUDA in bf16 megarl therefore uses ``GroupedMLP`` with
:func:`grouped_gemm_torch` installed as its ``gmm``: ``torch._grouped_mm``, one
launch for all local experts, forward and backward (its CUDA kernel needs bf16 and
16-byte aligned rows, which every real expert shape has). Elsewhere "auto" picks
``SequentialMLP``; its loop over a handful of tiny experts is no cost on CPU.
:func:`grouped_gemm_ref` is the loop the grouped GEMM must equal. megarl runs
``GroupedMLP`` through its own forward (:func:`grouped_experts_forward`: megatron-core's,
without its bf16-only assert, so the CPU tests run it in fp32 too, and with the experts'
LoRA adapters of megarl/models/lora_grouped.py, two more grouped GEMMs per linear).
"""
from __future__ import annotations

import types

import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from torch import nn

from megarl.models.hf_config import ModelInfo

# megatron-core 0.16.1's router gating (moe_utils.RouterGatingLinearFunction) tests
# ``te_general_gemm is not None``, a name bound only when transformer-engine imports:
# without TE every MoE forward raised NameError. None selects its plain torch.mm branch.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def _splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for CPU tensors too: the alltoall dispatcher's
    split sizes become numpy arrays (its CUDA path); left as CPU tensors, ``all_to_all_single``
    rejects them as split sizes."""
    if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
        return tensor.numpy()
    return moe_utils.maybe_move_tensor_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)


if not torch.cuda.is_available():  # the CPU runs (tests, tiny tasks) over gloo
    token_dispatcher.maybe_move_tensor_to_cpu = _splits_to_host


def transformer_config_fields(info: ModelInfo, groups, opts) -> dict:
    """megatron-core ``TransformerConfig`` keyword arguments of ``info.moe`` over ``groups``."""
    m = info.moe
    if m.num_experts % groups.ep_size:
        raise ValueError(f"parallel.ep={groups.ep_size} must divide the expert count {m.num_experts} "
                         f"of {info.arch}; use an ep that divides {m.num_experts}")
    # routed experts split over expert-TP, the shared expert (a plain MLP) over TP
    for what, width, axis, size in (("expert FFN width", m.ffn_hidden_size, "etp", groups.etp_size),
                                    ("shared expert FFN width", m.shared_ffn_hidden_size or 0, "tp", groups.tp_size)):
        if width % size:
            raise ValueError(f"the {what} {width} of {info.arch} does not split over parallel.{axis}={size}; "
                             f"use a parallel.{axis} that divides it")
    aux = opts.moe_aux_loss_coef
    return dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.topk, moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_router_score_function="softmax", moe_router_pre_softmax=not m.renormalize,
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=m.shared_ffn_hidden_size,
        moe_shared_expert_gate=m.shared_ffn_hidden_size is not None,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux, moe_z_loss_coeff=opts.moe_z_loss_coef or None,
        moe_grouped_gemm=use_grouped_gemm(opts),
        expert_model_parallel_size=groups.ep_size, expert_tensor_parallel_size=groups.etp_size,
    )


def experts_in_own_optimizer(model: nn.Module) -> None:
    """Marks the routed experts' weights expert-parallel (megatron-core's ``allreduce = False``) at every
    EP, ep = 1 included (megatron-core marks them only at ep > 1): DDP reduces them over the
    expert-data-parallel group (the whole data-parallel group at ep = 1: the same sums) and the
    optimizer is the same chain (dense params, experts) at every layout, so a checkpoint saved at
    one EP size loads at another (megarl/trainer/checkpoint.py)."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def use_grouped_gemm(opts) -> bool:
    """GroupedMLP (one grouped GEMM for all local experts) for ``opts.moe_experts`` "grouped", and
    for "auto" on CUDA in bf16; SequentialMLP otherwise. (On CPU "grouped" runs too, in fp32 or
    bf16: ``torch._grouped_mm`` has a CPU kernel; the tests use it to check the grouped layout.)

    Installs :func:`grouped_gemm_torch` as megatron-core's ``grouped_gemm`` backend when it
    is chosen and the ``grouped_gemm`` package is absent.
    """
    auto = torch.cuda.is_available() and opts.params_dtype == "bf16" and hasattr(torch, "_grouped_mm")
    if not (opts.moe_experts == "grouped" or (opts.moe_experts == "auto" and auto)):
        return False
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm is None:
        gg.grouped_gemm = _TorchGroupedGemm
        gg.ops = _TorchGroupedGemm.ops
    return True


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, batch_sizes: torch.Tensor,
                     trans_b: bool = False) -> torch.Tensor:
    """The spec: rows of ``x`` [T, K] in expert order times each expert's ``w[e]`` [K, N]
    (``trans_b``: [N, K]); ``batch_sizes`` [E] rows per expert, sum T. -> [T, N]."""
    outs, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        we = w[e].t() if trans_b else w[e]
        outs.append(x[start:start + n] @ we)
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1 if trans_b else 2])


def grouped_gemm_torch(x: torch.Tensor, w: torch.Tensor, batch_sizes: torch.Tensor,
                       trans_b: bool = False) -> torch.Tensor:
    """:func:`grouped_gemm_ref` in one ``torch._grouped_mm`` launch (offsets: cumulative rows)."""
    offs = torch.cumsum(batch_sizes.to(device=x.device, dtype=torch.int32), 0, dtype=torch.int32)
    return torch._grouped_mm(x, w.transpose(1, 2) if trans_b else w, offs=offs)


def own_grouped_forward(model: nn.Module) -> None:
    """Every ``GroupedMLP`` of ``model`` (but one with megatron's moe_act recompute, which megarl does
    not configure) runs :func:`grouped_experts_forward`."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    for module in model.modules():
        if isinstance(module, GroupedMLP) and not module.activation_recompute:
            module.forward = types.MethodType(grouped_experts_forward, module)


def grouped_experts_forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
    """megatron-core's ``GroupedMLP.forward`` in any dtype ``gmm`` takes, plus the experts' LoRA.

    x (T, h) rows sorted by local expert, ``tokens_per_expert`` (E_local,) their counts, probs (T,)
    -> ((T, h), None): per expert fc2(act(fc1(x)) * probs) with ``s (x A^T) B^T`` added to fc1 and
    fc2 where adapters are on (megarl/models/lora_grouped.py).
    """
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from megarl.models.lora_grouped import grouped_adapters

    if self.config.moe_apply_probs_on_input:  # as megatron-core: top-1 only, probs folded into x
        assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = torch.ones_like(probs)
    adapters = {k: a for k, a in grouped_adapters(self).items() if a.lora_enabled}
    h, local = self.config.hidden_size, self.num_local_experts
    if x.nelement() == 0:  # no row for these experts: every weight still gets a (zero) gradient
        act = self.activation_func_with_probs(x @ self.weight1.view(h, -1), probs.unsqueeze(-1))
        out = act @ self.weight2.view(-1, h)
        zero = sum((a.lora_a.sum() + a.lora_b.sum()) * 0 for a in adapters.values())
        return out + zero, None
    fc1 = gg.ops.gmm(x, self.weight1.view(local, h, -1), tokens_per_expert, trans_b=False)  # (T, 2F/etp)
    if "fc1" in adapters:
        fc1 = fc1 + adapters["fc1"](x, tokens_per_expert, gg.ops.gmm)
    act = self.activation_func_with_probs(fc1, probs.unsqueeze(-1))  # (T, F/etp)
    out = gg.ops.gmm(act, self.weight2.view(local, -1, h), tokens_per_expert, trans_b=False)  # (T, h)
    if "fc2" in adapters:
        out = out + adapters["fc2"](act, tokens_per_expert, gg.ops.gmm)
    return out, None


class _TorchGroupedGemm:
    """Stands in for the ``grouped_gemm`` package: ``ops.gmm(a, b, batch_sizes, trans_b)``."""

    class ops:  # noqa: N801 - the package's attribute name
        gmm = staticmethod(grouped_gemm_torch)


class ExpertLoad:
    """Tokens routed to each expert, per MoE layer, summed over the training forwards since the last read.

    A forward hook on every router (``routing_map`` [tokens, experts], True = routed) adds
    ``routing_map.sum(0)`` while the model is in training mode (the update's forwards, not
    the forward-only log-prob passes). :meth:`read` (collective over the world) sums the
    counts over dp x cp (and TP under sequence parallelism, whose ranks route their own slices), collects every pipeline stage's layers, clears them and returns per
    layer ``max / mean`` tokens per expert: 1.0 is a perfectly balanced layer, ``num_experts /
    topk`` one where every token went to the same k experts.
    """

    def __init__(self, model: nn.Module, groups):
        self.groups = groups
        self.counts: dict[int, torch.Tensor] = {}  # global layer index -> [experts] int64, on the device
        self._hooks = []
        self.sequence_split = False  # sequence parallelism: each TP rank routes its slice of the tokens
        for module in model.modules():
            router = getattr(module, "router", None)
            if router is not None and hasattr(module, "token_dispatcher"):
                self._hooks.append(router.register_forward_hook(self._hook(router)))
                self.sequence_split = groups.tp_size > 1 and router.config.sequence_parallel

    def _hook(self, router):
        def record(_module, _inputs, output):
            if not router.training:
                return
            routing_map = output[1]  # [tokens, experts] bool
            layer = router.layer_number - 1  # 1-based, global
            counts = routing_map.detach().sum(0, dtype=torch.int64)  # stays on the device: no sync here
            self.counts[layer] = self.counts.get(layer, 0) + counts
        return record

    def read(self) -> dict[str, float]:
        """``{"moe/load_max_over_mean/layer_N": .., "moe/load_max_over_mean": max over layers}``."""
        import torch.distributed as dist

        layers = sorted(self.counts)
        local = {}
        if layers:
            stacked = torch.stack([self.counts[i] for i in layers])  # (layers of this stage, experts)
            dist.all_reduce(stacked, group=self.groups.dp_cp)
            if self.sequence_split:
                dist.all_reduce(stacked, group=self.groups.tp)
            local = dict(zip(layers, stacked.cpu()))
        stages = [None] * self.groups.pp_size
        dist.all_gather_object(stages, local, group=self.groups.pp)
        self.counts.clear()
        out = {}
        for layer, counts in sorted((k, v) for stage in stages for k, v in stage.items()):
            mean = counts.double().mean().item()
            out[f"moe/load_max_over_mean/layer_{layer}"] = counts.max().item() / mean if mean else 0.0
        if out:
            out["moe/load_max_over_mean"] = max(out.values())
        return out

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
