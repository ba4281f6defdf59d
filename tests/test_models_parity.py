"""megarl's Megatron models compute what ``transformers`` computes, and export back exactly.

Setup: for Llama (GQA, linear RoPE scaling), Mistral, Qwen2 (QKV bias, tied
embeddings) and Qwen3 (QK norm, head_dim 32 != hidden 64 / 4 heads), a tiny
random fp32 checkpoint is saved with ``transformers``; vocab 300 is not a
multiple of 128 * tp, so the embedding and LM head carry zero padding rows
(384 at TP1, 512 at TP2) that must not leak into logits or exports.

Expected values: the Megatron model loaded from a checkpoint is the same
function as the HF model (same weights, same RoPE, same RMSNorm and SwiGLU),
so its logits on the same tokens equal HF's up to fp32 reordering of sums:
max |diff| <= 1e-4 at TP1, TP2, PP2 and TP2 x PP2 (one 4-process job; data-
parallel replicas fill the other ranks). Exporting only un-shards and un-fuses, never computes, so the
exported tensors equal the source ones bitwise (``torch.equal``, same names,
same dtypes), and ``transformers`` loads them. The same holds for a
``Qwen2ForSequenceClassification`` value model (per-token score
``score(model(x).last_hidden_state)``), for a value model started from a
causal LM (backbone from the LM, head drawn from ``N(0, 0.02)`` with seed 7),
and for a checkpoint split into several safetensors files by an index.

The SDPA core attention must equal megatron's unfused local attention (fp32,
1e-5) with the default causal mask and with an explicit padding mask; packed
sequences (``cu_seqlens``) must equal the sequences run one by one.

Not covered: bf16, the transformer-engine spec (TE is not installed here),
sequence parallel, interleaved pipelines, position_ids other than 0..s-1
(megatron-core's RoPE ignores position_ids).
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from dist_helpers import spawn

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
SEQCLS = "Qwen2ForSequenceClassification"
# (tp, pp) in a world of 4: data parallel fills the rest (dp 4, 2, 2, 1)
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
EXTRAS = ("tp2", "tp2pp2")  # layouts that also run the attention and missing-tensor checks
HEAD_SEED, HEAD_STD = 7, 0.02


def tokens():
    """[2, 7] token ids and positions, identical on every rank."""
    ids = (torch.arange(14).reshape(2, 7) * 37 + 5) % 300
    return ids, torch.arange(7).expand(2, 7)


# ---------------------------------------------------------------- workers
def _build(groups, src, value_from_lm=False, backend="sdpa"):
    from megarl.models import ModelOptions, build_gpt_model, load_hf_checkpoint, load_value_model, read_hf_config

    info = read_hf_config(src)
    if value_from_lm:
        info = info.as_value_model()
    model = build_gpt_model(info, groups, ModelOptions(attention_backend=backend))
    if info.value_head:
        report = load_value_model(model, src, info, groups, seed=HEAD_SEED, std=HEAD_STD)
    else:
        report = load_hf_checkpoint(model, src, info, groups)
    assert report.unused == (["lm_head.weight"] if value_from_lm else []), report.unused
    return model.eval(), info


def _forward_and_export(groups, src, out_dir, value_from_lm=False):
    from megarl.models import export_hf, forward_logits

    model, info = _build(groups, src, value_from_lm)
    ids, pos = tokens()
    out = forward_logits(model, groups, ids, pos, vocab_size=None if info.value_head else info.vocab_size)
    export_hf(model, info, groups, out_dir, copy_from=src)
    return out.numpy()


def _attention_checks(groups, src):
    """(sdpa - local) with causal and padding masks; (packed - one by one) logits, max |diff|."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.models import forward_logits

    (sdpa, info), (local, _) = _build(groups, src), _build(groups, src, backend="local")
    ids, pos = tokens()
    diffs = {"causal": (forward_logits(sdpa, groups, ids, pos) - forward_logits(local, groups, ids, pos))}
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True  # row 1 is right-padded after 5 tokens
    mask = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None] | pad[:, None, None, :]  # [b, 1, s, s]
    masked = [forward_logits(m, groups, ids, pos, attention_mask=mask) for m in (sdpa, local)]
    diffs["padding_mask"] = (masked[0] - masked[1])[~pad]
    lens = [5, 3, 6]
    seqs = [ids[0, :n] if i != 1 else ids[1, :n] for i, n in enumerate(lens)]
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    packed_pos = torch.cat([torch.arange(n) for n in lens])[None]
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    packed = forward_logits(sdpa, groups, torch.cat(seqs)[None], packed_pos, packed_seq_params=psp)
    single = torch.cat([forward_logits(sdpa, groups, s[None], torch.arange(len(s))[None]) for s in seqs], 1)
    diffs["packed"] = packed - single
    return {k: v.abs().max().item() for k, v in diffs.items()}


def _missing_tensor_error(groups, src):
    """The load error of whichever ranks hold the missing tensor's layer (None if no rank failed)."""
    import torch.distributed as dist

    message = None
    try:
        _build(groups, src)
    except ValueError as e:
        message = str(e)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), None)


def _job(rank, layouts, ckpts, out_root, extras):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    results = {}
    for name, (tp, pp) in layouts.items():
        groups = build_parallel_groups(tp=tp, pp=pp)
        model_parallel_cuda_manual_seed(1234)
        todo = [(arch, ckpts[arch], False) for arch in ARCHS + [SEQCLS]]
        todo.append(("value_from_lm", ckpts["LlamaForCausalLM"], True))
        if name in extras:
            todo.append(("sharded", ckpts["sharded"], False))
        for key, src, from_lm in todo:
            out = _forward_and_export(groups, src, os.path.join(out_root, name, key), from_lm)
            results[(name, key)] = out
        if name in extras:
            results[(name, "attention")] = _attention_checks(groups, ckpts["Qwen3ForCausalLM"])
            results[(name, "missing")] = _missing_tensor_error(groups, ckpts["missing"])
    return results if rank == 0 else None


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Source checkpoints and HF reference outputs on tokens()."""
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf")
    ids, _ = tokens()
    dirs, refs = {}, {}
    with torch.no_grad():
        for i, arch in enumerate(ARCHS + [SEQCLS]):
            dirs[arch] = str(root / arch)
            model = make_tiny_checkpoint(dirs[arch], arch, seed=i)
            if arch == SEQCLS:  # per-token score, before HF pools the last token
                refs[arch] = model.score(model.model(ids).last_hidden_state).numpy()
            else:
                refs[arch] = model(ids).logits.numpy()
                if arch == "LlamaForCausalLM":
                    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(HEAD_SEED)) * HEAD_STD
                    refs["value_from_lm"] = (model.model(ids).last_hidden_state @ head.t()).numpy()
                    refs["value_head"] = head
        dirs["sharded"] = str(root / "sharded")
        model = make_tiny_checkpoint(dirs["sharded"], "LlamaForCausalLM", seed=10, max_shard_size="40KB")
        refs["sharded"] = model(ids).logits.numpy()
    assert os.path.exists(os.path.join(dirs["sharded"], "model.safetensors.index.json"))
    dirs["missing"] = _without_tensor(dirs["Qwen3ForCausalLM"], str(root / "missing"), MISSING)
    return dirs, refs


MISSING = "model.layers.1.mlp.down_proj.weight"


def _without_tensor(src, dst, name):
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.pop(name)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    """The 4-process job, run once: {(layout, key): rank-0 output}, and the export root."""
    dirs, _ = ckpts
    out_root = str(tmp_path_factory.mktemp("export"))
    return spawn(_job, 4, LAYOUTS, dirs, out_root, EXTRAS)[0], out_root


# ---------------------------------------------------------------- helpers
def read_hf_dir(path):
    """All tensors of a HF safetensors directory (single file or index), and config.json."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(path, f)))
    return tensors, json.load(open(os.path.join(path, "config.json")))


def assert_bitwise(exported, source):
    assert sorted(exported) == sorted(source)
    for name, t in source.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS + [SEQCLS])
def test_outputs_match_transformers(runs, ckpts, layout, arch):
    results, _ = runs
    np.testing.assert_allclose(results[(layout, arch)], ckpts[1][arch], rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS + [SEQCLS])
def test_export_is_bitwise(runs, ckpts, layout, arch):
    src_tensors, src_config = read_hf_dir(ckpts[0][arch])
    out_tensors, out_config = read_hf_dir(os.path.join(runs[1], layout, arch))
    assert_bitwise(out_tensors, src_tensors)
    assert out_config == src_config
    if arch.startswith("Qwen2"):  # tied embeddings: no lm_head written
        assert "lm_head.weight" not in out_tensors


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_export_loads_in_transformers(runs, ckpts, layout):
    import transformers

    ids, _ = tokens()
    for arch in ARCHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(runs[1], layout, arch))
        with torch.no_grad():
            np.testing.assert_allclose(model(ids).logits.numpy(), ckpts[1][arch], rtol=0, atol=1e-5)
    for key in (SEQCLS, "value_from_lm"):
        model = transformers.AutoModelForSequenceClassification.from_pretrained(os.path.join(runs[1], layout, key))
        with torch.no_grad():
            scores = model.score(model.model(ids).last_hidden_state).numpy()
        np.testing.assert_allclose(scores, ckpts[1][key], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_missing_tensor_is_named(runs, layout):
    """Qwen3 checkpoint without one tensor: the load fails naming the tensor and the parameter."""
    message = runs[0][(layout, "missing")]
    assert message and MISSING in message and "linear_fc2.weight" in message


def test_sharded_index_input(runs, ckpts):
    """A checkpoint split over several files by an index loads at TP2 and exports the same tensors."""
    results, out_root = runs
    np.testing.assert_allclose(results[("tp2", "sharded")], ckpts[1]["sharded"], rtol=0, atol=1e-4)
    assert_bitwise(read_hf_dir(os.path.join(out_root, "tp2", "sharded"))[0], read_hf_dir(ckpts[0]["sharded"])[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_value_model_from_causal_lm(runs, ckpts, layout):
    """Backbone from LlamaForCausalLM, head N(0, 0.02) from seed 7; exported as *ForSequenceClassification."""
    results, out_root = runs
    np.testing.assert_allclose(results[(layout, "value_from_lm")], ckpts[1]["value_from_lm"], rtol=0, atol=1e-4)
    out, config = read_hf_dir(os.path.join(out_root, layout, "value_from_lm"))
    src, _ = read_hf_dir(ckpts[0]["LlamaForCausalLM"])
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert torch.equal(out.pop("score.weight"), ckpts[1]["value_head"])
    src.pop("lm_head.weight")
    assert_bitwise(out, src)


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_sdpa_attention_matches_local(runs, layout):
    """Qwen3 (GQA, head_dim 32): SDPA == megatron's unfused attention, causal and padding-masked."""
    diffs = runs[0][(layout, "attention")]
    assert diffs["causal"] <= 1e-5 and diffs["padding_mask"] <= 1e-5, diffs


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_packed_sequences_match_one_by_one(runs, layout):
    """Three sequences packed with cu_seqlens [0, 5, 8, 14] == each run alone (RoPE restarts per sequence)."""
    assert runs[0][(layout, "attention")]["packed"] <= 1e-5
