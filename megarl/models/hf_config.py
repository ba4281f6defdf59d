"""Reads a Hugging Face ``config.json`` into :class:`ModelInfo`, megarl's model metadata.

Supported architectures are one table, :data:`FAMILIES`: each family
(llama, mistral, qwen2, qwen3, and the mixtures of experts mixtral, qwen2_moe,
qwen3_moe) says whether its attention has a QKV bias and a per-head RMSNorm on
queries and keys (Qwen3's ``q_norm``/``k_norm``), which keys switch its
sliding-window attention on, and, for a mixture of experts, how its router
and experts read (:class:`MoeFamily`, :class:`MoeInfo`). ``*ForCausalLM`` builds a
language model, ``*ForSequenceClassification`` (num_labels 1) a value model.

Everything here works on the plain JSON dict, not on ``transformers`` config
classes, so config files from older and newer ``transformers`` both read:
RoPE settings come from ``rope_parameters`` (transformers 5) or
``rope_theta`` + ``rope_scaling`` (earlier).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from megarl.errors import UserInputError


class ModelConfigError(UserInputError):
    """A checkpoint or config that megarl cannot build a model for; the message says why."""

    kind = "model error"


@dataclass(frozen=True)
class Family:
    """What one architecture family adds to the common Llama-style decoder."""

    qkv_bias: bool  # q/k/v projections carry a bias (o_proj does not)
    qk_norm: bool  # RMSNorm over head_dim on queries and keys
    window_switch: str | None  # config key that must be true for sliding_window to apply
    moe: MoeFamily | None = None  # a mixture of experts: how config.json names its router and experts


@dataclass(frozen=True)
class MoeFamily:
    """How a mixture-of-experts family's config.json and HF tensors name its parts."""

    experts_keys: tuple[str, ...]  # config keys of the expert count, first present wins
    ffn_key: str  # config key of one expert's FFN width
    norm_topk_default: bool | None  # norm_topk_prob when absent; None: always renormalized (no key)
    block: str  # HF module of the sparse block inside a layer ("mlp." / "block_sparse_moe.")
    expert_names: tuple[str, str, str]  # gate, up, down projection names inside experts.N.
    shared_expert: bool  # a shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate)


_QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")
_QWEN_COUNT = ("num_experts", "num_local_experts")  # the Hub's configs / transformers 5's save_pretrained
FAMILIES = {
    "Llama": Family(qkv_bias=False, qk_norm=False, window_switch=None),
    "Mistral": Family(qkv_bias=False, qk_norm=False, window_switch=None),
    "Qwen2": Family(qkv_bias=True, qk_norm=False, window_switch="use_sliding_window"),
    "Qwen3": Family(qkv_bias=False, qk_norm=True, window_switch="use_sliding_window"),
    "Mixtral": Family(qkv_bias=False, qk_norm=False, window_switch=None, moe=MoeFamily(
        ("num_local_experts",), "intermediate_size", None, "block_sparse_moe.", ("w1", "w3", "w2"), False)),
    "Qwen2Moe": Family(qkv_bias=True, qk_norm=False, window_switch="use_sliding_window", moe=MoeFamily(
        _QWEN_COUNT, "moe_intermediate_size", False, "mlp.", _QWEN_EXPERTS, True)),
    "Qwen3Moe": Family(qkv_bias=False, qk_norm=True, window_switch="use_sliding_window", moe=MoeFamily(
        _QWEN_COUNT, "moe_intermediate_size", False, "mlp.", _QWEN_EXPERTS, False)),
}
HEADS = {"ForCausalLM": False, "ForSequenceClassification": True}  # suffix -> value head
SUPPORTED = tuple(f + h for f in FAMILIES for h in HEADS)
ROPE_TYPES = ("default", "linear", "llama3")
# megatron-core's llama3 RoPE scaling hard-codes these three numbers.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class MoeInfo:
    """A mixture of experts' shape and routing, in the terms megatron-core's MoE layer uses.

    Routing: ``renormalize`` (Mixtral; Qwen with norm_topk_prob) picks the top-k router
    logits and softmaxes over those k (= softmax over all, top-k, divided by their sum);
    otherwise (Qwen2-MoE's default) the softmax over all experts is taken before the top-k
    and the k probabilities are used as they are.
    """

    num_experts: int
    topk: int  # experts per token
    ffn_hidden_size: int  # one expert's FFN width
    renormalize: bool  # top-k probabilities sum to 1
    shared_ffn_hidden_size: int | None  # the shared expert's FFN width (with its sigmoid gate); None: none
    block: str  # HF module name of the sparse block ("mlp." or "block_sparse_moe.")
    expert_names: tuple[str, str, str]  # HF gate, up, down names inside ``experts.N.``


@dataclass(frozen=True)
class ModelInfo:
    """The model a checkpoint holds, in the terms the builder, loader and exporter use."""

    arch: str  # HF architectures[0], e.g. "Qwen2ForCausalLM"
    family: str  # key of FAMILIES
    value_head: bool  # one output per token (critic / reward model) instead of the vocab
    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int  # key/value heads (megatron: num_query_groups)
    head_dim: int  # megatron: kv_channels
    ffn_hidden_size: int
    vocab_size: int  # real vocab, before padding
    norm_eps: float
    rope_theta: float
    rope_type: str  # one of ROPE_TYPES
    rope_factor: float  # 1.0 unless rope_type is linear / llama3
    max_position_embeddings: int
    tied_embeddings: bool  # lm_head shares the input embedding (never for value heads)
    qkv_bias: bool
    qk_norm: bool
    init_std: float  # initializer_range
    hf_config: dict  # config.json as read; the exporter writes it back
    moe: MoeInfo | None = None  # the mixture of experts every layer's MLP is; None: dense MLPs

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocab rounded up to a multiple of ``divisible_by * tp`` (rows past vocab_size are zero)."""
        from megarl_kernels import padded_vocab_size  # lazy: keeps config reading light

        return padded_vocab_size(self.vocab_size, divisible_by, tp)

    def as_value_model(self) -> "ModelInfo":
        """The same backbone with a value head (for a critic started from a causal LM)."""
        return dataclasses.replace(self, value_head=True, tied_embeddings=False)

    def hf_architecture(self) -> str:
        """Architecture name to write on export."""
        return self.family + ("ForSequenceClassification" if self.value_head else "ForCausalLM")

    def to_json(self) -> dict:
        return {"arch": self.arch, "value_head": self.value_head, "hf_config": self.hf_config}

    @staticmethod
    def from_json(d: dict) -> "ModelInfo":
        info = read_hf_config(d["hf_config"])
        return info.as_value_model() if d["value_head"] and not info.value_head else info


def load_config_json(path: str) -> dict:
    """``path``/config.json as a dict; clear errors for a missing dir or file."""
    if not os.path.isdir(path):
        raise ModelConfigError(f"checkpoint directory {path!r} does not exist")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelConfigError(f"{path!r} has no config.json; is it a Hugging Face model directory?")
    with open(cfg_file) as f:
        return json.load(f)


def _split_arch(cfg: dict) -> tuple[str, str, bool]:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else "<none>"
    for family in FAMILIES:
        for suffix, value_head in HEADS.items():
            if arch == family + suffix:
                return arch, family, value_head
    raise ModelConfigError(
        f"config.json architectures={archs} is not supported; supported: {', '.join(SUPPORTED)}"
    )


def _rope(cfg: dict) -> tuple[float, str, float]:
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ModelConfigError(
            f"config.json {key}.rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "llama3":
        for name, want in _LLAMA3_FIXED.items():
            if float(params.get(name, want)) != want:
                raise ModelConfigError(
                    f"config.json {key}.{name}={params[name]} is not supported; "
                    f"megatron-core's llama3 RoPE scaling needs {want}"
                )
    factor = float(params.get("factor", 1.0)) if kind != "default" else 1.0
    return theta, kind, factor


def _check_plain_linears(cfg: dict, family: Family) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"config.json hidden_act={cfg['hidden_act']!r} is not supported; need 'silu'")
    if cfg.get("mlp_bias"):
        raise ModelConfigError("config.json mlp_bias=true is not supported (megatron MLPs here have no bias)")
    if not family.qkv_bias and cfg.get("attention_bias"):
        raise ModelConfigError(
            "config.json attention_bias=true is not supported (it adds an o_proj bias); need false"
        )


def read_hf_config(source: str | dict) -> ModelInfo:
    """A HF model directory (or its config.json dict) -> ModelInfo."""
    cfg = load_config_json(source) if isinstance(source, str) else dict(source)
    try:
        return _info(cfg)
    except KeyError as e:
        raise ModelConfigError(f"config.json lacks the key {e.args[0]!r}") from None


def _info(cfg: dict) -> ModelInfo:
    arch, family_name, value_head = _split_arch(cfg)
    family = FAMILIES[family_name]
    _check_plain_linears(cfg, family)
    if value_head and cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) != 1:
        raise ModelConfigError("config.json num_labels must be 1 for a value model")
    theta, rope_type, factor = _rope(cfg)
    heads = cfg["num_attention_heads"]
    return ModelInfo(
        arch=arch, family=family_name, value_head=value_head,
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
        num_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_type=rope_type,
        rope_factor=factor, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not value_head,
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
        init_std=float(cfg.get("initializer_range", 0.02)), hf_config=cfg,
        moe=_moe_info(cfg, family.moe) if family.moe else None,
    )


def _moe_info(cfg: dict, family: MoeFamily) -> MoeInfo:
    """The MoE fields of config.json; variants megatron-core's MoE layer would not compute alike are refused."""
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ModelConfigError(
            f"config.json decoder_sparse_step={cfg.get('decoder_sparse_step', 1)} "
            f"mlp_only_layers={cfg.get('mlp_only_layers')}: dense layers between MoE layers are not "
            "supported; need decoder_sparse_step=1 and mlp_only_layers=[]")
    if cfg.get("router_jitter_noise"):
        raise ModelConfigError(f"config.json router_jitter_noise={cfg['router_jitter_noise']} is not "
                               "supported (megatron-core's router has no such noise); need 0")
    key = next((k for k in family.experts_keys if k in cfg), family.experts_keys[0])
    num_experts, topk = cfg[key], cfg["num_experts_per_tok"]
    if not 1 <= topk <= num_experts:
        raise ModelConfigError(f"config.json num_experts_per_tok={topk} must be in [1, "
                               f"{key}={num_experts}]")
    renormalize = True if family.norm_topk_default is None else bool(
        cfg.get("norm_topk_prob", family.norm_topk_default))
    if renormalize and topk == 1:  # softmax over one logit is 1: megatron-core refuses this routing
        raise ModelConfigError("config.json num_experts_per_tok=1 with renormalized top-k weights "
                               "(norm_topk_prob) is not supported; every weight would be 1")
    shared = cfg.get("shared_expert_intermediate_size") if family.shared_expert else None
    if family.shared_expert and not shared:
        raise ModelConfigError("config.json shared_expert_intermediate_size must be > 0 for a Qwen2-MoE model")
    return MoeInfo(num_experts=num_experts, topk=topk, ffn_hidden_size=cfg[family.ffn_key],
                   renormalize=renormalize, shared_ffn_hidden_size=shared,
                   block=family.block, expert_names=family.expert_names)


def sliding_window_check(info: ModelInfo, seq_length: int) -> None:
    """Raises unless sliding-window attention is off or never narrower than ``seq_length``."""
    cfg = info.hf_config
    window = cfg.get("sliding_window")
    switch = FAMILIES[info.family].window_switch
    used = window is not None and (switch is None or bool(cfg.get(switch)))
    used = used or "sliding_attention" in (cfg.get("layer_types") or [])
    if used and window is not None and window < seq_length:
        raise ModelConfigError(
            f"config.json sliding_window={window} is shorter than the sequence length {seq_length}; "
            "sliding-window attention is not implemented: lower model.seq_length to at most "
            f"{window}"
        )
