"""Mixture-of-experts models compute what ``transformers`` computes, at every expert layout, and export back exactly.

Setup: tiny random fp32 checkpoints saved with ``transformers`` (megarl/models/tiny.py):
Qwen3-MoE (4 experts, top-2, renormalized top-k weights, QK norm), Mixtral (4 experts,
top-2, ``block_sparse_moe.experts.N.w1/w2/w3`` names) and Qwen2-MoE (4 experts, top-2
softmax probabilities not renormalized, a shared expert scaled by
``sigmoid(shared_expert_gate(x))``, QKV bias, tied embeddings). One 2-process job runs
each at five layouts: tp1 (dp 2), ep2 (2 experts per rank, tokens exchanged by
alltoall), tp2 x ep2 (attention over TP, experts over EP, etp 1), tp2 (experts split
over expert-TP 2) and pp2; and Qwen2-MoE at pp2 x ep2 in 4 processes.

Expected values: megatron-core's router + dispatcher + experts is the same function as
HF's sparse block (``moe_router_pre_softmax`` picks between the two routings, see
megarl/models/moe.py), so logits equal HF's up to fp32 reordering of sums: max |diff|
<= 1e-5. The routed experts' choice is discrete; with random weights no logit pair is
within fp32 noise of a tie on these 14 tokens (a tie would show as a diff of order 1).
Exporting only gathers (over TP, expert-TP and EP) and un-fuses, so the exported
tensors equal the source's bitwise with the same names.

Also: megatron-core's GroupedMLP on ``torch._grouped_mm`` (the CUDA bf16 path) run on CPU in
bf16 at EP2, and a critic on the Qwen3-MoE backbone exported as a sequence classifier.

Not covered here: the GroupedMLP path on a GPU, the transformer-engine spec, TP training
(megatron-core needs sequence parallelism for it, see tests/test_models_moe_training.py).
"""
import os

import pytest
import torch

from dist_helpers import spawn

ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"]
LAYOUTS = {  # name -> (tp, pp, ep, etp) in a world of 2
    "tp1": (1, 1, 1, None), "ep2": (1, 1, 2, 1), "tp2ep2": (2, 1, 2, 1), "tp2": (2, 1, 1, 2), "pp2": (1, 2, 1, None),
}


def tokens():
    """[2, 7] token ids, identical on every rank."""
    return (torch.arange(14).reshape(2, 7) * 37 + 5) % 300


def read_tensors(path):
    """Every tensor of a HF safetensors directory (one file, or the files its index lists)."""
    import json

    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


def _job(rank, ckpts, out_root, layouts=LAYOUTS, archs=ARCHS):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, export_hf, forward_logits, load_hf_checkpoint
    from megarl.models import read_hf_config

    init_distributed()
    results = {}
    ids = tokens()
    for name, (tp, pp, ep, etp) in layouts.items():
        groups = build_parallel_groups(tp=tp, pp=pp, ep=ep, etp=etp)
        model_parallel_cuda_manual_seed(1234)
        for arch in archs:
            info = read_hf_config(ckpts[arch])
            model = build_gpt_model(info, groups, ModelOptions())
            report = load_hf_checkpoint(model, ckpts[arch], info, groups)
            assert report.unused == [], report.unused
            logits = forward_logits(model.eval(), groups, ids, torch.arange(7).expand(2, 7),
                                    vocab_size=info.vocab_size)
            export_hf(model, info, groups, os.path.join(out_root, name, arch))
            results[(name, arch)] = logits.numpy()  # numpy: a tensor would travel as a shared fd that
            # dies with this process
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf_moe")
    dirs, refs = {}, {}
    with torch.no_grad():
        for i, arch in enumerate(ARCHS):
            dirs[arch] = str(root / arch)
            refs[arch] = make_tiny_checkpoint(dirs[arch], arch, seed=20 + i)(tokens()).logits
    return dirs, refs


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    out_root = str(tmp_path_factory.mktemp("export_moe"))
    return spawn(_job, 2, ckpts[0], out_root)[0], out_root


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(runs, ckpts, layout, arch):
    got, want = torch.from_numpy(runs[0][(layout, arch)]), ckpts[1][arch]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_export_is_bitwise(runs, ckpts, layout, arch):
    src = read_tensors(ckpts[0][arch])
    out = read_tensors(os.path.join(runs[1], layout, arch))  # pp2: one file per stage and an index
    assert sorted(out) == sorted(src)
    bad = [k for k in src if src[k].dtype != out[k].dtype or not torch.equal(src[k], out[k])]
    assert bad == []


def test_pp2_ep2_four_processes(ckpts, tmp_path):
    """Qwen2-MoE over 4 processes as PP2 x EP2 (each stage's experts over its 2 ranks): logits and export."""
    arch = "Qwen2MoeForCausalLM"
    results = spawn(_job, 4, ckpts[0], str(tmp_path), {"pp2ep2": (1, 2, 2, 1)}, [arch])[0]
    assert (torch.from_numpy(results[("pp2ep2", arch)]) - ckpts[1][arch]).abs().max().item() <= 1e-5
    src, out = read_tensors(ckpts[0][arch]), read_tensors(str(tmp_path / "pp2ep2" / arch))
    assert sorted(out) == sorted(src) and all(torch.equal(out[k], t) for k, t in src.items())


def test_export_loads_in_transformers(runs, ckpts):
    """The EP2 export of Qwen2-MoE (shared expert, tied embeddings) is a model transformers loads and runs alike."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(runs[1], "ep2", "Qwen2MoeForCausalLM"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens()).logits
    assert torch.equal(logits, ckpts[1]["Qwen2MoeForCausalLM"])


# ---------------------------------------------------------------- layouts and grouped GEMM, one process
def test_grouped_layout_round_trips():
    """GroupedMLP's weight1/weight2 hold expert e's fc1 [2F, h] / fc2 [h, F] transposed, in the bytes
    of [E, h, 2F] / [E, F, h]; grouping then ungrouping gives the per-expert tensors back exactly."""
    from megarl.models import layouts

    gen = torch.Generator().manual_seed(0)
    fc1 = [torch.randn(6, 5, generator=gen) for _ in range(3)]  # 2F = 6, h = 5
    fc2 = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    w1, w2 = layouts.group_fc1(fc1), layouts.group_fc2(fc2)
    assert w1.shape == (5, 18) and w2.shape == (9, 5)
    for e in range(3):  # what GroupedMLP.forward multiplies by
        assert torch.equal(w1.view(3, 5, 6)[e], fc1[e].t())
        assert torch.equal(w2.view(3, 3, 5)[e], fc2[e].t())
    assert all(torch.equal(a, b) for a, b in zip(layouts.ungroup_fc1(w1, 3), fc1))
    assert all(torch.equal(a, b) for a, b in zip(layouts.ungroup_fc2(w2, 3), fc2))


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_matches_loop(trans_b):
    """``torch._grouped_mm`` over experts with 3, 0, 7 and 1 rows (one empty) == the per-expert loop."""
    from megarl.models.moe import grouped_gemm_ref, grouped_gemm_torch

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 8, generator=gen)
    w = torch.randn(4, 16, 8, generator=gen) if trans_b else torch.randn(4, 8, 16, generator=gen)
    sizes = torch.tensor([3, 0, 7, 1])
    got, want = grouped_gemm_torch(x, w, sizes, trans_b), grouped_gemm_ref(x, w, sizes, trans_b)
    assert got.shape == (11, 16)
    assert (got - want).abs().max().item() <= 1e-5


def _grouped_job(rank, src, out_root):
    """bf16 logits of the sequential and the grouped experts module, and each one's export, at EP2."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, export_hf, forward_logits, load_hf_checkpoint
    from megarl.models import read_hf_config

    init_distributed()
    groups = build_parallel_groups(ep=2)
    model_parallel_cuda_manual_seed(0)
    info = read_hf_config(src)
    logits = {}
    for kind in ("sequential", "grouped"):
        model = build_gpt_model(info, groups, ModelOptions(params_dtype="bf16", moe_experts=kind))
        load_hf_checkpoint(model, src, info, groups)
        logits[kind] = forward_logits(model.eval(), groups, tokens(), torch.arange(7).expand(2, 7),
                                      vocab_size=info.vocab_size).float()
        export_hf(model, info, groups, os.path.join(out_root, kind), dtype=torch.bfloat16)
    return {k: v.numpy() for k, v in logits.items()} if rank == 0 else None


def test_grouped_experts_module(ckpts, tmp_path):
    """megatron-core's GroupedMLP with torch._grouped_mm (the CUDA bf16 path, here on CPU in bf16) at EP2:
    the export is the source cast to bf16, bitwise (the grouped layout loads and unloads exactly), and
    the logits are the per-expert loop's up to bf16 rounding (|logits| ~ 3, bf16 steps 2^-7 there;
    a misplaced expert or a swapped gate/up would move them by O(1))."""
    src = ckpts[0]["Qwen2MoeForCausalLM"]
    logits = {k: torch.from_numpy(v) for k, v in spawn(_grouped_job, 2, src, str(tmp_path))[0].items()}
    assert (logits["grouped"] - logits["sequential"]).abs().max().item() <= 0.06
    source = read_tensors(src)
    for kind in ("sequential", "grouped"):
        out = read_tensors(str(tmp_path / kind))
        assert sorted(out) == sorted(source)
        assert all(torch.equal(out[k], t.to(torch.bfloat16)) for k, t in source.items()), kind


def _value_job(rank, src, out):
    """Per-token values of a critic started from the Qwen3-MoE causal LM at EP2, and its export."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, export_hf, forward_logits, load_value_model
    from megarl.models import read_hf_config

    init_distributed()
    groups = build_parallel_groups(ep=2)
    model_parallel_cuda_manual_seed(0)
    info = read_hf_config(src).as_value_model()
    model = build_gpt_model(info, groups, ModelOptions())
    load_value_model(model, src, info, groups, seed=7, std=0.02)
    values = forward_logits(model.eval(), groups, tokens(), torch.arange(7).expand(2, 7))
    export_hf(model, info, groups, out)
    return values.numpy() if rank == 0 else None


def test_moe_value_model_exports_as_sequence_classifier(ckpts, tmp_path):
    """A critic on an MoE backbone (value head drawn at EP2) is exported as Qwen3MoeForSequenceClassification,
    and transformers' per-token score on that export equals megarl's values (1e-5)."""
    import transformers

    out = str(tmp_path / "critic")
    values = torch.from_numpy(spawn(_value_job, 2, ckpts[0]["Qwen3MoeForCausalLM"], out)[0])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForSequenceClassification"
    with torch.no_grad():
        ref = model.score(model.model(tokens()).last_hidden_state)  # (2, 7, 1), before HF pools the last token
    assert (values.reshape(ref.shape) - ref).abs().max().item() <= 1e-5
