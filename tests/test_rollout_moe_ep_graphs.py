"""Decode CUDA graphs at expert parallelism across DP: the graph path == the eager path.

A tiny random fp32 Qwen3-MoE (4 experts, top-2; megarl/models/tiny.py) runs in 2 processes at EP2
across DP2 (TP1: each rank holds 2 experts and its own requests; every MoE layer all-gathers the
group's rows), and in 4 at TP2 x EP4 x ETP1 (one expert a rank; the EP group holds both TP groups,
whose second ranks' copies of the rows are routed nowhere: `EpStep.slot`). DP rank 0 generates 3
prompts (6 samples, more than ``max_batch`` 5: refills and mixed steps), DP rank 1 one short prompt:
their decode buckets differ (4 or 5 rows against 1 or 2), and rank 1 runs out of work first and
serves rank 0's rows until rank 0 is done. The same requests go through an engine without graphs
(the eager reference) and one with the decode and prefill graphs' buffers run uncaptured
(``capture=False``, as on CPU), where every step opens with the EP group's agreement on the host:

- greedy and sampled (temperature 0.8, top-k 3) tokens equal the eager engine's exactly on every
  rank, and their log-probs to 1e-5. Not bit for bit: on CPU a row's GEMM result depends on the
  batch's row count (``F.linear`` of 1 or 2 rows differs by ~1e-6 from the same rows among more),
  and a graph pads its batch to a bucket — the dense graph path at EP1 differs from eager by as much;
- decode steps replayed graphs (``rollout/graph_steps`` > 0), but DP rank 1's not all: those while
  rank 0 prefilled ran eagerly, as agreed; decodes and refills (mixed ones too, fed the pending
  tokens on the device) were launched ahead of the last step's read-back (``planned_ahead_*`` > 0):
  run-ahead keeps working at EP;
- the graph replays, idle ones included, are the same buckets in the same order on every rank (the
  lockstep that lets ranks capture together), and DP rank 1 replayed buckets larger than any batch
  of its own (the group's bucket, its padding and its idle steps);
- the rows routed to experts (id < num_experts in every ``fused_moe_local`` call) are as many as
  eagerly: a bucket's padding and an idle rank's graph cost no expert work;
- with ``record_experts`` the graphs' buffers record the same expert ids as the eager engine.

The exchange alone, bit for bit (`_exchange_job`): random rows and expert weights on 2 ranks; one
MoE layer's routed output of each rank's real rows is the same whether the group agreed on its real
row count (eager) or on padded buckets (a graph step: pad rows of large values, not real), and
whether a rank that is done runs an idle layer or a bucket of padding only; a forward of more rows
than agreed is refused.

Graph capture itself with NCCL inside it: `test_captured_graphs_over_nccl_equal_eager` (two GPUs, marked
gpu; not run yet). Other layouts (pipeline stages, ETP2 across DP): tests/test_rollout_moe_ep_layouts.py.
"""
import pytest

from dist_helpers import spawn

PROMPTS = {0: [[7, 8, 9, 10, 11, 12], list(range(20, 33)), [44, 45, 46, 47]], 1: [[40, 41, 42]]}
MAX_NEW = {0: 9, 1: 5}
MAX_BATCH = 5  # decode buckets 1, 2, 4, 5
LAYOUTS = {"ep2": (1, 2, 1), "tp2ep4etp1": (2, 4, 1)}  # (tp, ep, etp): processes = 2 tp (DP2)


def _engine(actor, groups, graphs: bool, record: bool = False, capture: bool = False):
    from megarl.rollout.graphs import DecodeGraphs
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.prefill_graphs import PrefillGraphs

    options = EngineOptions(max_batch=MAX_BATCH, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.002,
                            record_experts=record)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    if graphs:  # the graph path's buffers and agreement, captured only on CUDA (``capture``)
        engine.graphs = DecodeGraphs(engine, MAX_BATCH, capture=capture)
        engine.prefill_graphs = PrefillGraphs(engine, engine.graphs, capture=False)
    return engine


def _watch(engine) -> list:
    """The buckets of the engine's graph replays (idle ones too), as they run."""
    replays, graphs = [], engine.graphs
    replay = graphs._replay

    def counted(b, captured):
        if captured:
            replays.append(b)
        return replay(b, captured)

    graphs._replay = counted
    return replays


def _job(rank, ckpt, layout, capture=False):
    from megarl.distributed import init_distributed
    from megarl.rollout import moe_step
    from megarl.rollout.engine import SamplingParams, sample_requests
    from test_rollout_moe_tp import _actor

    init_distributed()
    routed = []
    fused = moe_step.fused_moe_local

    def counting(rows, w13, w2, weights, ids, first):
        routed.append(int((ids < 4).sum()))  # 4 experts: id 4 is "no expert"
        return fused(rows, w13, w2, weights, ids, first)

    if not capture:  # a captured graph cannot read a count back mid-capture, and replays run no Python
        moe_step.fused_moe_local = counting
    actor, groups = _actor(ckpt, *LAYOUTS[layout])
    assert groups.dp_size == 2
    dp = groups.dp_rank
    calls = [(sample_requests(PROMPTS[dp], 1, 0, MAX_NEW[dp]), SamplingParams(temperature=0.0)),
             (sample_requests(PROMPTS[dp], 2, 100, MAX_NEW[dp]), SamplingParams(temperature=0.8, top_k=3))]
    out = {"dp": dp}
    for name in ("eager", "graphs"):
        engine = _engine(actor, groups, graphs=name == "graphs", capture=capture)
        replays = _watch(engine) if name == "graphs" else None
        routed.clear()
        out["slot"] = engine.stage.ep.slot
        results, stats = [], []
        for requests, params in calls:
            results.append([(r.response_ids, r.logprobs) for r in engine.generate(requests, params)])
            stats.append(dict(engine.stats))
        out[name] = {"results": results, "stats": stats, "routed": sum(routed), "replays": replays}
        recorded = _engine(actor, groups, graphs=name == "graphs", record=True, capture=capture).generate(*calls[1])
        out[name]["recorded"] = [(r.response_ids, r.expert_ids.tolist(), r.prompt_expert_ids.tolist())
                                 for r in recorded]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """layout -> per rank results."""
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("ep_graphs") / "qwen3moe")
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=40)
    return {layout: spawn(_job, LAYOUTS[layout][0] * 2, path, layout) for layout in LAYOUTS}


def _assert_same_tokens(r: dict, logprob_tol: float) -> None:
    """One rank's graph-path tokens == its eager tokens in every call, log-probs within ``logprob_tol``."""
    eager, graphs = r["eager"]["results"], r["graphs"]["results"]
    assert [[ids for ids, _ in call] for call in graphs] == [[ids for ids, _ in call] for call in eager]
    assert max(abs(a - b) for ce, cg in zip(eager, graphs) for (_, le), (_, lg) in zip(ce, cg)
               for a, b in zip(le, lg)) <= logprob_tol


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_path_equals_eager(runs, layout):
    for r in runs[layout]:
        rank = r["dp"]
        eager = r["eager"]["results"]
        _assert_same_tokens(r, logprob_tol=1e-5)
        assert [len(r) for r in eager] == [len(PROMPTS[rank]), 2 * len(PROMPTS[rank])]
        assert all(len(ids) == MAX_NEW[rank] for call in eager for ids, _ in call)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_steps_replay_graphs_and_run_ahead(runs, layout):
    for r in runs[layout]:
        for stats in r["graphs"]["stats"]:
            assert stats["rollout/graph_steps"] > 0
            assert stats["rollout/graph_steps"] <= stats["rollout/decode_steps"]
            assert stats["rollout/planned_ahead_steps"] > 0
            assert stats["rollout/prefill_graph_steps"] == 0  # prefills at EP run uncaptured
        if r["dp"] == 0:  # refills (mixed ones too) launched ahead of a pending decode, uncaptured
            assert all(st["rollout/planned_ahead_prefills"] > 0 for st in r["graphs"]["stats"])
            assert r["graphs"]["stats"][1]["rollout/mixed_steps"] > 0
        else:  # its decodes while DP rank 0 prefilled ran eagerly, the rest replayed
            assert all(0 < st["rollout/graph_steps"] < st["rollout/decode_steps"] for st in r["graphs"]["stats"])
        for stats in r["eager"]["stats"]:
            assert stats["rollout/graph_steps"] == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_replay_the_same_buckets(runs, layout):
    replays = [r["graphs"]["replays"] for r in runs[layout]]
    assert all(one == replays[0] for one in replays) and len(replays[0]) > 0
    assert max(replays[0]) > 2  # DP rank 1's own batches (1 or 2 sequences) fit bucket 2: it replayed the group's


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_buffers_record_the_eager_experts(runs, layout):
    """``rollout.record_experts`` through the graphs' buffers at EP: the same tokens, response and prompt
    expert ids as eagerly."""
    for r in runs[layout]:
        assert r["graphs"]["recorded"] == r["eager"]["recorded"]
        assert len(r["eager"]["recorded"]) == 2 * len(PROMPTS[r["dp"]])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padding_routes_to_no_expert(runs, layout):
    for r in runs[layout]:
        assert r["graphs"]["routed"] == r["eager"]["routed"] > 0


def test_tp_peers_share_a_slot(runs):
    """TP2 x EP4: slots 1 and 3 are TP copies of slots 0 and 2 (routed nowhere, read from their peer's)."""
    assert [r["slot"] for r in runs["ep2"]] == [0, 1]
    assert [r["slot"] for r in runs["tp2ep4etp1"]] == [0, 0, 2, 2]


def _exchange_job(rank):
    import torch
    import torch.distributed as dist

    from megarl.distributed import init_distributed
    from megarl.rollout.moe_step import EpStep, MoeWeights, idle_layer, moe_mlp

    init_distributed()
    gen = torch.Generator().manual_seed(5)  # the same draws on both ranks, then each takes its part
    h, f, experts, real = 16, 8, 4, (3, 1)
    router, w13, w2 = (torch.randn(*shape, generator=gen) for shape in ((experts, h), (experts, 2 * f, h),
                                                                         (experts, h, f)))
    rows = [torch.randn(t, h, generator=gen) for t in real]
    mw = MoeWeights(router, w13[2 * rank:2 * rank + 2], w2[2 * rank:2 * rank + 2], 2 * rank, 2, False,
                    None, None, None)
    ep = EpStep(dist.group.WORLD, 2, rank, experts)

    def layer(x, bucket, graph_ok):  # one MoE layer's routed output of this rank's first len(x) rows
        shape = ep.agree(bucket, graph_ok)
        padded = torch.cat([x, torch.full((bucket - len(x), h), 1e4)])  # pads: large, marked not real
        ep.start(bucket)
        return shape, moe_mlp(padded, mw, ep, real=torch.arange(bucket) < len(x))[:len(x)]

    x = rows[rank]
    eager_shape, eager = layer(x, len(x), False)
    graph_shape, graph = layer(x, (4, 2)[rank], True)
    if rank == 0:  # rank 1 done: an idle layer of the agreed rows, or a graph bucket of padding only
        _, with_idle = layer(x, len(x), False)
        _, with_idle_graph = layer(x, 4, True)
    else:
        ep.agree(0)
        idle_layer(mw, ep, h, torch.float32, torch.device("cpu"))
        with_idle = with_idle_graph = None
        layer(torch.zeros(0, h), 4, True)
    try:
        ep.agree(2)
        ep.start(3)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"eager": eager, "graph": graph, "shapes": (eager_shape, graph_shape), "with_idle": with_idle,
            "with_idle_graph": with_idle_graph, "refused": refused}


def test_exchange_padding_leaves_real_rows_bitwise():
    from megarl.rollout.moe_step import StepShape

    runs = spawn(_exchange_job, 2)
    for r in runs:
        assert r["shapes"] == (StepShape(3, False), StepShape(4, True))
        assert torch_equal(r["graph"], r["eager"])
        assert r["refused"].startswith("an EP step of 3 rows, but the group agreed on 2")
    assert runs[0]["eager"].abs().sum() > 0
    assert torch_equal(runs[0]["with_idle"], runs[0]["with_idle_graph"])


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.gpu
def test_captured_graphs_over_nccl_equal_eager(tmp_path):
    """Two GPUs: the decode graphs captured for real at EP2 across DP2, NCCL's all-gather inside them.
    Tokens equal the eager engine's on both ranks (fp32; log-probs to 1e-4: cuBLAS picks kernels by
    row count), both ranks replay the same buckets, and the captured buffers record the eager experts.
    Not run yet: no machine with two GPUs has been lent (benchmarks/RESULTS.md, "Not measured yet")."""
    import torch

    from megarl.models.tiny import make_tiny_checkpoint

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (EP2 across DP2 over NCCL)")
    path = str(tmp_path / "qwen3moe")
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=40)
    runs = spawn(_job, 2, path, "ep2", True)
    replays = [r["graphs"]["replays"] for r in runs]
    assert replays[0] == replays[1] and max(replays[0]) > 2
    for r in runs:
        _assert_same_tokens(r, logprob_tol=1e-4)
        assert all(st["rollout/graph_steps"] > 0 for st in r["graphs"]["stats"])
        assert r["graphs"]["recorded"] == r["eager"]["recorded"]
