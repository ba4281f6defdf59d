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
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from megarl.models.hf_config import ModelInfo

REPLICATED, ROW, QKV, GATE_UP, VOCAB = "replicated", "row", "qkv", "gate_up", "vocab"
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
EMBED, FINAL_NORM = "model.embed_tokens.weight", "model.norm.weight"
LM_HEAD, SCORE = "lm_head.weight", "score.weight"
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is made from (and written back to) HF tensors."""

    kind: str
    hf_names: tuple[str, ...]
    export: bool = True  # False for the last stage's copy of tied embeddings


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
        if match and match.group(2) in LAYER_RULES:
            kind, hf, _ = LAYER_RULES[match.group(2)]
            prefix = f"model.layers.{layer_index[int(match.group(1))]}."
            rule = Rule(kind, tuple(prefix + h for h in hf))
        if rule is None:
            unknown.append(name)
        else:
            rules[name] = rule
    if unknown:
        raise ValueError(f"no Hugging Face mapping for Megatron parameters: {', '.join(unknown)}")
    return rules


def expected_hf_names(info: ModelInfo) -> set[str]:
    """Every tensor name a HF checkpoint of ``info`` holds."""
    names = {EMBED, FINAL_NORM, SCORE if info.value_head else LM_HEAD}
    if info.tied_embeddings:
        names.discard(LM_HEAD)
    per_layer = {h for kind, hfs, needs in LAYER_RULES.values()
                 if needs is None or getattr(info, needs) for h in hfs}
    for i in range(info.num_layers):
        names.update(f"model.layers.{i}.{h}" for h in per_layer)
    return names
