"""Rollout routing replay's pieces: the replayed top-k and its gradient, the token layout, the batch path.

- megatron-core's ``topk_routing_with_score_function`` with a :class:`LayerReplay`: recorded rows
  take the recorded experts, with gate weights softmax(logits at those experts) (renormalized
  top-k: Mixtral, Qwen3) or softmax(all logits) at those experts (Qwen2-MoE's pre-softmax), and the
  logits' gradient is exactly that expression's; unrecorded rows keep the router's own top-k; the
  agreement counts are the hand count. Full recompute: the backward pass's second forward gets the
  ids its first pass used, whatever micro-batch was loaded since.
- :func:`model_order`: per-position ids in megatron's [s, b] token order (padded rows) and along the
  packed THD row (padding segment and positions past a length unrecorded); under sequence parallelism
  padded rows' extra columns unrecorded and each TP rank's contiguous slice (:func:`sequence_slice`).
- The engine's prompt record: a mixed prefill step's chunk rows (after its decode rows) land at their
  prompt positions but the last, chunk after chunk, in one array the prompt's forks share; a
  sequence prefilled again from position 0 (preempted) gets a fresh one, its siblings keep theirs.
- The batch: engine results -> prompt ids at positions 0 .. P - 2, response ids at P - 1 .. P + R - 2
  (uint8, int16 from 256 experts); rows
  selected, rollouts concatenated (widths differ), dumps written and read back, rows re-dealt over
  2 DP ranks: every row keeps its own ids.
- Config: r3 on a dense model, at TP > 1, with SGLang (it records no experts), a negative probe
  interval: one-line errors; r3 turns
  the engine's recording on (multi-turn, the agent server and partial rollouts pass:
  tests/test_moe_r3_merge.py).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dist_helpers import spawn


def _replay(ids, valid, training=False, replace=True):
    from megarl.models.router_replay import LayerReplay

    owner = SimpleNamespace(ids=ids[:, None], valid=valid, replace=replace)  # one layer
    return LayerReplay(owner, 0, SimpleNamespace(training=training))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_replayed_topk_gate_weights_and_gradient(pre_softmax):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    ids = torch.tensor([[5, 0], [1, 2], [0, 0], [3, 4], [2, 5]])
    valid = torch.tensor([True, True, False, True, True])
    replay = _replay(ids, valid)
    x = logits.clone().requires_grad_(True)
    probs, routing = topk_routing_with_score_function(x, 2, use_pre_softmax=pre_softmax, router_replay=replay)
    own = torch.topk(logits, 2).indices
    chosen = torch.where(valid[:, None], ids, own)
    assert torch.equal(routing, torch.zeros(5, 6, dtype=torch.bool).scatter(1, chosen, True))
    y = logits.clone().requires_grad_(True)
    gate = y.softmax(-1).gather(1, chosen) if pre_softmax else y.gather(1, chosen).softmax(-1)  # (5, 2)
    want = torch.zeros(5, 6, dtype=torch.float64).scatter(1, chosen, gate)
    assert torch.allclose(probs, want, atol=1e-15)
    weights = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    (probs * weights).sum().backward()
    (want * weights).sum().backward()
    assert x.grad.abs().sum() > 0 and torch.allclose(x.grad, y.grad, atol=1e-15)
    agree = sum(int(e in own[t].tolist()) for t in range(5) if valid[t] for e in ids[t].tolist())
    assert (replay.agree.item(), replay.total.item()) == (agree, 8)


def test_observing_counts_without_replaying():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    replay = _replay(torch.tensor([[2, 3]]), torch.tensor([True]), replace=False)
    _, routing = topk_routing_with_score_function(logits, 2, router_replay=replay)
    assert routing.tolist() == [[True, True, False, False]]
    assert (replay.agree.item(), replay.total.item()) == (0, 2)


def test_full_recompute_gets_its_first_pass_ids():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    replay = _replay(torch.tensor([[2, 3]]), torch.tensor([True]), training=True)
    with torch.no_grad():  # a checkpointed layer's first pass
        _, first = topk_routing_with_score_function(logits, 2, router_replay=replay)
    replay.owner.ids = torch.tensor([[[0, 1]]])  # the next micro-batch's ids are loaded meanwhile
    _, again = topk_routing_with_score_function(logits.clone().requires_grad_(True), 2, router_replay=replay)
    assert first.tolist() == again.tolist() == [[False, False, True, True]]
    assert not replay.queue and replay.total.item() == 2  # counted once


def test_model_order_padded_and_packed():
    from megarl.models.router_replay import model_order
    from megarl.roles.inputs import packed_inputs, padded_inputs

    ids = torch.arange(10, dtype=torch.uint8).reshape(2, 5, 1, 1).repeat(1, 1, 1, 2)  # value = 5 * row + pos
    ids[0, 0] = 255  # unrecorded
    lengths = torch.tensor([5, 3])
    input_ids = torch.ones(2, 5, dtype=torch.long)
    got, valid = model_order(ids, lengths, padded_inputs(input_ids, lengths), num_experts=20)
    assert got[:, 0, 0].tolist() == [255, 5, 1, 6, 2, 7, 3, 8, 4, 9]  # [s, b] flattened
    assert valid.tolist() == [False, True, True, True, True, True, True, False, True, False]
    got, valid = model_order(ids, lengths, packed_inputs(input_ids, lengths, pad_multiple=3), num_experts=20)
    assert got.shape[0] == 9 and got[:8, 0, 0].tolist() == [255, 1, 2, 3, 4, 5, 6, 7]
    assert valid.tolist() == [False, True, True, True, True, True, True, True, False]


def test_sequence_parallel_slices():
    """Padded rows of width 5 at TP2 get a 6th column (unrecorded); TP rank r reads the r-th half of the
    [s, b] order, the s-slice megatron-core's embedding hands it: rank 0 columns 0-2, rank 1 columns 3-5."""
    from megarl.models.router_replay import model_order, sequence_slice
    from megarl.roles.inputs import padded_inputs

    ids = torch.arange(10, dtype=torch.uint8).reshape(2, 5, 1, 1).repeat(1, 1, 1, 2)  # value = 5 * row + pos
    lengths = torch.tensor([5, 3])
    inputs = padded_inputs(torch.ones(2, 5, dtype=torch.long), lengths, pad_multiple=2)
    assert inputs.input_ids.shape == (2, 6) and inputs.width == 5 and inputs.padding[:, 5].all()
    got, valid = model_order(ids, lengths, inputs, num_experts=20)
    assert got[:10, 0, 0].tolist() == [0, 5, 1, 6, 2, 7, 3, 8, 4, 9] and got.shape[0] == 12
    assert valid.tolist() == [True, True, True, True, True, True, True, False, True, False, False, False]
    first, first_valid = sequence_slice(got, valid, 2, 0)
    second, second_valid = sequence_slice(got, valid, 2, 1)
    assert first[:, 0, 0].tolist() == [0, 5, 1, 6, 2, 7] and first_valid.all()
    assert second[:4, 0, 0].tolist() == [3, 8, 4, 9] and second_valid.tolist() == [True, False, True] + [False] * 3
    assert inputs.to_rows(torch.arange(12.0).reshape(2, 6)).tolist() == [[0, 0, 1, 2, 3], [0, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="do not split over 4 sequence-parallel ranks"):
        sequence_slice(got[:10], valid[:10], 4, 0)


def _result(prompt, response, ids, prompt_ids=None):
    from megarl.rollout.engine import GenerationResult

    return GenerationResult(prompt, response, [-1.0] * len(response), "stop", 0, expert_ids=ids,
                            prompt_expert_ids=prompt_ids)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_engine_ids_land_on_the_rows_that_routed_them(dtype):
    from megarl.trainer.rollout import to_sample_batch

    gen = np.random.default_rng(0)
    a = gen.integers(0, 200, (4, 3, 2)).astype(dtype)
    b = gen.integers(0, 200, (2, 3, 2)).astype(dtype)
    prompt_a = gen.integers(0, 200, (2, 3, 2)).astype(dtype)  # prompt tokens 0, 1 of [1, 2, 3]
    batch = to_sample_batch([_result([1, 2, 3], [4, 5, 6, 7], a, prompt_a), _result([9], [8, 7], b, b[:0]),
                             _result([5, 6], [7], b[:1])], 0, "cpu")
    mark = 255 if dtype == np.uint8 else -1
    e = batch.expert_ids
    assert e.shape == (3, 7, 3, 2) and e.dtype == (torch.uint8 if dtype == np.uint8 else torch.int16)
    assert np.array_equal(e[0, 0:2].numpy(), prompt_a) and np.array_equal(e[0, 2:6].numpy(), a)
    assert np.array_equal(e[1, 0:2].numpy(), b) and np.array_equal(e[2, 1:2].numpy(), b[:1])
    assert (e[0, 6] == mark).all() and (e[1, 2:] == mark).all() and (e[2, [0, 2]] == mark).all()


def _prefill_plan(seqs, chunks, decoding=0):
    """A prefill StepPlan of ``decoding`` decode rows, then (seq index, start, end) chunks."""
    from megarl.rollout.scheduler import StepPlan

    lens = [1] * decoding + [end - start for _, start, end in chunks]
    positions = np.concatenate([np.full(decoding, 99)] + [np.arange(start, end) for _, start, end in chunks])
    fed = [seqs[0]] * decoding + [seqs[i] for i, _, _ in chunks]
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(False, fed, positions.copy(), positions, positions, np.zeros((len(fed), 1), np.int32),
                    np.array(lens, np.int32), np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), empty, [],
                    empty, empty, decoding=decoding)


def rows(plan):
    """(T, 2 layers, top-2) ids of a step: every id of row r is r."""
    return np.arange(len(plan.positions), dtype=np.uint8)[:, None, None].repeat(2, 1).repeat(2, 2)


def test_prompt_ids_recorded_per_chunk_and_shared_by_forks():
    from megarl.rollout.scheduler import Sequence
    from megarl.rollout.step_experts import StepExperts

    lead, fork, other = (Sequence(i, i, list(range(10 * i, 10 * i + n)), 0, 4) for i, n in ((0, 6), (1, 6), (2, 3)))
    lead.forks = [fork]

    first = _prefill_plan([other, lead], [(1, 0, 4)], decoding=2)  # 2 decode rows of `other`, lead's 0..3
    experts = StepExperts(first)  # when the step runs: its forks now
    lead.forks = []  # the step advanced before its ids were read (launched ahead): the forks decode now
    experts.record(rows(first))
    lead.forks = [fork]
    assert fork.prompt_experts is lead.prompt_experts and lead.prompt_experts.shape == (5, 2, 2)
    assert lead.prompt_experts[:, 0, 0].tolist() == [2, 3, 4, 5, 255]
    rest = _prefill_plan([lead, other], [(0, 4, 6), (1, 0, 3)])  # lead's 4, 5 (5: the last, not kept); other's
    StepExperts(rest).record(rows(rest))
    assert lead.prompt_experts[:, 0, 0].tolist() == [2, 3, 4, 5, 0]
    assert other.prompt_experts[:, 1, 1].tolist() == [2, 3]
    kept = fork.prompt_experts.copy()
    lead.forks = []  # decoding now; preempted, prefilled again with its response token
    again = _prefill_plan([lead], [(0, 0, 7)])
    StepExperts(again).record(rows(again) + 50)
    assert lead.prompt_experts[:, 0, 0].tolist() == [50, 51, 52, 53, 54]
    assert fork.prompt_experts is not lead.prompt_experts and np.array_equal(fork.prompt_experts, kept)


def _batch(n, width, seed):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (n,), generator=gen)
    ids = torch.randint(5, 100, (n, width), generator=gen)
    ids[:, 0] = torch.arange(n) + 1000 * seed  # each row named by its first token
    experts = torch.randint(0, 8, (n, width, 2, 2), generator=gen).to(torch.uint8)
    return SampleBatch(ids, torch.ones(n, width), lengths, rollout_logprobs=torch.zeros(n, width),
                       expert_ids=experts)


def test_ids_survive_select_concat_and_dumps(tmp_path):
    from megarl.trainer.dump import load_rollout, save_rollout
    from megarl.trainer.rollout import Rollout, concat_rollouts

    def rollout(batch):
        n = len(batch)
        return Rollout(batch=batch, prompts=["p"] * n, responses=["r"] * n, answers=[None] * n,
                       extras=[{}] * n, group_ids=torch.arange(n), finish_reasons=["stop"] * n)

    a, b = _batch(3, 6, 1), _batch(2, 9, 2)
    picked = a.select([2, 0])
    width = int(a.lengths[[2, 0]].max())
    assert torch.equal(picked.expert_ids, a.expert_ids[[2, 0], :width])
    both = concat_rollouts([rollout(a), rollout(b)]).batch
    assert both.expert_ids.shape == (5, 9, 2, 2)
    assert torch.equal(both.expert_ids[:3, :6], a.expert_ids) and (both.expert_ids[:3, 6:] == 255).all()
    assert torch.equal(both.expert_ids[3:], b.expert_ids)
    groups = SimpleNamespace(tp_rank=0, pp_rank=0, dp_rank=0)
    save_rollout(rollout(both), str(tmp_path), 1, groups)
    back = load_rollout(str(tmp_path), 1, 0, "cpu").batch
    assert back.expert_ids.dtype == torch.uint8 and torch.equal(back.expert_ids, both.expert_ids)


def _deal(rank):
    from megarl.distributed import init_distributed
    from megarl.roles.dp_balance import deal_rows

    init_distributed()
    import torch.distributed as dist

    mine = _batch(4, 7 + 3 * rank, rank + 1)
    mine.lengths = torch.tensor([[7, 2, 2, 2], [10, 9, 8, 2]][rank])  # rank 1 holds more tokens: rows move
    dealt = deal_rows(mine, dist.group.WORLD, 2, keep_counts=False)
    return [(int(row[0]), e) for row, e in zip(dealt.batch.input_ids, dealt.batch.expert_ids)], dealt.assignment


def test_ids_follow_their_rows_over_dp():
    results = spawn(_deal, 2)
    assert results[0][1] != [[0, 1, 2, 3], [4, 5, 6, 7]]  # rows were re-dealt
    originals = {1000 * (r + 1) + i: _batch(4, 7 + 3 * r, r + 1).expert_ids[i] for r in (0, 1) for i in range(4)}
    lengths = {1000 * (r + 1) + i: n for r, ls in enumerate([[7, 2, 2, 2], [10, 9, 8, 2]]) for i, n in enumerate(ls)}
    for rows, _ in results:
        for name, ids in rows:
            n = lengths[name]
            assert torch.equal(ids[:n], originals[name][:n])


def _cfg(**actor):
    from megarl.config import Config

    cfg = Config()
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}


@pytest.mark.parametrize("change,hf,message", [
    ({}, {"architectures": ["Qwen3ForCausalLM"]}, "actor.router_replay=r3 needs a mixture-of-experts model"),
    ({"probe": -1}, QWEN3_MOE, "actor.router_replay_probe_every"),
])
def test_config_errors(change, hf, message):
    from megarl.config_checks import check_router_replay
    from megarl.errors import ConfigError

    cfg = _cfg(router_replay="r3", router_replay_probe_every=change.get("probe", 1))
    cfg.rollout.engine = change.get("engine", "native")
    with pytest.raises(ConfigError) as e:
        check_router_replay(cfg, hf)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_r3_turns_expert_recording_on():
    from megarl.config_checks import check_router_replay
    from megarl.rollout.factory import engine_options

    check_router_replay(_cfg(router_replay="r3"), QWEN3_MOE)  # fine
    at_tp2 = _cfg(router_replay="r3")
    at_tp2.parallel.tp, at_tp2.parallel.sequence_parallel = 2, True
    check_router_replay(at_tp2, QWEN3_MOE)  # each TP rank replays its sequence-parallel slice
    on_sglang = _cfg(router_replay="r3")
    on_sglang.rollout.engine = "sglang"
    check_router_replay(on_sglang, QWEN3_MOE)  # SGLang returns the ids (enable_return_routed_experts)
    assert engine_options(_cfg(router_replay="r3")).record_experts
    assert not engine_options(_cfg()).record_experts
