"""Rollout routing replay (actor.router_replay=r3): the training forward routes to the recorded experts.

Two processes, tiny fp32 Qwen3-MoE (renormalized top-2 of 4 experts) and Qwen2-MoE (softmax over all
experts, top-2 as they are, shared expert). At EP1 (DP2) the native engine samples (temperature 1)
each rank's own prompts with expert recording on; the batch carries the ids per position, recorded
at every token but each row's last (prompt tokens from the prefill, the same for a prompt's samples;
the 11-token prompt prefilled in two chunks). A forward hook on every router compares its routing
map (tokens x experts) with the replayed ids on every recorded token of every layer, in the old-log-prob forward (padded rows and packed THD rows) and in
the update's forward. Then the actor takes two updates at lr 0.05, and the earlier rollout is
replayed again: the choices must still be the recorded ones, while the router left alone (no
replay, the same forward) picks other experts for some of them (agreement < 1: the replay is what
keeps them). The router's weights move in those updates (aux loss off: only the gate weights'
gradient through the replayed experts can move them). At EP2 (2 experts per rank, tokens over
alltoall) the choices equal the recorded ones in every forward too, and the same batch's replayed
log-probs and agreement equal EP1's (1e-5) with the checkpoint's weights and with EP1's trained
weights (exported, loaded at EP2: the replay compared alone; EP2's own two Adam steps at lr 0.05
land within ~1e-4 of EP1's, as Adam's first steps amplify fp32 differences of small gradients).
PP2 (one replica over both ranks): each stage records its own layer, the batch gathers both
(equal to PP1's ids for the same prompts and seeds), and each stage's routers replay their layer.
The PPO step's prepare phase returns the r3 metrics, equal to the ones read directly.
Full recompute at EP2: the recomputed layers route as their first pass did (same updates as
without recompute). Not covered: bf16, the on-policy update path's agreement read; TP (sequence
parallelism): tests/test_moe_r3_tp.py.
"""
import pickle

import pytest
import torch

from dist_helpers import spawn

ARCHS = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
PROMPTS = {0: [[7, 8, 9, 10, 11, 12], [50, 51, 52]], 1: [[40, 41, 42], list(range(20, 31))]}


def _actor(ckpt, ep, packing=True, pp=1, recompute="none"):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.roles.build import build_actor

    groups = build_parallel_groups(1, pp, 1, ep, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.ep, cfg.parallel.pp = ep, pp
    cfg.actor.router_replay = "r3"
    cfg.actor.packing = packing
    cfg.actor.optim.lr = 0.05
    cfg.actor.micro_batch_size = 2
    cfg.actor.recompute = recompute
    return build_actor(cfg, groups, optimizer_steps=4), groups, cfg


class ChoiceCheck:
    """Router forward hooks: recorded (token, layer) rows whose routing map is not the replayed ids."""

    def __init__(self, actor):
        self.wrong = self.checked = 0
        for m in actor.module.modules():
            if hasattr(m, "router") and hasattr(m, "token_dispatcher"):
                m.router.register_forward_hook(self.hook)

    def hook(self, router, _inputs, out):
        replay = router.router_replay
        if replay.owner.ids is None or not replay.owner.replace:
            return
        ids, valid = replay.owner.ids[:, replay.layer], replay.owner.valid
        want = torch.zeros_like(out[1]).scatter(1, torch.where(valid[:, None], ids, 0), True)
        self.wrong += int((want[valid] != out[1][valid]).any(-1).sum())
        self.checked += int(valid.sum())


def _rollout(actor, groups, rank):
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001,
                            record_experts=True)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    results = engine.generate(sample_requests(PROMPTS[rank], 2, 7 + rank, 6), SamplingParams(temperature=1.0))
    return to_sample_batch(results, 0, "cpu")


def _train(actor, batch, cfg):
    """Two updates on the rollout (advantages from the sampled tokens' ids: fixed, nonzero)."""
    b = batch.select(torch.arange(len(batch)))
    b.old_logprobs = b.rollout_logprobs.clone()
    b.advantages = (b.input_ids % 3 - 1).float() * b.response_mask
    for _ in range(2):
        (m,) = actor.update(b, cfg.actor, 1.0, [torch.arange(len(b))], norm_len=6)
    return m


def _router_weights(actor):
    return torch.cat([m.router.weight.detach().flatten().clone() for m in actor.module.modules()
                      if hasattr(m, "router") and hasattr(m, "token_dispatcher")])


def _prepare(actor, groups, cfg, batch):
    """The PPO step's prepare phase on the rollout (old-log-prob forward on): its r3 metrics, old log-probs."""
    from megarl.trainer import phases
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.rollout import Rollout

    n = len(batch)
    rollout = Rollout(batch=batch.select(torch.arange(n)), prompts=[""] * n, responses=[""] * n, answers=[None] * n,
                      extras=[{}] * n, group_ids=torch.arange(n), finish_reasons=["stop"] * n)
    cfg.actor.ppo_epochs = 2  # not an on-policy update: the old-log-prob forward runs
    metrics = phases.prepare(rollout, cfg, 0, groups.dp_size, actor, None, None, PhaseTimer())
    return metrics, rollout.batch.old_logprobs


def _job(rank, ckpts, root):
    from megarl.distributed import init_distributed
    from megarl.models import export_hf

    init_distributed()
    out = {}
    for arch, ckpt in ckpts.items():
        trained = f"{root}/{arch}_trained"
        batches = {}
        for ep in (1, 2):
            actor, groups, cfg = _actor(ckpt, ep)
            check = ChoiceCheck(actor)
            batch = batches.setdefault("rollout", _rollout(actor, groups, rank)) if ep == 1 else batches["rollout"]
            r = {"before": actor.logprobs(batch, 2, 1.0)["logprobs"], "agree_before": actor.replay.read()}
            actor.options = type(actor.options)(packing=False)
            r["padded"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
            actor.options = type(actor.options)(packing=True)
            routers = _router_weights(actor)
            _train(actor, batch, cfg)
            r["router_moved"] = float((_router_weights(actor) - routers).abs().max())
            actor.replay.reset()
            r["after"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
            r["agree_after"] = actor.replay.read()
            with actor.replay.observing():
                r["free_after"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
            r["own_after"] = actor.replay.read()
            r["wrong"], r["checked"] = check.wrong, check.checked
            r["mask"], r["rollout"], r["experts"] = batch.response_mask, batch.rollout_logprobs, batch.expert_ids
            r["lengths"], r["input_ids"] = batch.lengths, batch.input_ids
            if ep == 1:
                r["prepare"], r["old"] = _prepare(actor, groups, cfg, batch)
                export_hf(actor.module, actor.info, groups, trained)
            else:  # EP1's trained weights at EP2: the same replayed forward
                actor, groups, cfg = _actor(trained, ep)
                r["after_ep1_weights"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
                r["agree_ep1_weights"] = actor.replay.read()
            out[(arch, ep)] = r
    return pickle.dumps(out)  # plain bytes: tensors sent through the queue's shared memory can vanish


def _recompute_job(rank, ckpt):
    """EP2 with full recompute: the backward pass's second forward of each layer replays the same ids."""
    from megarl.distributed import init_distributed

    init_distributed()
    out = {}
    for recompute in ("none", "full"):
        actor, groups, cfg = _actor(ckpt, 2, recompute=recompute)
        check = ChoiceCheck(actor)
        batch = _rollout(actor, groups, rank)
        m = _train(actor, batch, cfg)
        out[recompute] = {"grad_norm": m["grad_norm"], "wrong": check.wrong, "checked": check.checked,
                          "after": actor.logprobs(batch, 2, 1.0)["logprobs"].numpy()}
    return out


def _pp_job(rank, ckpt):
    """PP2 (one replica: both ranks generate rank 0's prompts from its seed): each stage records its own
    layer; the batch gathers both; each stage's routers replay their layer."""
    from megarl.distributed import init_distributed
    from megarl.models.router_replay import all_stage_layers

    init_distributed()
    actor, groups, cfg = _actor(ckpt, 1, pp=2)
    check = ChoiceCheck(actor)
    batch = _rollout(actor, groups, 0)
    local = batch.expert_ids.shape
    batch.expert_ids = all_stage_layers(batch.expert_ids, groups)
    lp = actor.logprobs(batch, 2, 1.0)["logprobs"]
    return pickle.dumps({"local": local, "experts": batch.expert_ids, "logprobs": lp, "rollout": batch.rollout_logprobs,
                         "mask": batch.response_mask, "wrong": check.wrong, "checked": check.checked})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoints

    root = tmp_path_factory.mktemp("moe_r3")
    ckpts = make_tiny_checkpoints(root, ARCHS, 60)
    return {"ckpts": ckpts, "root": root, "runs": [pickle.loads(r) for r in spawn(_job, 2, ckpts, str(root))]}


@pytest.fixture(scope="module")
def runs(setup):
    return setup["runs"]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_training_routes_to_recorded_experts(runs, arch, ep):
    """Every recorded token of every layer, in every replayed forward (old log-probs packed and padded,
    the updates' forwards, the replay after training)."""
    for rank in runs:
        r = rank[(arch, ep)]
        assert r["checked"] > 100 and r["wrong"] == 0
        assert r["agree_before"]["r3/agreement"] == 1.0  # same weights as the rollout: the router agrees
        assert set(r["agree_before"]) == {"r3/agreement", "r3/agreement/layer_0", "r3/agreement/layer_1"}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_prompt_and_response_token_is_recorded(runs, arch):
    """Positions 0 .. length - 2 hold ids (the last token feeds nothing the rollout sampled), the rest
    the unrecorded mark; a prompt's two samples carry the same prompt ids."""
    from megarl.models.router_replay import recorded

    for rank_index, rank in enumerate(runs):
        r = rank[(arch, 1)]
        width = r["experts"].shape[1]
        want = torch.arange(width)[None, :] < (r["lengths"] - 1)[:, None]
        assert torch.equal(recorded(r["experts"], 4), want)
        for i, prompt in enumerate(PROMPTS[rank_index]):
            assert torch.equal(r["input_ids"][2 * i, :len(prompt)], torch.tensor(prompt))
            assert torch.equal(r["experts"][2 * i, :len(prompt) - 1], r["experts"][2 * i + 1, :len(prompt) - 1])


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_holds_after_the_router_changed(runs, arch):
    for rank in runs:
        r = rank[(arch, 1)]
        assert r["router_moved"] > 1e-3  # the gate weights' gradient reached the router
        assert r["own_after"]["r3/agreement"] < 1.0  # the router would choose others
        assert r["agree_after"]["r3/agreement"] < 1.0  # counted in the replayed forward too
        mask = r["mask"] != 0
        assert (r["after"] - r["free_after"]).abs()[mask].max() > 1e-4  # replay changes the log-probs


@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_logprobs_equal_replayed_training(runs, arch):
    """Same weights: replayed training log-probs == the engine's (1e-5), packed and padded."""
    for rank in runs:
        r = rank[(arch, 1)]
        mask = r["mask"] != 0
        for key in ("before", "padded"):
            assert (r[key] - r["rollout"]).abs()[mask].max() <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_matches_ep1(runs, arch):
    for rank in runs:
        one, two = rank[(arch, 1)], rank[(arch, 2)]
        mask = one["mask"] != 0
        assert (one["before"] - two["before"]).abs()[mask].max() <= 1e-5
        assert (one["after"] - two["after_ep1_weights"]).abs()[mask].max() <= 1e-5
        assert two["agree_ep1_weights"] == pytest.approx(one["agree_after"], abs=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_prepare_phase_metrics(runs, arch):
    """The step's prepare phase (after the updates): old log-probs replayed, agreement of that forward,
    and the probe without replay (its agreement and its log-prob mismatch over both DP ranks)."""
    free_max = max(float((r[(arch, 1)]["free_after"] - r[(arch, 1)]["rollout"]).abs()[r[(arch, 1)]["mask"] != 0].max())
                   for r in runs)
    for rank in runs:
        r = rank[(arch, 1)]
        m = r["prepare"]
        assert torch.equal(r["old"], r["after"])
        assert m["r3/agreement"] == pytest.approx(r["agree_after"]["r3/agreement"], abs=1e-12)
        assert m["r3/no_replay/agreement"] == pytest.approx(r["own_after"]["r3/agreement"], abs=1e-12)
        assert m["r3/no_replay/agreement/layer_1"] == pytest.approx(r["own_after"]["r3/agreement/layer_1"], abs=1e-12)
        assert m["mismatch/no_replay/abs_max"] == pytest.approx(free_max, abs=1e-6)
        assert 0 < m["mismatch/no_replay/abs_mean"] <= m["mismatch/no_replay/abs_max"]


def test_pipeline_stages_replay_their_layers(setup, runs):
    arch = ARCHS[0]
    pp = [pickle.loads(r) for r in spawn(_pp_job, 2, setup["ckpts"][arch])]
    for stage in pp:
        assert stage["local"][2] == 1  # each stage recorded its one layer
        assert torch.equal(stage["experts"], runs[0][(arch, 1)]["experts"])  # == PP1's, both layers
        assert stage["checked"] > 20 and stage["wrong"] == 0
        mask = stage["mask"] != 0
        assert (stage["logprobs"] - stage["rollout"]).abs()[mask].max() <= 1e-5


def test_full_recompute_replays(setup):
    """Two updates with full recompute at EP2 equal the ones without (grad norm 1e-6, log-probs after 1e-5),
    every recomputed router forward replaying too. Without PP a micro-batch's backward follows its forward,
    so the loaded ids are still its own; the queue that keeps them under 1F1B is unit-tested
    (test_moe_r3_plumbing.test_full_recompute_gets_its_first_pass_ids)."""
    for rank in spawn(_recompute_job, 2, setup["ckpts"][ARCHS[0]]):
        plain, full = rank["none"], rank["full"]
        assert full["wrong"] == 0 and full["checked"] > plain["checked"]  # the recomputes were checked too
        assert full["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
        assert abs(full["after"] - plain["after"]).max() <= 1e-5
