"""Decode CUDA graphs at expert parallelism across DP: the graph path == the eager path, bit for bit.

A tiny random fp32 Qwen3-MoE (4 experts, top-2; megarl/models/tiny.py) runs in 2 processes at EP2
across DP2 (TP1: each rank holds 2 experts and its own requests; every MoE layer all-gathers the
group's rows). Rank 0 generates 3 prompts (6 samples, more than ``max_batch`` 5: refills and mixed
steps), rank 1 one short prompt: their decode buckets differ (4 or 5 rows against 1 or 2), and
rank 1 runs out of work first and serves rank 0's rows until rank 0 is done. The same requests go
through an engine without graphs (the eager reference) and one with the decode and prefill graphs'
buffers run uncaptured (``capture=False``, as on CPU), where every step opens with the EP group's
agreement on the host:

- greedy and sampled (temperature 0.8, top-k 3) tokens and log-probs equal the eager engine's
  exactly on both ranks (the padded rows of a bucket are routed to no expert and touch no real row);
- decode steps replayed graphs (``rollout/graph_steps`` > 0), and were launched ahead of the last
  step's read-back (``rollout/planned_ahead_steps`` > 0): run-ahead keeps working at EP;
- the graph replays, idle ones included, are the same buckets in the same order on both ranks (the
  lockstep that lets ranks capture together), and rank 1 replayed buckets larger than any batch of
  its own (the group's bucket, its padding and its idle steps);
- the rows routed to experts (id < num_experts in every ``fused_moe_local`` call) are as many as
  eagerly: a bucket's padding and an idle rank's graph cost no expert work.

Not covered: graph capture itself and NCCL inside it (no GPU here), TP > 1 with EP, pipeline stages.
"""
import pytest

from dist_helpers import spawn

PROMPTS = {0: [[7, 8, 9, 10, 11, 12], list(range(20, 33)), [44, 45, 46, 47]], 1: [[40, 41, 42]]}
MAX_NEW = {0: 9, 1: 5}
MAX_BATCH = 5  # decode buckets 1, 2, 4, 5


def _engine(actor, groups, graphs: bool):
    from megarl.rollout.graphs import DecodeGraphs
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.prefill_graphs import PrefillGraphs

    options = EngineOptions(max_batch=MAX_BATCH, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.002)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    if graphs:  # the graph path's buffers and agreement, uncaptured
        engine.graphs = DecodeGraphs(engine, MAX_BATCH, capture=False)
        engine.prefill_graphs = PrefillGraphs(engine, engine.graphs, capture=False)
    return engine


def _watch(engine, expert_rows: list) -> list:
    """Records the buckets of the engine's graph replays (idle ones too); counts routed rows."""
    replays, graphs = [], engine.graphs
    replay = graphs._replay

    def counted(b, captured):
        if captured:
            replays.append(b)
        return replay(b, captured)

    graphs._replay = counted
    return replays


def _job(rank, ckpt):
    from megarl.distributed import init_distributed
    from megarl.rollout import moe_step
    from megarl.rollout.engine import SamplingParams, sample_requests
    from test_rollout_moe import _actor

    init_distributed()
    routed = []
    fused = moe_step.fused_moe_local

    def counting(rows, w13, w2, weights, ids, first):
        routed.append(int((ids < 4).sum()))  # 4 experts: id 4 is "no expert"
        return fused(rows, w13, w2, weights, ids, first)

    moe_step.fused_moe_local = counting
    actor, groups = _actor(ckpt, 2)
    assert groups.ep_size == 2 and groups.tp_size == 1
    prompts = PROMPTS[rank]
    calls = [(sample_requests(prompts, 1, 0, MAX_NEW[rank]), SamplingParams(temperature=0.0)),
             (sample_requests(prompts, 2, 100, MAX_NEW[rank]), SamplingParams(temperature=0.8, top_k=3))]
    out = {}
    for name in ("eager", "graphs"):
        engine = _engine(actor, groups, graphs=name == "graphs")
        replays = _watch(engine, routed) if name == "graphs" else None
        routed.clear()
        results, stats = [], []
        for requests, params in calls:
            results.append([(r.response_ids, r.logprobs) for r in engine.generate(requests, params)])
            stats.append(dict(engine.stats))
        out[name] = {"results": results, "stats": stats, "routed": sum(routed), "replays": replays}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("ep_graphs") / "qwen3moe")
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=40)
    return spawn(_job, 2, path)


def test_graph_path_equals_eager_bitwise(runs):
    for rank in (0, 1):
        eager, graphs = runs[rank]["eager"]["results"], runs[rank]["graphs"]["results"]
        assert graphs == eager  # tokens and log-probs, greedy and sampled, exactly
        assert [len(r) for r in eager] == [len(PROMPTS[rank]), 2 * len(PROMPTS[rank])]
        assert all(len(ids) == MAX_NEW[rank] for call in eager for ids, _ in call)


def test_decode_steps_replay_graphs_and_run_ahead(runs):
    for rank in (0, 1):
        for stats in runs[rank]["graphs"]["stats"]:
            assert stats["rollout/graph_steps"] > 0
            assert stats["rollout/graph_steps"] <= stats["rollout/decode_steps"]
            assert stats["rollout/planned_ahead_steps"] > 0
            assert stats["rollout/prefill_graph_steps"] == 0  # prefills at EP run uncaptured
        for stats in runs[rank]["eager"]["stats"]:
            assert stats["rollout/graph_steps"] == 0


def test_ranks_replay_the_same_buckets(runs):
    zero, one = runs[0]["graphs"]["replays"], runs[1]["graphs"]["replays"]
    assert zero == one and len(zero) > 0
    assert max(one) > 2  # rank 1's own batches (1 or 2 sequences) fit bucket 2: it replayed the group's


def test_padding_routes_to_no_expert(runs):
    for rank in (0, 1):
        assert runs[rank]["graphs"]["routed"] == runs[rank]["eager"]["routed"] > 0
