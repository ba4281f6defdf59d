"""What apex gives megatron-core's training step, in plain torch.

Without apex (or transformer-engine) megatron-core falls back to per-tensor
Python loops, and the actor update on a GPU is launch-bound: the host takes
about as long per kernel as the GPU (docs/performance.md). Three of those fallbacks are replaced here:

- **weight gradients into ``main_grad``** (``gradient_accumulation_fusion``):
  without apex's ``fused_weight_gradient_mlp_cuda`` each parallel linear makes
  a bf16 weight gradient per micro-batch and DDP's hook adds it to the fp32
  ``main_grad`` (one GEMM + one add kernel, and a rounding to bf16). The fused
  path is one GEMM that accumulates into ``main_grad`` (cuBLAS, bf16 inputs,
  fp32 output: ``torch.addmm(..., out_dtype=torch.float32)``).
- **gradient norm** (``multi_tensor_l2norm``): the fallback reads every
  per-tensor norm back to the host (one sync per parameter);
  ``torch._foreach_norm`` keeps it on the device.
- **scale / copy** (``multi_tensor_scale``): the fallback runs two kernels per
  tensor; ``torch._foreach_mul_`` / ``_foreach_copy_`` batch them.

:func:`install` swaps them into megatron-core's modules once, only where the
fallback is in use (with apex or TE installed, theirs stay). :func:`fuse_wgrad`
turns the fused path on for a DDP-wrapped model's parallel linears; megatron's
own layer code then calls :func:`wgrad_gemm_accum_fp32`.
"""
from __future__ import annotations

import types

import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads, optimizer
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] fp32 += grad_output[t, out]^T @ total_input [t, in] (half or fp32 inputs)."""
    if main_grad.is_cuda and total_input.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # the reference: what the unfused path does (a weight gradient, then DDP's add)
        main_grad.add_(grad_output.t().mm(total_input))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] (fp16/bf16) += grad_output^T @ total_input, all in one dtype."""
    main_grad.addmm_(grad_output.t(), total_input)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm without per-tensor host syncs: ([1] fp32 norm of all tensors, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale: dst[i] = src[i] * scale for the two lists."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, torch._foreach_mul(src, scale) if scale != 1.0 else src)


_WGRAD = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                               wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)


def install() -> None:
    """Puts the functions above where megatron-core uses its no-apex fallbacks (idempotent)."""
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _WGRAD
        layers._grad_accum_fusion_available = True
    if clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale


def fuse_wgrad(model: torch.nn.Module) -> int:
    """Weight gradients of ``model``'s trainable parallel linears go straight into ``main_grad``.

    ``model`` must be wrapped by megatron's DDP (which gives every trainable
    parameter its ``main_grad`` and skips the add for ``grad_added_to_main_grad``).
    Frozen linears (LoRA bases) keep megatron's frozen-weight path. Returns the
    number of linears switched.
    """
    install()
    switched = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and _trainable(module):
            module.gradient_accumulation_fusion = True
            switched += 1
    return switched


def _trainable(linear) -> bool:
    weight = linear.weight
    if weight is None:  # a tied output layer: the embedding's weight comes in at forward
        return True
    return weight.requires_grad and hasattr(weight, "main_grad")
