"""SGLang's weight stream with a mixture of experts, against the fake engine (tests/sglang_fake.py), CPU fp32.

Tiny random Qwen3-MoE (4 experts, top-2) and Mixtral (``block_sparse_moe.experts.E.w1``)
checkpoints are the actor at EP2 over 2 processes (2 experts per rank; TP1, so each rank is its own
TP group with its own engine, which holds the whole model). Each rank's ``iter_hf_buckets`` must
yield exactly what ``export_hf`` wrote for the same model: every tensor, each name once, the
experts of both EP ranks under their HF names (``model.layers.L.mlp.experts.E.gate_proj.weight``),
same shapes and bits. After ``update_weights`` each rank's fake engine holds every exported
tensor, experts included, as the export cast to bfloat16 (SGLang's dtype), bitwise.
Not covered: a real SGLang loading the per-expert names into its fused experts (its loaders' name
mapping; GPU only), expert-TP > 1 (MoE training at TP needs transformer-engine here).
"""
import io
import os

import pytest
import torch

from dist_helpers import spawn

ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM"]


def _job(rank, ckpts, out_root):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import export_hf
    from megarl.roles.build import build_actor
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from megarl.rollout.weight_stream import iter_hf_buckets
    from sglang_fake import FakeEngine, FakeSerialized

    init_distributed()
    groups = build_parallel_groups(tp=1, pp=1, ep=2, etp=1)
    out = {}
    for arch, ckpt in ckpts.items():
        model_parallel_cuda_manual_seed(0)
        cfg = Config()
        cfg.model.path, cfg.parallel.ep = ckpt, 2
        actor = build_actor(cfg, groups, optimizer_steps=1)
        export_hf(actor.module, actor.info, groups, os.path.join(out_root, arch))
        stream = [(n, t.clone()) for b in iter_hf_buckets(actor.module, groups, actor.info, 20000) for n, t in b]
        engine = SGLangEngine(actor.module, groups, actor.info, [3], SGLangOptions(model_path=ckpt),
                              engine_factory=FakeEngine, tensor_wrapper=FakeSerialized)
        engine.update_weights()
        out[arch] = {"stream": stream, "engine": dict(engine.engine.weights)}
        engine.close()
    buf = io.BytesIO()  # by value: tensors in shared memory would not outlive this process
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoints

    root = tmp_path_factory.mktemp("sglang_moe")
    ckpts = make_tiny_checkpoints(root / "src", ARCHS, 60)
    ranks = spawn(_job, 2, ckpts, str(root / "export"))
    return root / "export", [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rank_streams_every_expert_as_exported(runs, arch):
    from safetensors.torch import load_file

    out, ranks = runs
    exported = load_file(os.path.join(out, arch, "model.safetensors"))
    block = "block_sparse_moe" if arch.startswith("Mixtral") else "mlp"
    down = "w2" if arch.startswith("Mixtral") else "down_proj"
    experts = [n for n in exported if f".{block}.experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert f"model.layers.1.{block}.experts.3.{down}.weight" in experts
    for rank in ranks:
        streamed = rank[arch]["stream"]
        assert sorted(n for n, _ in streamed) == sorted(exported)  # each name once
        for name, t in streamed:
            assert (t.dtype, t.shape) == (exported[name].dtype, exported[name].shape), name
            assert torch.equal(t.view(torch.uint8), exported[name].view(torch.uint8)), name
        loaded = rank[arch]["engine"]
        assert sorted(loaded) == sorted(exported)
        for name, t in loaded.items():
            assert torch.equal(t, exported[name].to(torch.bfloat16)), name
