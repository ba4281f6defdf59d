"""The native engine generates with mixtures of experts under tensor parallelism.

Tiny random fp32 Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints (4 experts, top-2, megarl/models/tiny.py,
the ones tests/test_rollout_moe.py builds) are loaded into the actor at
- tp2 (2 processes): attention over TP2; every expert on both ranks, its FFN split over expert-TP 2
  (= the TP group), the routed and shared experts' partial sums all-reduced once over TP;
- tp2ep2etp1 (2 processes): 2 whole experts a rank, the EP group = the TP group: both ranks hold the
  same rows, so no rows are exchanged: each adds its experts' share, routed + shared all-reduced over TP;
- tp2ep2 (4 processes, Qwen3-MoE and Qwen2-MoE): TP groups {0, 1}, {2, 3} (the DP ranks), EP groups
  {0, 2}, {1, 3}, expert-TP groups = the TP groups: rows gathered over EP, partials summed over EP, then
  over TP (with the shared expert's TP partial, one all-reduce). DP rank 1 gets shorter prompts than
  DP rank 0, so ranks 2 and 3 run out of work first and serve ranks 0 and 1's rows with their experts
  (idle steps, EP collectives only) while 0 and 1 keep their TP collectives;
- tp2ep4etp1 (4 processes, Qwen3-MoE): one expert a rank, the EP group all four ranks, which hold two
  row sets: slots 1 and 3 are TP copies of slots 0 and 2, routed nowhere.
Each DP rank generates its prompts; greedy responses must equal ``transformers`` ``generate`` on each
prompt alone, token for token; sampled responses' engine log-probs must equal the actor's training
forward (eval mode: megatron-core trains MoE under TP only with sequence parallelism) over the same tokens
(fp32, 1e-5); the expert ids the engine records (R3) must equal those ``transformers``' router picks and
those the TP1 engine recorded for the same prompts (tp1, 2 processes, DP2), and the sampled tokens equal TP1's.
Each layout's groups (megatron-core's tp / ep / etp ranks) and each rank's EP slot are checked exactly.
And in bf16 at TP2, megatron-core's GroupedMLP (the CUDA bf16 experts module; torch._grouped_mm runs on
CPU too) against the per-expert module: log-probs == training up to bf16 rounding, the same samples.
Not covered: CUDA graphs, pipeline parallelism with TP, transformer-engine's TEGroupedMLP.
"""
import pytest
import torch

from dist_helpers import spawn
from test_rollout_moe import ARCHS, MAX_NEW, PROMPTS, hf_experts

CASES = [(name, arch) for name in ("tp2", "tp2ep2etp1") for arch in ARCHS]  # 2 processes
CASES += [("tp2ep2", "Qwen3MoeForCausalLM"), ("tp2ep2", "Qwen2MoeForCausalLM"), ("tp2ep4etp1", "Qwen3MoeForCausalLM")]
LAYOUTS = {"tp1": (1, 1, None), "tp2": (2, 1, None), "tp2ep2etp1": (2, 2, 1),  # (tp, ep, etp)
           "tp2ep2": (2, 2, None), "tp2ep4etp1": (2, 4, 1)}


def _actor(ckpt, tp, ep, etp, settings=None, optimizer_steps=1):
    """(actor, groups) at TP x EP (x ETP); with ``settings(cfg)`` (more config set before the build) also cfg."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.roles.build import build_actor

    groups = build_parallel_groups(tp=tp, pp=1, ep=ep, etp=etp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.etp = tp, ep, etp
    if settings is None:
        return build_actor(cfg, groups, optimizer_steps=optimizer_steps), groups
    settings(cfg)
    return build_actor(cfg, groups, optimizer_steps=optimizer_steps), groups, cfg


def _job(rank, ckpts, cases):
    import torch.distributed as dist

    from megarl.distributed import init_distributed
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    init_distributed()
    out = {}
    for name, arch in cases:
        actor, groups = _actor(ckpts[arch], *LAYOUTS[name])
        options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001,
                                record_experts=True)
        engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
        dp = groups.dp_rank
        prompts = PROMPTS[dp]
        greedy = engine.generate(sample_requests(prompts, 1, 0, MAX_NEW[dp]), SamplingParams(temperature=0.0))
        sampled = engine.generate(sample_requests(prompts, 2, 100, MAX_NEW[dp]), SamplingParams(temperature=0.8))
        batch = to_sample_batch(sampled, 0, "cpu")
        train = actor.logprobs(batch, micro_batch_size=4, temperature=0.8)["logprobs"]
        diff = ((train - batch.rollout_logprobs).abs() * batch.response_mask).max()
        ranks = [dist.get_process_group_ranks(g) for g in (groups.tp, groups.ep, groups.etp)]
        out[(name, arch)] = {"dp": dp, "groups": ranks, "slot": getattr(engine.stage.ep, "slot", None),
                             "greedy": [r.response_ids for r in greedy], "diff": float(diff),
                             "sampled": [r.response_ids for r in sampled],
                             "experts": [r.expert_ids.tolist() for r in greedy],
                             "prompt_experts": [r.prompt_expert_ids.tolist() for r in greedy]}
    if dist.get_world_size() == 2:
        out["etp_over_dp"] = _etp_across_dp_error()
    return out


def _etp_across_dp_error() -> str:
    """moe_sums' error at TP1 x ETP2: the expert-tensor ranks are DP peers holding different rows."""
    from megarl.distributed import build_parallel_groups
    from megarl.rollout.moe_step import moe_sums

    try:
        moe_sums(build_parallel_groups(tp=1, ep=1, etp=2))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf_moe_rollout_tp")
    dirs, want, routed = {}, {}, {}
    for i, arch in enumerate(ARCHS):
        dirs[arch] = str(root / arch)
        model = make_tiny_checkpoint(dirs[arch], arch, seed=40 + i)
        with torch.no_grad():
            want[arch] = {dp: [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW[dp], do_sample=False,
                                              pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                               for p in prompts] for dp, prompts in PROMPTS.items()}
            routed[arch] = {dp: [hf_experts(model, p, r).tolist() for p, r in zip(PROMPTS[dp], want[arch][dp])]
                            for dp in PROMPTS}
    return dirs, want, routed


@pytest.fixture(scope="module")
def runs(ckpts):
    """(layout, arch) -> per rank results."""
    two = spawn(_job, 2, ckpts[0], [(name, arch) for name in ("tp1", "tp2", "tp2ep2etp1") for arch in ARCHS])
    four = spawn(_job, 4, ckpts[0], CASES[-3:])
    return {key: [r[key] for r in ranks] for ranks in (two, four) for key in ranks[0]}


def test_etp_across_dp_is_refused(runs):
    """The engine refuses expert-TP ranks outside one TP group (check_moe_rollout says so first)."""
    assert runs["etp_over_dp"] == ["the rollout engine splits experts over expert-tensor ranks [0, 1], which must "
                                   "lie in the TP group [r]: parallel.etp=2 must divide parallel.tp=1"
                                   .replace("[r]", f"[{r}]") for r in (0, 1)]




# megatron-core's groups (tp, ep, etp ranks) and the EP slot whose copy of the rows is routed, by rank
GROUPS = {
    "tp2": [([0, 1], [0], [0, 1], None), ([0, 1], [1], [0, 1], None)],
    "tp2ep2etp1": [([0, 1], [0, 1], [0], None), ([0, 1], [0, 1], [1], None)],  # EP inside TP: no EpStep
    "tp2ep2": [([0, 1], [0, 2], [0, 1], 0), ([0, 1], [1, 3], [0, 1], 0),
               ([2, 3], [0, 2], [2, 3], 1), ([2, 3], [1, 3], [2, 3], 1)],
    "tp2ep4etp1": [([0, 1], [0, 1, 2, 3], [0], 0), ([0, 1], [0, 1, 2, 3], [1], 0),
                   ([2, 3], [0, 1, 2, 3], [2], 2), ([2, 3], [0, 1, 2, 3], [3], 2)],
}


@pytest.mark.parametrize("layout", list(GROUPS))
def test_group_layout(runs, layout):
    """ETP = TP: the expert-tensor group is the TP group; an EP group's TP peers share one slot."""
    got = [(*r["groups"], r["slot"]) for r in runs[(layout, "Qwen3MoeForCausalLM")]]
    assert got == [tuple(g) for g in GROUPS[layout]]


def _tp1(runs, arch, dp):
    return next(r for r in runs[("tp1", arch)] if r["dp"] == dp)


@pytest.mark.parametrize("layout, arch", CASES)
def test_greedy_matches_transformers(runs, ckpts, layout, arch):
    for r in runs[(layout, arch)]:
        assert r["greedy"] == ckpts[1][arch][r["dp"]]


@pytest.mark.parametrize("layout, arch", CASES)
def test_rollout_logprobs_match_training(runs, layout, arch):
    for r in runs[(layout, arch)]:
        assert r["diff"] <= 1e-5


@pytest.mark.parametrize("layout, arch", CASES)
def test_recorded_experts_match_tp1_and_transformers(runs, ckpts, layout, arch):
    for r in runs[(layout, arch)]:
        tp1, prompts = _tp1(runs, arch, r["dp"]), PROMPTS[r["dp"]]
        assert r["experts"] == tp1["experts"] and r["prompt_experts"] == tp1["prompt_experts"]
        want = ckpts[2][arch][r["dp"]]  # (P + R - 1, layers, k) a prompt
        assert r["prompt_experts"] == [w[:len(p) - 1] for p, w in zip(prompts, want)]
        assert r["experts"] == [w[len(p) - 1:] for p, w in zip(prompts, want)]


@pytest.mark.parametrize("layout, arch", CASES)
def test_samples_as_tp1(runs, layout, arch):
    for r in runs[(layout, arch)]:
        assert r["sampled"] == _tp1(runs, arch, r["dp"])["sampled"]


# ---------------------------------------------------------------- GroupedMLP (the CUDA bf16 experts) at TP2
def _grouped_job(rank, ckpt):
    """bf16 at TP2 (expert-TP 2): per experts module, the engine's sampled tokens and the largest gap between
    its log-probs and the training forward's."""
    import dataclasses

    import megarl.roles.build as build
    from megarl.distributed import init_distributed
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    init_distributed()
    plain, out = build.model_options, {}
    for kind in ("sequential", "grouped"):  # no config key picks the module: the builder's options are patched
        build.model_options = lambda *a, **k: dataclasses.replace(plain(*a, **k), params_dtype="bf16",
                                                                  moe_experts=kind)
        actor, groups = _actor(ckpt, 2, 1, None)
        engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0,
                              EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001))
        sampled = engine.generate(sample_requests(PROMPTS[0], 2, 100, MAX_NEW[0]), SamplingParams(temperature=0.8))
        batch = to_sample_batch(sampled, 0, "cpu")
        train = actor.logprobs(batch, micro_batch_size=4, temperature=0.8)["logprobs"].float()
        gap = ((train - batch.rollout_logprobs.float()).abs() * batch.response_mask).max()
        out[kind] = {"module": type(actor.module.decoder.layers[0].mlp.experts).__name__, "gap": float(gap),
                     "sampled": [r.response_ids for r in sampled]}
    return out


def test_grouped_experts_at_tp2(ckpts):
    """megatron-core's GroupedMLP (weight1 / weight2, read as (E, 2F/etp, h) / (E, h, F/etp) views) at TP2 in
    bf16, Qwen2-MoE: the engine's log-probs equal the training forward's up to bf16 rounding (the per-expert
    module shows the same ~0.02; a gate / up or shard mix-up moves them by O(1)), and it samples the same
    tokens as the engine over the per-expert module."""
    for r in spawn(_grouped_job, 2, ckpts[0]["Qwen2MoeForCausalLM"]):
        assert [r[k]["module"] for k in ("sequential", "grouped")] == ["SequentialMLP", "GroupedMLP"]
        assert r["grouped"]["gap"] <= 0.06 and r["sequential"]["gap"] <= 0.06
        assert r["grouped"]["sampled"] == r["sequential"]["sampled"]
