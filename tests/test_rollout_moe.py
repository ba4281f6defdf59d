"""The native engine generates with mixtures of experts: greedy == ``transformers``, log-probs == training.

Tiny random fp32 Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints (4 experts, top-2;
megarl/models/tiny.py) are loaded into the actor in 2 processes at EP1 (DP2, each rank
all 4 experts) and EP2 (2 experts per rank, rows exchanged over the EP group every MoE
layer). Each rank generates its own prompts — rank 1 shorter ones than rank 0, so at
EP2 it runs out of work first and keeps serving rank 0's rows with its experts (idle
steps) — and greedy responses must equal ``transformers`` ``generate`` on each prompt
alone, token for token. Sampled responses' engine log-probs must equal the actor's
training forward over the same tokens (fp32, 1e-5), and the sampled tokens must be the
same at EP1 and EP2. The engine's recorded expert ids (per prompt token but the last, from the
prefill, and per response token, and MoE layer) must equal the top-k that ``transformers``' router
picks for that token in a full forward; the n samples of a prompt carry the same prompt ids. The
engine has the prefix cache on: the sampled call, after the greedy one on the same prompts, takes the
13-token prompt's first page (8 tokens) from the cache, and with it the ids the greedy call's prefill
recorded for those tokens.
Not covered: bf16, the GroupedMLP layout in the engine (CUDA bf16), CUDA graphs, TP > 1.
"""
import pytest
import torch

from dist_helpers import spawn

ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"]
PROMPTS = {0: [[7, 8, 9, 10, 11, 12], list(range(20, 33))], 1: [[40, 41, 42], [30]]}  # as many samples a rank
MAX_NEW = {0: 8, 1: 3}


def _actor(ckpt, ep):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.roles.build import build_actor

    groups = build_parallel_groups(tp=1, pp=1, ep=ep, etp=1 if ep > 1 else None)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.ep = ep
    return build_actor(cfg, groups, optimizer_steps=1), groups


def _job(rank, ckpts, eps=(1, 2)):
    from megarl.distributed import init_distributed
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    init_distributed()
    out = {}
    for ep in eps:
        for arch, ckpt in ckpts.items():
            actor, groups = _actor(ckpt, ep)
            options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001,
                                    record_experts=True, prefix_cache=True)
            engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
            prompts = PROMPTS[rank]
            greedy = engine.generate(sample_requests(prompts, 1, 0, MAX_NEW[rank]), SamplingParams(temperature=0.0))
            sampled = engine.generate(sample_requests(prompts, 2, 100, MAX_NEW[rank]), SamplingParams(temperature=0.8))
            batch = to_sample_batch(sampled, 0, "cpu")
            train = actor.logprobs(batch, micro_batch_size=4, temperature=0.8)["logprobs"]
            diff = ((train - batch.rollout_logprobs).abs() * batch.response_mask).max()
            out[(ep, arch)] = {"greedy": [r.response_ids for r in greedy], "diff": float(diff),
                               "sampled": [r.response_ids for r in sampled],
                               "experts": [r.expert_ids for r in greedy],
                               "prompt_experts": [r.prompt_expert_ids for r in greedy],
                               "sampled_prompt_experts": [r.prompt_expert_ids for r in sampled],
                               "prefix_cached": engine.stats["rollout/prefix_cached_tokens"]}
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf_moe_rollout")
    dirs, want, routed = {}, {}, {}
    for i, arch in enumerate(ARCHS):
        dirs[arch] = str(root / arch)
        model = make_tiny_checkpoint(dirs[arch], arch, seed=40 + i)
        with torch.no_grad():
            want[arch] = {rank: [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW[rank], do_sample=False,
                                                pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                                 for p in prompts] for rank, prompts in PROMPTS.items()}
            routed[arch] = {rank: [hf_experts(model, p, r) for p, r in zip(PROMPTS[rank], want[arch][rank])]
                            for rank in PROMPTS}
    return dirs, want, routed


def hf_experts(model, prompt, response):
    """(P + R - 1, layers, k) the experts ``transformers``' routers pick for every token but the last
    (prompt tokens 0 .. P - 2, then the rows that produce each response token), largest probability first."""
    out = model(torch.tensor([prompt + response]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    rows = slice(0, len(prompt) + len(response) - 1)
    return torch.stack([torch.topk(logits[rows].softmax(-1), k).indices for logits in out.router_logits], dim=1)


@pytest.fixture(scope="module")
def runs(ckpts):
    return spawn(_job, 2, ckpts[0])


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(runs, ckpts, ep, arch):
    for rank in (0, 1):
        assert runs[rank][(ep, arch)]["greedy"] == ckpts[1][arch][rank]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_logprobs_match_training(runs, ep, arch):
    for rank in (0, 1):
        assert runs[rank][(ep, arch)]["diff"] <= 1e-5


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_experts_match_transformers_router(runs, ckpts, ep, arch):
    for rank in (0, 1):
        r = runs[rank][(ep, arch)]
        got, prompt_ids = r["experts"], r["prompt_experts"]
        assert [g.dtype.name for g in got + prompt_ids] == ["uint8"] * 2 * len(got)
        want = ckpts[2][arch][rank]
        assert [len(p) for p in prompt_ids] == [len(p) - 1 for p in PROMPTS[rank]]
        assert [p.tolist() for p in prompt_ids] == [w[:len(p) - 1].tolist() for p, w in zip(PROMPTS[rank], want)]
        assert [g.tolist() for g in got] == [w[len(p) - 1:].tolist() for p, w in zip(PROMPTS[rank], want)]
        # 2 samples a prompt, after the greedy call: the same prompt ids again, rank 0's first page cached
        assert r["prefix_cached"] == (8 if rank == 0 else 0)
        assert [s.tolist() for s in r["sampled_prompt_experts"]] == [p.tolist() for p in prompt_ids for _ in range(2)]


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_samples_as_ep1(runs, arch):
    for rank in (0, 1):
        assert runs[rank][(2, arch)]["sampled"] == runs[rank][(1, arch)]["sampled"]

