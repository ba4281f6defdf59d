"""Expert ids recorded through the CUDA-graph path equal the eager path's, token for token.

A tiny random fp32 Qwen3-MoE (megarl/models/tiny.py) generates with ``record_experts`` twice: eagerly, and
through the decode and prefill graphs' static buffers and padding run without capture
(``DecodeGraphs(capture=False)``: the same buffers, the ids written by the graph body into the static
device buffer and copied out beside the tokens). With one stage the graph steps are launched ahead (a
step's ids are read back after the scheduler advanced it, when the prefill's forks already decode);
with two pipeline stages each stage records its own layers synchronously. The batch is larger than
``max_batch`` with small prefill chunks, so refills, mixed steps and chunked prompts all go through
the graphs. Tokens, log-probs, response ids and prompt ids (shared by a prompt's samples) must be equal.
Not covered: capture on a GPU (no GPU here).
"""
import numpy as np
import pytest

from dist_helpers import spawn

PROMPTS = [[7, 8, 9, 10, 11, 12], list(range(20, 45)), [40, 41, 42], [30], list(range(50, 61))]
MAX_NEW = [6, 3, 9, 5, 4]  # groups end at different steps: refills join running ones (mixed steps)


def _engine(actor, groups, graphs: bool):
    from megarl.rollout.graphs import DecodeGraphs
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.prefill_graphs import PrefillGraphs

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=16, kv_cache_gb=0.001,
                            record_experts=True)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    if graphs:
        engine.graphs = DecodeGraphs(engine, options.max_batch, capture=False)
        engine.prefill_graphs = PrefillGraphs(engine, engine.graphs, capture=False)
    return engine


def _job(rank, ckpt, pp):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests

    init_distributed()
    groups = build_parallel_groups(tp=1, pp=pp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.pp = pp
    actor = build_actor(cfg, groups, optimizer_steps=1)
    from megarl.rollout import moe_step

    routed, fused = [], moe_step.fused_moe_local

    def counting(rows, w13, w2, weights, ids, first):  # token-expert pairs sent to an expert (4 experts)
        routed.append(int((ids < 4).sum()))
        return fused(rows, w13, w2, weights, ids, first)

    moe_step.fused_moe_local = counting
    requests = sample_requests(PROMPTS, 2, 100, MAX_NEW)  # 10 sequences: forks, refills, mixed steps
    out = {}
    for name in ("eager", "graphs"):
        engine = _engine(actor, groups, name == "graphs")
        routed.clear()
        results = engine.generate(requests, SamplingParams(temperature=0.9))
        out[name] = {"tokens": [r.response_ids for r in results], "logprobs": [r.logprobs for r in results],
                     "experts": [r.expert_ids for r in results],
                     "prompt_experts": [r.prompt_expert_ids for r in results],
                     "stats": dict(engine.stats), "routed": sum(routed)}
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("graph_experts"))
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=7)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["pp1", "pp2"])
def runs(request, ckpt):
    return request.param, spawn(_job, request.param, ckpt, request.param)


def test_graph_steps_record_what_eager_steps_record(runs):
    pp, by_rank = runs
    for out in by_rank:
        eager, graphs = out["eager"], out["graphs"]
        assert graphs["stats"]["rollout/graph_steps"] > 0 and graphs["stats"]["rollout/prefill_graph_steps"] > 0
        assert graphs["stats"]["rollout/mixed_steps"] > 0
        if pp == 1:  # one stage: graph steps are launched ahead, their ids read back later
            assert graphs["stats"]["rollout/planned_ahead_steps"] > 0
        assert eager["stats"]["rollout/graph_steps"] == 0
        assert graphs["routed"] == eager["routed"] > 0  # the graphs' padded rows go to no expert
        assert graphs["tokens"] == eager["tokens"]
        for got, want in zip(graphs["logprobs"], eager["logprobs"]):  # padded batches: other GEMM shapes
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        for key in ("experts", "prompt_experts"):
            for got, want in zip(graphs[key], eager[key]):
                assert got is not None and got.dtype == np.uint8
                np.testing.assert_array_equal(got, want)
        for i, prompt in enumerate(PROMPTS):  # sample_requests: a prompt's n samples are adjacent
            assert graphs["prompt_experts"][2 * i].shape[0] == len(prompt) - 1
            np.testing.assert_array_equal(graphs["prompt_experts"][2 * i], graphs["prompt_experts"][2 * i + 1])
            assert (graphs["experts"][2 * i] < 4).all() and (graphs["prompt_experts"][2 * i] < 4).all()  # recorded


def test_pipeline_stages_record_their_own_layers(runs):
    pp, by_rank = runs
    layers = [out["graphs"]["experts"][0].shape[1] for out in by_rank]
    assert sum(layers) == layers[0] * pp  # each stage its half (tiny: an even layer count)


GPU_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, vocab_size=1000,
                 max_position_embeddings=512)


def _cuda_job(rank, ckpt):
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path, cfg.model.dtype = ckpt, "bfloat16"
    actor = build_actor(cfg, groups, optimizer_steps=1)
    g = torch.Generator().manual_seed(0)
    # 32 prompts of 32 tokens on 8 slots: refills of 256 tokens and decode batches of 8, bucket sizes
    # exactly, so the graphs run eager's GEMM shapes (bf16: bitwise the same routing)
    requests = sample_requests([torch.randint(5, 1000, (32,), generator=g).tolist() for _ in range(32)], 1, 0, 24)
    out = {}
    for graphs in (True, False):
        engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0,
                              EngineOptions(max_batch=8, cuda_graphs=graphs, max_model_len=96, record_experts=True))
        results = engine.generate(requests, SamplingParams(temperature=0.0))
        out[graphs] = {"tokens": [r.response_ids for r in results], "experts": [r.expert_ids for r in results],
                       "prompt_experts": [r.prompt_expert_ids for r in results], "stats": dict(engine.stats)}
    return out


@pytest.mark.gpu
def test_captured_graphs_record_what_eager_steps_record(tmp_path):
    from megarl.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path), "Qwen3MoeForCausalLM", seed=5, **GPU_SHAPE)
    (r,) = spawn(_cuda_job, 1, str(tmp_path))
    graphed, eager = r[True], r[False]
    assert graphed["stats"]["rollout/graph_steps"] > 0 and graphed["stats"]["rollout/planned_ahead_prefills"] > 0
    assert graphed["tokens"] == eager["tokens"]
    for key in ("experts", "prompt_experts"):
        for got, want in zip(graphed[key], eager[key]):
            np.testing.assert_array_equal(got, want)
