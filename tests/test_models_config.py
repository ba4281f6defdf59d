"""HF config -> ModelInfo / TransformerConfig, and the HF <-> Megatron layouts (one process).

Config: each supported family maps its config.json fields (heads, groups,
head_dim, bias, QK norm, tying, RoPE) onto ModelInfo and megatron-core's
TransformerConfig; unsupported inputs fail with one message naming the
config.json key. Layouts: fusing Q/K/V by group and then taking TP rank r's
rows equals fusing only rank r's groups (what the loader reads), and
splitting undoes fusing; vocab padding rounds 300 up to 384 (tp 1) / 512
(tp 2) with the default 128.

Not covered here: anything distributed (see test_models_parity.py).
"""
from types import SimpleNamespace

import pytest
import torch

from megarl.models import layouts
from megarl.models.hf_config import ModelConfigError, read_hf_config, sliding_window_check
from megarl.models.tiny import tiny_config


def cfg(arch, **overrides):
    d = tiny_config(arch, **overrides).to_dict()
    d["architectures"] = [arch]
    return d


def test_families_map_their_features():
    llama = read_hf_config(cfg("LlamaForCausalLM"))
    assert (llama.num_heads, llama.num_groups, llama.head_dim) == (4, 2, 16)
    assert (llama.rope_type, llama.rope_factor, llama.rope_theta) == ("linear", 2.0, 5000.0)
    assert not llama.qkv_bias and not llama.qk_norm and not llama.tied_embeddings
    qwen2 = read_hf_config(cfg("Qwen2ForCausalLM"))
    assert qwen2.qkv_bias and qwen2.tied_embeddings
    qwen3 = read_hf_config(cfg("Qwen3ForCausalLM"))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    value = read_hf_config(cfg("Qwen2ForSequenceClassification"))
    assert value.value_head and not value.tied_embeddings  # a value head never ties
    assert qwen2.as_value_model().hf_architecture() == "Qwen2ForSequenceClassification"


def test_old_style_rope_keys():
    """transformers 4 writes rope_theta + rope_scaling at top level."""
    d = cfg("LlamaForCausalLM")
    d.pop("rope_parameters")
    d.update(rope_theta=1e6, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    info = read_hf_config(d)
    assert (info.rope_theta, info.rope_type, info.rope_factor) == (1e6, "llama3", 8.0)


def test_vocab_padding():
    info = read_hf_config(cfg("LlamaForCausalLM"))
    assert info.padded_vocab_size(1) == 384 and info.padded_vocab_size(2) == 512
    assert info.padded_vocab_size(2, divisible_by=8) == 304


@pytest.mark.parametrize("change, needle", [
    (dict(architectures=["GPT2LMHeadModel"]), "LlamaForCausalLM, LlamaForSequenceClassification"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_parameters.rope_type='yarn'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}), "low_freq_factor"),
])
def test_unsupported_configs_name_the_key(change, needle):
    with pytest.raises(ModelConfigError) as e:
        read_hf_config({**cfg("LlamaForCausalLM"), **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sliding_window():
    mistral = read_hf_config(cfg("MistralForCausalLM", sliding_window=64))
    sliding_window_check(mistral, 64)  # window covers the whole sequence: plain causal attention
    with pytest.raises(ModelConfigError, match="sliding_window=64"):
        sliding_window_check(mistral, 65)
    qwen2 = read_hf_config(cfg("Qwen2ForCausalLM", sliding_window=16))  # use_sliding_window false
    sliding_window_check(qwen2, 128)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        read_hf_config(str(tmp_path / "nope"))
    with pytest.raises(ModelConfigError, match="no config.json"):
        read_hf_config(str(tmp_path))


def test_transformer_config_fields():
    from megarl.models.builder import ModelOptions, transformer_config

    groups = SimpleNamespace(tp_size=2, pp_size=1, cp_size=1)
    tc = transformer_config(read_hf_config(cfg("Qwen3ForCausalLM")), groups, ModelOptions())
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels, tc.hidden_size) == (4, 2, 32, 64)
    assert tc.qk_layernorm and not tc.add_qkv_bias and not tc.add_bias_linear and tc.gated_linear_unit
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-6 and tc.hidden_dropout == 0.0
    tc2 = transformer_config(read_hf_config(cfg("Qwen2ForCausalLM")), groups, ModelOptions(params_dtype="bf16"))
    assert tc2.add_qkv_bias and tc2.bf16 and tc2.params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="parallel.tp"):
        transformer_config(read_hf_config(cfg("Qwen2ForCausalLM")), SimpleNamespace(
            tp_size=4, pp_size=1, cp_size=1), ModelOptions())


def test_qkv_fuse_then_shard_equals_shard_then_fuse():
    """G=4 groups, h=3 heads per group, d=2: rank r of 2 owns groups 2r, 2r+1.

    Fused rows per group are [q (h*d=6), k (2), v (2)] = 10, so rank r's shard is
    rows [20r, 20r+20) of the full fusion; the loader builds it from q rows
    [12r, 12r+12) and k / v rows [4r, 4r+4).
    """
    G, heads, d, hidden = 4, 12, 2, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(G * d, hidden), torch.randn(G * d, hidden)
    full = layouts.interleave_qkv(q, k, v, G)
    assert torch.equal(full[0:6], q[0:6]) and torch.equal(full[6:8], k[0:2]) and torch.equal(full[8:10], v[0:2])
    assert torch.equal(full[10:16], q[6:12]) and torch.equal(full[16:18], k[2:4])  # group 1
    for r in range(2):
        (q0, q1), (k0, k1), _ = layouts.qkv_ranges(G, heads, d, r, 2)
        shard = layouts.interleave_qkv(q[q0:q1], k[k0:k1], v[k0:k1], G // 2)
        assert torch.equal(shard, full[20 * r: 20 * r + 20])
    for got, want in zip(layouts.split_qkv(full, G, heads), (q, k, v)):
        assert torch.equal(got, want)
    bias = layouts.interleave_qkv(q[:, 0], k[:, 0], v[:, 0], G)  # 1-D works the same
    assert torch.equal(bias, full[:, 0])


def test_gate_up_and_padding():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [torch.cat([gate[4 * r: 4 * r + 4], up[4 * r: 4 * r + 4]]) for r in range(2)]
    g, u = layouts.split_gate_up(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)
    padded = layouts.pad_rows(torch.ones(3, 2), 5)
    assert padded.shape == (5, 2) and padded[3:].abs().sum() == 0
    with pytest.raises(ValueError):
        layouts.chunk_range(10, 0, 4)
