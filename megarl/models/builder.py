"""ModelInfo + options -> megatron-core ``TransformerConfig`` and ``GPTModel``.

The builder knows the model's shape, not the rank: which layers, embedding
and head this pipeline stage holds follows from ``groups`` (first / last
stage) inside megatron-core. Layer specs: the transformer-engine spec when
``transformer_engine`` imports (``layer_spec="auto"``), else megatron-core's
local spec, whose unfused ``core_attention`` is swapped for
:class:`~megarl.models.sdpa_attention.SDPAAttention` unless
``attention_backend="local"``. A mixture of experts (``info.moe``) gets
megatron-core's MoE layer (router, alltoall token dispatcher over the EP
group, experts; :mod:`megarl.models.moe` says which experts module and why).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.distributed.groups import ParallelGroups
from megarl.models.fused_mlp import fuse_swiglu
from megarl.models.hf_config import ModelInfo, sliding_window_check
from megarl.models.local_norm import local_norms
from megarl.models import moe
from megarl.models.moe_padding import exclude_padding
from megarl.models.sdpa_attention import SDPAAttention
from megarl.models.value_head import ValueHead
from megarl.models import rope_thd

rope_thd.install()  # packed rows: RoPE without megatron's per-layer host syncs (see rope_thd.py)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# megatron-core's activation recompute settings. selective: the core attention of every layer
# (recompute_modules defaults to ["core_attn"]); full: each layer's input is the only activation
# kept, and the layer runs again in backward (one layer per checkpoint).
_RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@dataclass
class ModelOptions:
    """How to build the Megatron model (the checkpoint fixes its shape)."""

    attention_backend: str = "sdpa"  # local spec only: "sdpa" | "local" (megatron's unfused one)
    layer_spec: str = "auto"  # "auto" (TE if it imports) | "local" | "te"
    params_dtype: str = "fp32"  # "fp32" | "bf16" | "fp16"
    make_vocab_size_divisible_by: int = 128  # vocab pads to a multiple of this * tp
    seq_length: Optional[int] = None  # longest sequence of the run; None: max_position_embeddings
    sequence_parallel: bool = False  # the local spec's norms support it too (megarl/models/local_norm.py)
    recompute: str = "none"  # activation recompute in training mode: "none" | "selective" | "full"
    moe_aux_loss_coef: float = 0.0  # MoE load-balancing loss weight (0: off)
    moe_z_loss_coef: float = 0.0  # MoE router z-loss weight (0: off)
    moe_experts: str = "auto"  # MoE experts module: "auto" (grouped on CUDA in bf16) | "grouped" (any dtype on CPU) | "sequential"

    def validate(self) -> None:
        if self.attention_backend not in ("sdpa", "local"):
            raise ValueError(f"model.attention_backend={self.attention_backend!r}: use 'sdpa' or 'local'")
        if self.layer_spec not in ("auto", "local", "te"):
            raise ValueError(f"model.layer_spec={self.layer_spec!r}: use 'auto', 'local' or 'te'")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"model.params_dtype={self.params_dtype!r}: use one of {sorted(_DTYPES)}")
        if self.layer_spec == "te" and not have_te():
            raise ValueError("model.layer_spec='te' but transformer_engine does not import; use 'local'")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("model.make_vocab_size_divisible_by must be >= 1")
        if self.recompute not in _RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: use one of {sorted(_RECOMPUTE)}")
        if self.moe_experts not in ("auto", "grouped", "sequential"):
            raise ValueError(f"moe_experts={self.moe_experts!r}: use 'auto', 'grouped' or 'sequential'")
        if self.moe_experts == "grouped" and self.params_dtype != "bf16" and torch.cuda.is_available():
            raise ValueError("model.moe_experts=grouped on CUDA needs model.dtype=bfloat16 (the grouped GEMM "
                             "path megarl runs there); use model.moe_experts=auto")
        if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0:
            raise ValueError("actor.moe_aux_loss_coef and actor.moe_z_loss_coef must be >= 0")


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def uses_te(opts: ModelOptions) -> bool:
    return opts.layer_spec == "te" or (opts.layer_spec == "auto" and have_te())


def transformer_config(info: ModelInfo, groups: ParallelGroups, opts: ModelOptions) -> TransformerConfig:
    """The megatron-core config of ``info`` laid out over ``groups``."""
    if info.num_groups % groups.tp_size or info.num_heads % groups.tp_size:
        raise ValueError(
            f"tp={groups.tp_size} must divide num_attention_heads={info.num_heads} and "
            f"num_key_value_heads={info.num_groups}; lower parallel.tp"
        )
    if info.num_layers % groups.pp_size:
        raise ValueError(f"pp={groups.pp_size} must divide num_hidden_layers={info.num_layers}")
    dtype = _DTYPES[opts.params_dtype]
    moe_fields = moe.transformer_config_fields(info, groups, opts) if info.moe else {}
    return TransformerConfig(
        num_layers=info.num_layers, hidden_size=info.hidden_size,
        num_attention_heads=info.num_heads, num_query_groups=info.num_groups,
        kv_channels=info.head_dim, ffn_hidden_size=info.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=info.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=info.qkv_bias, qk_layernorm=info.qk_norm,
        hidden_dropout=0.0, attention_dropout=float(info.hf_config.get("attention_dropout", 0.0)),
        init_method_std=info.init_std,
        tensor_model_parallel_size=groups.tp_size, pipeline_model_parallel_size=groups.pp_size,
        context_parallel_size=groups.cp_size, sequence_parallel=opts.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        variable_seq_lengths=groups.pp_size > 1,  # the schedule sends shapes before tensors
        moe_token_dispatcher_type="alltoall",  # MoE: tokens to their experts' EP ranks; dense: the
        # default "allgather" rejects variable_seq_lengths
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False,
        **_RECOMPUTE[opts.recompute], **moe_fields,
    )


def layer_spec(info: ModelInfo, opts: ModelOptions, stage_layers: Optional[int] = None) -> ModuleSpec:
    """The per-layer module spec: TE's, or the block spec of a stage of ``stage_layers`` (default: all)
    local layers with the chosen core attention and norms that run under sequence parallelism too."""
    experts = dict(num_experts=info.moe.num_experts, moe_grouped_gemm=moe.use_grouped_gemm(opts)
                   ) if info.moe else {}
    if uses_te(opts):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        # TE's own grouped experts (TEGroupedMLP: one weight per expert, fc1 / fc2 in TE modules) are not
        # what the loader, the engine and LoRA read; the legacy GroupedMLP is the same module as without TE
        legacy = dict(moe_use_legacy_grouped_gemm=True) if experts.get("moe_grouped_gemm") else {}
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=info.qk_norm, **experts, **legacy)
    spec = get_gpt_layer_local_spec(qk_layernorm=info.qk_norm, normalization="RMSNorm", **experts)
    if opts.attention_backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    return local_norms(spec, info.num_layers if stage_layers is None else stage_layers)


def _rope_kwargs(info: ModelInfo) -> dict:
    kwargs = dict(position_embedding_type="rope", rotary_base=info.rope_theta)
    if info.rope_type == "linear":
        kwargs["seq_len_interpolation_factor"] = info.rope_factor
    elif info.rope_type == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=info.rope_factor)
    return kwargs


def build_gpt_model(
    info: ModelInfo, groups: ParallelGroups, opts: Optional[ModelOptions] = None
) -> GPTModel:
    """This pipeline stage's GPTModel (value head attached when ``info.value_head``).

    Parameters are randomly initialized; load weights with
    :func:`megarl.models.loader.load_hf_checkpoint`.
    """
    opts = opts or ModelOptions()
    opts.validate()
    seq_length = opts.seq_length or info.max_position_embeddings
    sliding_window_check(info, seq_length)
    config = transformer_config(info, groups, opts)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(info, opts, info.num_layers // groups.pp_size),
        vocab_size=info.padded_vocab_size(groups.tp_size, opts.make_vocab_size_divisible_by),
        max_sequence_length=max(seq_length, info.max_position_embeddings),
        pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=info.tied_embeddings,
        pg_collection=groups.collection, **_rope_kwargs(info),
    )
    if info.value_head and groups.is_last_stage:
        model.output_layer = ValueHead(config, groups)
    if info.moe:
        moe.experts_in_own_optimizer(model)
        moe.own_grouped_forward(model)
        exclude_padding(model)  # the roles pass ModelInputs.padding as padding_mask
    _norms_in_params_dtype(model, config.params_dtype)
    fuse_swiglu(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())  # local-spec norms are built on the CPU
    return model


def _norms_in_params_dtype(model, dtype: torch.dtype) -> None:
    """The local spec builds ``torch.nn.RMSNorm`` in fp32 whatever params_dtype is (megatron's
    Float16Module would cast it; megarl builds in the target dtype instead). Beside bf16
    activations an fp32 weight keeps torch off its fused RMSNorm (the composite ran ~6 kernels
    per norm, ~12% of a 1.5B actor update on a GPU): cast them like every other parameter."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)
