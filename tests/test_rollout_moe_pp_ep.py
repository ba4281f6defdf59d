"""Rollout at pipeline x expert parallelism across DP: PP2 x EP2 on 4 processes == PP1 x EP1.

A tiny random fp32 Qwen3-MoE (4 experts, top-2, 2 layers: one a stage). At PP2 x EP2 (DP2) each
pipeline stage's MoE layer exchanges its rows with the same stage of the other DP rank (EP across DP),
the two DP ranks with different prompts and lengths (one goes idle first and serves the other's
rows), every step agreed by the stage's EP group; eagerly and through the decode and prefill
graphs' buffers (uncaptured, as on CPU; each stage replays between receiving and sending hidden
states). The same requests at PP1 x EP1 (DP4, no exchange) give the reference: sampled tokens equal,
log-probs within 1e-5 (a row's GEMM result depends on its batch's row count on CPU).
Not covered: capture on a GPU.
"""
import pytest

from dist_helpers import spawn

PROMPTS = {0: [[7, 8, 9, 10, 11, 12], list(range(20, 33)), [44, 45, 46, 47]], 1: [[40, 41, 42]]}
MAX_NEW = {0: 9, 1: 5}


def _job(rank, ckpt):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from test_rollout_moe_ep_graphs import _engine

    init_distributed()
    out, dp = {}, None
    for layout, (pp, ep) in {"pp2ep2": (2, 2), "pp1ep1": (1, 1)}.items():
        groups = build_parallel_groups(tp=1, pp=pp, ep=ep, etp=1 if ep > 1 else None)
        model_parallel_cuda_manual_seed(0)
        cfg = Config()
        cfg.model.path = ckpt
        cfg.parallel.pp, cfg.parallel.ep = pp, ep
        actor = build_actor(cfg, groups, optimizer_steps=1)
        dp = groups.dp_rank if dp is None else dp  # the PP2 x EP2 run's DP rank picks a process's prompts
        requests = sample_requests(PROMPTS[dp], 2, 100, MAX_NEW[dp])
        paths = ("eager", "graphs") if pp > 1 else ("eager",)
        for path in paths:
            engine = _engine(actor, groups, graphs=path == "graphs")
            results = engine.generate(requests, SamplingParams(temperature=0.8, top_k=3))
            out[(layout, path)] = ([r.response_ids for r in results], [r.logprobs for r in results],
                                   engine.stats["rollout/graph_steps"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("pp_ep") / "qwen3moe")
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=40)
    return spawn(_job, 4, path)


@pytest.mark.parametrize("path", ["eager", "graphs"])
def test_pp2_ep2_samples_as_pp1_ep1(runs, path):
    for out in runs:
        ids, logprobs, graph_steps = out[("pp2ep2", path)]
        want_ids, want_logprobs, _ = out[("pp1ep1", "eager")]
        assert ids == want_ids
        for got, want in zip(logprobs, want_logprobs):
            assert got == pytest.approx(want, abs=1e-5)
        assert (graph_steps > 0) == (path == "graphs")
