"""Rollout with expert parallelism across DP in more layouts, each == the same requests without EP.

A tiny random fp32 Qwen3-MoE (4 experts, top-2, 2 layers) on 4 processes, DP2 in each EP layout:

- PP2 x EP2: each pipeline stage's MoE layer exchanges its rows with the same stage of the other DP
  rank, every step agreed by the stage's EP group; reference PP1 x EP1 (DP4);
- TP2 x EP2 x ETP2: each expert's FFN split over the TP group, the experts over the two TP groups
  (EP across DP: rows exchanged between the DP ranks, partial sums all-reduced over ETP); reference
  TP2 x EP1.

The two DP ranks have different prompts and lengths (one goes idle first and serves the other's
rows). Each layout runs eagerly and through the decode and prefill graphs' buffers (uncaptured, as on
CPU): sampled tokens equal the reference's, log-probs within 1e-5 (on CPU a row's GEMM result depends
on its batch's row count). Not covered: capture on a GPU.
"""
import pytest

from dist_helpers import spawn

PROMPTS = {0: [[7, 8, 9, 10, 11, 12], list(range(20, 33)), [44, 45, 46, 47]], 1: [[40, 41, 42]]}
MAX_NEW = {0: 9, 1: 5}
# case -> (tp, pp, ep, etp) of the EP layout, then of its reference
CASES = {"pp2_ep2": ((1, 2, 2, 1), (1, 1, 1, None)), "tp2_ep2_etp2": ((2, 1, 2, 2), (2, 1, 1, None))}


def _job(rank, ckpt, case):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from test_rollout_moe_ep_graphs import _engine

    init_distributed()
    out, dp = {}, None
    for name, (tp, pp, ep, etp) in zip(("ep", "reference"), CASES[case]):
        groups = build_parallel_groups(tp=tp, pp=pp, ep=ep, etp=etp)
        model_parallel_cuda_manual_seed(0)
        cfg = Config()
        cfg.model.path = ckpt
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.etp = tp, pp, ep, etp
        actor = build_actor(cfg, groups, optimizer_steps=1)
        dp = groups.dp_rank if dp is None else dp  # the EP layout's DP rank picks a process's prompts
        requests = sample_requests(PROMPTS[dp], 2, 100, MAX_NEW[dp])
        for path in ("eager", "graphs") if name == "ep" else ("eager",):
            engine = _engine(actor, groups, graphs=path == "graphs")
            assert (engine.stage.ep is not None) == (name == "ep")  # EP across DP: rows exchanged
            results = engine.generate(requests, SamplingParams(temperature=0.8, top_k=3))
            out[(name, path)] = ([r.response_ids for r in results], [r.logprobs for r in results],
                                 engine.stats["rollout/graph_steps"])
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoints

    return make_tiny_checkpoints(tmp_path_factory.mktemp("ep_layouts"), ["Qwen3MoeForCausalLM"], 40)["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("case", list(CASES))
def test_ep_layout_samples_as_without_ep(ckpt, case):
    for out in spawn(_job, 4, ckpt, case):
        want_ids, want_logprobs, _ = out[("reference", "eager")]
        for path in ("eager", "graphs"):
            ids, logprobs, graph_steps = out[("ep", path)]
            assert ids == want_ids
            for got, want in zip(logprobs, want_logprobs):
                assert got == pytest.approx(want, abs=1e-5)
            assert (graph_steps > 0) == (path == "graphs")
