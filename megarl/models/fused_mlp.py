"""The local spec's MLP with its SwiGLU fused (forward and backward) on CUDA.

megatron-core's ``MLP`` without transformer-engine computes
``silu(chunk(fc1(x))[0]) * chunk(...)[1]`` as separate ops (with
``bias_activation_fusion`` it needs ``torch.compile``): on a GPU the activation
and its backward were over a tenth of an actor update (docs/performance.md). :class:`FusedSwiGLUMLP` is the same
module (same submodules, parameters, checkpoint keys and forward contract)
whose forward sends the fc1 output through ``megarl_kernels.swiglu`` — one
Triton launch each way, the same numbers as the unfused ops. Anything else
(CPU tensors, another activation, clamping, an offset, per-token scales) takes
megatron's own forward unchanged.

:func:`fuse_swiglu` turns a built model's ``MLP`` modules into this subclass
(it adds no state): megatron's layer builds its MLP with the right TP group
only when the spec names ``MLP`` itself, so the spec stays megatron's.
"""
from __future__ import annotations

import torch.nn.functional as F
import torch
from megatron.core.transformer.mlp import MLP

from megarl_kernels.swiglu import swiglu


class FusedSwiGLUMLP(MLP):
    """``MLP`` with the gated SiLU of a CUDA forward in one fused op (module docstring)."""

    def _fusable(self, x, per_token_scale) -> bool:
        c = self.config
        return (x.is_cuda and per_token_scale is None and c.gated_linear_unit and self.activation_func is F.silu
                and not c.bias_activation_fusion and not c.use_te_activation_func
                and c.activation_func_clamp_value is None and c.glu_linear_offset == 0.0)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._fusable(hidden_states, per_token_scale):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, 2 * ffn/tp]
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))  # (output, output bias)


def fuse_swiglu(model: torch.nn.Module) -> None:
    """Every plain ``MLP`` of ``model`` becomes a :class:`FusedSwiGLUMLP` (in place, same parameters)."""
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = FusedSwiGLUMLP
