"""Which Hugging Face tensors make each Megatron parameter, and how they are sharded.

One table per level: :data:`LAYER_RULES` for the parameters inside
``decoder.layers.N`` (HF ``model.layers.N``), :func:`_top_rule` for the
embedding, final norm and head. Both the local spec's names
(``input_layernorm.weight``) and the TE spec's fused ones
(``self_attention.linear_qkv.layer_norm_weight``) are listed; the loader and
exporter map whichever names the built model has.

Kinds (how a TP rank's slice relates to the HF tensors, see ``layouts``):
replicated (whole tensor on every rank), row (input dim split: o_proj,
down_proj), qkv (three HF tensors fused by group), gate_up (two fused per
shard), vocab (rows split, zero-padded past the real vocab).

Mixture-of-experts layers (:func:`_moe_rule`): the router and the shared
expert's gate are replicated, the shared expert is a TP-sharded MLP, and each
routed expert lives on one EP rank (global expert ``ep_rank * local + i``),
split over the expert tensor-parallel (etp) axis: expert_gate_up / expert_down
for one expert's fused fc1 / fc2 (megatron-core's SequentialMLP
``local_experts.I.linear_fc*`` and TE's ``linear_fc*.weightI``), grouped_gate_up
/ grouped_down for all local experts in one tensor (GroupedMLP ``weight1`` /
``weight2``, see ``layouts``). An expert rule lists the HF names of every EP
rank's experts (``ep_hf_names``) so the exporter can gather them all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from megarl.models.hf_config import ModelInfo

REPLICATED, ROW, QKV, GATE_UP, VOCAB = "replicated", "row", "qkv", "gate_up", "vocab"
EXPERT_GATE_UP, EXPERT_DOWN = "expert_gate_up", "expert_down"  # one expert, split over etp
GROUPED_GATE_UP, GROUPED_DOWN = "grouped_gate_up", "grouped_down"  # all local experts, split over etp
EXPERT_KINDS = (EXPERT_GATE_UP, EXPERT_DOWN, GROUPED_GATE_UP, GROUPED_DOWN)
_ATTN = "self_attn."
_QKV_W = tuple(f"{_ATTN}{p}_proj.weight" for p in "qkv")
_QKV_B = tuple(f"{_ATTN}{p}_proj.bias" for p in "qkv")

# megatron suffix -> (kind, HF suffixes, ModelInfo flag that must be true or None)
LAYER_RULES = {
    "input_layernorm.weight": (REPLICATED, ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.layer_norm_weight": (REPLICATED, ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.weight": (QKV, _QKV_W, None),
    "self_attention.linear_qkv.bias": (QKV, _QKV_B, "qkv_bias"),
    "self_attention.q_layernorm.weight": (REPLICATED, (f"{_ATTN}q_norm.weight",), "qk_norm"),
    "self_attention.k_layernorm.weight": (REPLICATED, (f"{_ATTN}k_norm.weight",), "qk_norm"),
    "self_attention.linear_proj.weight": (ROW, (f"{_ATTN}o_proj.weight",), None),
    "pre_mlp_layernorm.weight": (REPLICATED, ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.layer_norm_weight": (REPLICATED, ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.weight": (GATE_UP, ("mlp.gate_proj.weight", "mlp.up_proj.weight"), None),
    "mlp.linear_fc2.weight": (ROW, ("mlp.down_proj.weight",), None),
}
DENSE_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_SHARED = "mlp.shared_expert."
# megatron suffix inside an MoE layer -> (kind, HF suffixes after the block prefix)
MOE_RULES = {
    "mlp.router.weight": (REPLICATED, ("gate.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (GATE_UP, (f"{_SHARED}gate_proj.weight", f"{_SHARED}up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": (ROW, (f"{_SHARED}down_proj.weight",)),
    "mlp.shared_experts.gate_weight": (REPLICATED, ("mlp.shared_expert_gate.weight",)),
}
_EXPERT = {  # regex on the megatron suffix -> kind; group 1 (if any) is the local expert index
    re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight"): EXPERT_GATE_UP,
    re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight"): EXPERT_DOWN,
    re.compile(r"mlp\.experts\.linear_fc1\.weight(\d+)"): EXPERT_GATE_UP,
    re.compile(r"mlp\.experts\.linear_fc2\.weight(\d+)"): EXPERT_DOWN,
    re.compile(r"mlp\.experts\.weight1"): GROUPED_GATE_UP,
    re.compile(r"mlp\.experts\.weight2"): GROUPED_DOWN,
}
EMBED, FINAL_NORM = "model.embed_tokens.weight", "model.norm.weight"
LM_HEAD, SCORE = "lm_head.weight", "score.weight"
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is made from (and written back to) HF tensors."""

    kind: str
    hf_names: tuple[str, ...]
    export: bool = True  # False for the last stage's copy of tied embeddings
    ep_hf_names: tuple[tuple[str, ...], ...] = ()  # expert kinds: hf_names of this parameter on each EP rank


def expert_hf_names(info: ModelInfo, layer: int, expert: int) -> tuple[str, str, str]:
    """HF gate, up, down weight names of routed expert ``expert`` in layer ``layer``."""
    m = info.moe
    return tuple(f"model.layers.{layer}.{m.block}experts.{expert}.{p}.weight" for p in m.expert_names)


def _expert_names(kind: str, local: int | None, info: ModelInfo, layer: int, num_local: int,
                  ep_size: int) -> tuple[tuple[str, ...], ...]:
    """HF names of one expert parameter on each EP rank (``local``: its local expert; None: all
    local experts, GroupedMLP): (gate, up) per expert for fc1 kinds, (down,) for fc2 kinds."""
    def names(ep_rank: int) -> tuple[str, ...]:
        experts = [ep_rank * num_local + i for i in (range(num_local) if local is None else [local])]
        per = [expert_hf_names(info, layer, e) for e in experts]  # (gate, up, down) each
        return tuple(n for g, u, d in per for n in ((d,) if kind in (EXPERT_DOWN, GROUPED_DOWN) else (g, u)))

    return tuple(names(r) for r in range(ep_size))


def _moe_rule(suffix: str, info: ModelInfo, layer: int, moe_layer: nn.Module) -> Rule | None:
    """Rule of an MoE layer's parameter (router, shared expert, experts), or None for another one."""
    if suffix in MOE_RULES:
        kind, hf = MOE_RULES[suffix]
        block = "" if suffix.startswith("mlp.shared_experts.") else info.moe.block
        return Rule(kind, tuple(f"model.layers.{layer}.{block}{h}" for h in hf))
    for pattern, kind in _EXPERT.items():
        match = pattern.fullmatch(suffix)
        if match:
            num_local = moe_layer.num_local_experts
            ep_size = info.moe.num_experts // num_local
            local = int(match.group(1)) if match.groups() else None
            ep_rank = moe_layer.local_expert_indices[0] // num_local
            every = _expert_names(kind, local, info, layer, num_local, ep_size)
            return Rule(kind, every[ep_rank], ep_hf_names=every)
    return None


def _top_rule(name: str, info: ModelInfo) -> Rule | None:
    if name == "embedding.word_embeddings.weight":
        return Rule(VOCAB, (EMBED,))
    if name == "decoder.final_layernorm.weight":
        return Rule(REPLICATED, (FINAL_NORM,))
    if name == "output_layer.weight":
        if info.value_head:
            return Rule(REPLICATED, (SCORE,))
        if info.tied_embeddings:  # last stage's copy of the word embedding (pp > 1)
            return Rule(VOCAB, (EMBED,), export=False)
        return Rule(VOCAB, (LM_HEAD,))
    return None


def parameter_names(model: nn.Module) -> list[str]:
    """The model's weight names (state dict minus TE's ``_extra_state`` entries)."""
    return [k for k in model.state_dict() if not k.endswith("_extra_state")]


def model_rules(model: nn.Module, info: ModelInfo) -> dict[str, Rule]:
    """Megatron name -> Rule for every weight this pipeline stage holds.

    LoRA adapters (``*.lora_a`` / ``*.lora_b``, megarl/models/lora.py) have no HF tensor of
    their own: an export merges them into the base weights first (``merged_lora``).
    """
    # local layer index -> global one (layer_number is global and 1-based)
    layer_index = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    rules, unknown = {}, []
    for name in parameter_names(model):
        if name.endswith((".lora_a", ".lora_b")):
            continue
        rule = _top_rule(name, info)
        match = _LAYER_NAME.fullmatch(name)
        if match:
            local, suffix = int(match.group(1)), match.group(2)
            rule = _layer_rule(suffix, info, layer_index[local], model.decoder.layers[local]) or rule
        if rule is None:
            unknown.append(name)
        else:
            rules[name] = rule
    if unknown:
        raise ValueError(f"no Hugging Face mapping for Megatron parameters: {', '.join(unknown)}")
    return rules


def _layer_rule(suffix: str, info: ModelInfo, layer: int, module: nn.Module) -> Rule | None:
    """Rule of parameter ``decoder.layers.N.<suffix>`` (``layer``: global index), or None."""
    if info.moe is not None:
        if suffix in DENSE_MLP:
            return None
        rule = _moe_rule(suffix, info, layer, module.mlp)
        if rule is not None:
            return rule
    if suffix in LAYER_RULES:
        kind, hf, _ = LAYER_RULES[suffix]
        return Rule(kind, tuple(f"model.layers.{layer}.{h}" for h in hf))
    return None


def expected_hf_names(info: ModelInfo) -> set[str]:
    """Every tensor name a HF checkpoint of ``info`` holds."""
    names = {EMBED, FINAL_NORM, SCORE if info.value_head else LM_HEAD}
    if info.tied_embeddings:
        names.discard(LM_HEAD)
    per_layer = {h for suffix, (kind, hfs, needs) in LAYER_RULES.items()
                 if (needs is None or getattr(info, needs)) and not (info.moe and suffix in DENSE_MLP)
                 for h in hfs}
    for i in range(info.num_layers):
        names.update(f"model.layers.{i}.{h}" for h in per_layer)
        if info.moe:
            names.update(_moe_layer_names(info, i))
    return names


def _moe_layer_names(info: ModelInfo, layer: int) -> set[str]:
    m = info.moe
    names = {f"model.layers.{layer}.{m.block}gate.weight"}
    for e in range(m.num_experts):
        names.update(expert_hf_names(info, layer, e))
    if m.shared_ffn_hidden_size:
        names.update(f"model.layers.{layer}.{h}" for suffix, (_, hfs) in MOE_RULES.items()
                     if suffix.startswith("mlp.shared_experts.") for h in hfs)
    return names
