"""The local layer spec's RMSNorm, which also runs under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel``: under it each rank of a TP group normalizes its own slice of the sequence, so a
norm weight's gradient is one partial sum per TP rank. megatron-core's ``finalize_model_grads`` sums those
over the TP group for every parameter marked ``sequence_parallel`` (transformer-engine's norms mark
theirs, as the router and megarl's value head do). :class:`LocalRMSNorm` is ``torch.nn.RMSNorm`` with
that mark, and :func:`local_norms` puts it in a local layer spec and in the block's final norm. The q/k
norms see whole sequences of their TP rank's heads; megatron-core sums their gradients over TP by name
(with or without the mark: the same single sum).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules


class LocalRMSNorm:
    """``torch.nn.RMSNorm(hidden_size, eps)``, its weight marked ``sequence_parallel`` as the config says
    (megatron-core's norm signature; a plain ``torch.nn.RMSNorm`` comes back)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> torch.nn.RMSNorm:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"LocalRMSNorm builds a plain RMSNorm, not {config.normalization} "
                             f"(zero-centered gamma: {config.layernorm_zero_centered_gamma})")
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def local_norms(layer: ModuleSpec, stage_layers: int) -> ModuleSpec:
    """A local transformer-layer spec -> the block spec of a pipeline stage of ``stage_layers`` such
    layers whose every norm (input, pre-MLP, q/k, the final one) is a :class:`LocalRMSNorm`."""
    layer_subs = layer.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        setattr(layer_subs, name, LocalRMSNorm)
    attention = layer_subs.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, LocalRMSNorm)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * stage_layers, layer_norm=LocalRMSNorm))
