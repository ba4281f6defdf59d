"""Rollout routing replay (actor.router_replay=r3) under tensor parallelism with sequence parallelism.

megatron-core's MoE layer trains TP > 1 only with sequence parallelism: TP rank r's routers see the r-th
of tp equal slices of the micro-batch's tokens along the sequence (the packed row padded to a multiple
of tp; padded rows get padding columns up to one), so the replay hands each rank that slice of the
recorded ids (megarl/models/router_replay.py). Sequence parallelism runs here on CPU with the local spec,
whose norms mark their weights for megatron-core's TP gradient sum (megarl/models/local_norm.py).

Two processes, tiny fp32 Qwen3-MoE (4 experts, renormalized top-2) and Qwen2-MoE (softmax top-2, shared
expert). Both ranks generate the same 4 prompts x 2 samples from one seed at three layouts: tp1 (DP2,
each rank a full replica), tp2 (experts' FFN split over expert-TP 2) and tp2ep2 (2 whole experts a rank,
etp 1). Checked at each TP2 layout:
- the engine records the same ids as at TP1 (routing is replicated over TP: every rank routes the same
  rows);
- a router forward hook sees its routing map equal the replayed ids on every recorded (token, layer) of
  every forward: old log-probs on packed and on padded rows (odd widths get a padding column), two
  updates at lr 0.05, the replay after them;
- replayed log-probs before training equal TP1's (1e-5), packed and padded; the first update's loss and
  grad norm equal TP1's (the norms' and router's gradient partials summed over TP; rel 1e-5), and so does
  its expert load (each TP rank counts its slice's routed tokens; the counts are summed over TP);
- after the updates the router's weights moved and would pick other experts (agreement < 1 without
  replay), yet every choice is still the recorded one; TP1's trained weights (exported, loaded at TP2)
  give TP1's replayed log-probs (1e-5) and its agreement, and so do TP2's own three updates (Adam with
  eps 1e-2: with the default 1e-8 a parameter whose gradient is fp32 rounding noise moves by ~lr either
  way, and the two layouts' log-probs part by ~1e-3 after three steps at lr 0.05; eps 1e-2 keeps such
  a parameter still while the router's gradient still moves it).
TP2 x PP2 (4 processes, Qwen3-MoE, one replica): each stage records its own layer, the gathered ids
equal TP1's, and each stage's routers replay their layer on their TP slice (megatron-core cuts the
padding mask for the first stage only: megarl/models/moe_padding.py stage_padding cuts it for the later
ones), in the old-log-prob forward (== the rollout's log-probs, 1e-5) and two updates.
Not covered: bf16, TE's norms (not installed here), CP (refused with TP > 1 for MoE).
"""
import dataclasses
import pickle

import pytest
import torch

from dist_helpers import spawn
from test_moe_r3 import ChoiceCheck, _router_weights, _train

ARCHS = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
PROMPTS = [[7, 8, 9, 10, 11, 12], [50, 51, 52], [40, 41, 42], list(range(20, 31))]
LAYOUTS = {"tp1": (1, 1, None), "tp2": (2, 1, None), "tp2ep2": (2, 2, 1)}  # (tp, ep, etp)


def _actor(ckpt, tp, ep, etp):
    from test_rollout_moe_tp import _actor as rollout_actor

    def r3(cfg):
        cfg.parallel.sequence_parallel = tp > 1
        cfg.actor.router_replay = "r3"
        cfg.actor.optim.lr = 0.05
        cfg.actor.optim.eps = 1e-2  # module docstring: layouts compared after updates
        cfg.actor.micro_batch_size = 2

    return rollout_actor(ckpt, tp, ep, etp, settings=r3, optimizer_steps=4)


def _rollout(actor, groups):
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    options = EngineOptions(max_batch=8, page_size=8, max_num_batched_tokens=16, kv_cache_gb=0.001,
                            record_experts=True)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    results = engine.generate(sample_requests(PROMPTS, 2, 5, 6), SamplingParams(temperature=1.0))
    return to_sample_batch(results, 0, "cpu")


def _padded_logprobs(actor, batch):
    packed = actor.options
    actor.options = dataclasses.replace(packed, packing=False)  # pad_multiple (the TP size) kept
    try:
        return actor.logprobs(batch, 2, 1.0)["logprobs"]
    finally:
        actor.options = packed


def _layout(ckpt, name):
    """One layout's rollout, replayed forwards and updates (see the module docstring); and its actor."""
    actor, groups, cfg = _actor(ckpt, *LAYOUTS[name])
    check = ChoiceCheck(actor)
    batch = _rollout(actor, groups)
    r = {"experts": batch.expert_ids, "mask": batch.response_mask, "split": actor.replay.split,
         "widths": [int(batch.lengths[i:i + 2].max()) for i in range(0, len(batch), 2)],  # micro-batches of 2
         "before": actor.logprobs(batch, 2, 1.0)["logprobs"], "padded": _padded_logprobs(actor, batch),
         "agree_before": actor.replay.read()}
    routers = _router_weights(actor)
    b = batch.select(torch.arange(len(batch)))
    b.old_logprobs = b.rollout_logprobs.clone()
    b.advantages = (b.input_ids % 3 - 1).float() * b.response_mask
    (first,) = actor.update(b, cfg.actor, 1.0, [torch.arange(len(b))], norm_len=6)
    r["first_update"] = (first["actor/pg_loss"], first["grad_norm"])
    r["load"] = {k: v for k, v in first.items() if k.startswith("moe/")}
    _train(actor, batch, cfg)
    r["router_moved"] = float((_router_weights(actor) - routers).abs().max())
    actor.replay.reset()
    r["after"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
    r["agree_after"] = actor.replay.read()
    with actor.replay.observing():
        actor.logprobs(batch, 2, 1.0)
    r["own_after"] = actor.replay.read()
    r["wrong"], r["checked"] = check.wrong, check.checked
    return r, actor, groups, batch


def _job(rank, ckpts, root):
    from megarl.distributed import init_distributed
    from megarl.models import export_hf

    init_distributed()
    out = {}
    for arch, ckpt in ckpts.items():
        trained = f"{root}/{arch}_tp1_trained"
        out[(arch, "tp1")], actor, groups, tp1_batch = _layout(ckpt, "tp1")
        export_hf(actor.module, actor.info, groups, trained)
        for name in ("tp2", "tp2ep2"):
            r = out[(arch, name)] = _layout(ckpt, name)[0]
            actor = _actor(trained, *LAYOUTS[name])[0]  # TP1's trained weights, TP1's batch
            check = ChoiceCheck(actor)
            r["tp1_weights"] = actor.logprobs(tp1_batch, 2, 1.0)["logprobs"]
            r["agree_tp1_weights"] = actor.replay.read()
            r["wrong_tp1_weights"], r["checked_tp1_weights"] = check.wrong, check.checked
    return pickle.dumps(out)  # plain bytes: tensors sent through the queue's shared memory can vanish


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoints

    root = tmp_path_factory.mktemp("moe_r3_tp")
    ckpts = make_tiny_checkpoints(root, ARCHS, 80)
    return [pickle.loads(r) for r in spawn(_job, 2, ckpts, str(root))]


CASES = [(arch, name) for arch in ARCHS for name in ("tp2", "tp2ep2")]


@pytest.mark.parametrize("arch, layout", CASES)
def test_recording_equals_tp1(runs, arch, layout):
    for rank in runs:
        assert rank[(arch, layout)]["split"] == 2 and rank[(arch, "tp1")]["split"] == 1
        assert torch.equal(rank[(arch, layout)]["experts"], rank[(arch, "tp1")]["experts"])


@pytest.mark.parametrize("arch, layout", CASES)
def test_every_forward_routes_to_the_recorded_experts(runs, arch, layout):
    """Each rank checks its own slice: together the ranks cover every recorded token once per forward."""
    for rank in runs:
        r = rank[(arch, layout)]
        assert r["checked"] > 100 and r["wrong"] == 0
        assert r["checked_tp1_weights"] > 20 and r["wrong_tp1_weights"] == 0
        assert r["agree_before"]["r3/agreement"] == 1.0  # same weights as the rollout
        assert any(w % 2 for w in r["widths"])  # padded rows: a micro-batch got a sequence-parallel pad column
    assert sum(rank[(arch, layout)]["checked"] for rank in runs) == runs[0][(arch, "tp1")]["checked"]


@pytest.mark.parametrize("arch, layout", CASES)
def test_replay_holds_after_the_router_changed(runs, arch, layout):
    for rank in runs:
        r = rank[(arch, layout)]
        assert r["router_moved"] > 1e-3
        assert r["own_after"]["r3/agreement"] < 1.0  # the router alone would choose others
        assert r["agree_after"]["r3/agreement"] < 1.0  # counted in the replayed forward too


@pytest.mark.parametrize("arch, layout", CASES)
def test_logprobs_equal_tp1(runs, arch, layout):
    for rank in runs:
        one, two = rank[(arch, "tp1")], rank[(arch, layout)]
        mask = one["mask"] != 0
        for key in ("before", "padded"):
            assert (two[key] - one["before"]).abs()[mask].max() <= 1e-5, key
        assert (two["tp1_weights"] - one["after"]).abs()[mask].max() <= 1e-5
        assert (two["after"] - one["after"]).abs()[mask].max() <= 1e-5  # after three updates each
        assert two["agree_tp1_weights"] == pytest.approx(one["agree_after"], abs=1e-12)
        assert two["first_update"] == pytest.approx(one["first_update"], rel=1e-5)
        assert two["load"] == one["load"] and len(one["load"]) == 3  # the same tokens counted per expert


def _pp_job(rank, ckpt, tp1_experts):
    """TP2 x PP2 (one replica on 4 ranks): each stage records its layer; the batch gathers both; each
    stage's routers replay their layer on their TP rank's slice, in the old-log-prob forward and an update."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.router_replay import all_stage_layers
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(tp=2, pp=2, ep=1, etp=None)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel = 2, 2, True
    cfg.actor.router_replay, cfg.actor.micro_batch_size, cfg.actor.optim.lr = "r3", 2, 0.05
    actor = build_actor(cfg, groups, optimizer_steps=2)
    check = ChoiceCheck(actor)
    batch = _rollout(actor, groups)
    local = batch.expert_ids.shape[2]
    batch.expert_ids = all_stage_layers(batch.expert_ids, groups)
    lp = actor.logprobs(batch, 2, 1.0)["logprobs"]
    _train(actor, batch, cfg)
    return pickle.dumps({"local": local, "same_ids": torch.equal(batch.expert_ids, tp1_experts),
                         "diff": float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()),
                         "wrong": check.wrong, "checked": check.checked})


def test_tp2_pp2_stages_replay_their_layers(runs, tmp_path):
    from megarl.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path), ARCHS[0], seed=80)  # the module fixture's Qwen3-MoE
    tp1 = runs[0][(ARCHS[0], "tp1")]["experts"]
    for stage in [pickle.loads(r) for r in spawn(_pp_job, 4, str(tmp_path), tp1)]:
        assert stage["local"] == 1 and stage["same_ids"]  # each stage recorded its layer; gathered == TP1's
        assert stage["checked"] > 50 and stage["wrong"] == 0
        assert stage["diff"] <= 1e-5
