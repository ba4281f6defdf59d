"""Context parallelism with a mixture of experts: CP2 gives CP1's numbers (megarl/models/moe_padding.py).

Tiny fp32 Qwen3-MoE (4 experts, top-2), a fixed batch of 8 ragged sequences, packed rows (CP
needs them). Under CP each sequence is padded to a multiple of 2·cp and CP rank r holds chunks r
and 2·cp-1-r; the roles pass that padding as megatron-core's ``padding_mask``, so padding is routed
to no expert and stays out of the router losses. Derivation of the expected equalities:

- log-probs: attention is whole-sequence (Ulysses), MoE routing is per token, and the padding
  sits after each sequence's real tokens (causal: nothing real reads it), so every real token's
  log-prob is CP1's (1e-5);
- the policy loss and its gradient: each CP rank holds the whole loss (gathered per-position
  numbers) and the gradient of its own positions; summed over dp x cp and divided by the count of
  CP rank 0, that is CP1's gradient;
- load-balancing loss (``aux``): megatron-core sums tokens per expert and the real-token count over
  the tp x cp group, each rank's share is its tokens' probabilities against those, and the shares
  add to the micro-batch's loss; z-loss (``z``): each rank's sum over the group's real-token count
  (``z_loss_over_group``; megatron-core's own per-rank mean / cp differs here by ~1e-3 in grad norm,
  the padding being all on one rank); so grad norm and pg_loss of two Adam updates match (1e-5);
- expert load (max / mean tokens per expert, summed over dp x cp): the same real tokens routed, the
  padding routed nowhere: equal to 1e-12.

CP2 x EP2 on 4 processes (DP2; experts over an EP group that crosses the CP pairs) equals EP2 at
CP1 (DP2: the same rows dealt to each DP rank, so the same micro-batches for the per-micro-batch
aux loss). With r3 (router replay) the recorded ids are laid out on the global packed row and cut
like the tokens: checked alone on every rank's chunk, and in forwards at CP2 that replay random
ids (unlike the router's own choice, so a misplaced id changes the log-probs): every replayed
token's routing equals its ids, log-probs and update equal CP1's replay of the same ids.
Not covered: CP with TP (CP needs sequence parallelism off, MoE training at TP > 1 needs it on:
a config error), PP with CP, bf16.
"""
import pickle

import pytest
import torch

from dist_helpers import spawn
from test_moe_r3 import ChoiceCheck
from test_roles_layout import fixed_batch

ARCH = "Qwen3MoeForCausalLM"
SETTINGS = {"none": (0.0, 0.0), "aux": (0.1, 0.0), "z": (0.0, 0.1)}  # (aux loss coef, z-loss coef)


def random_expert_ids(batch, layers: int = 2, k: int = 2, experts: int = 4):
    """(B, L, layers, k) uint8: k distinct random experts at every position but each row's last."""
    from megarl.models.router_replay import unrecorded

    gen = torch.Generator().manual_seed(1)
    b, width = batch.input_ids.shape
    ids = torch.rand(b, width, layers, experts, generator=gen).argsort(-1)[..., :k].to(torch.uint8)
    outside = torch.arange(width)[None, :] >= (batch.lengths - 1)[:, None]
    ids[outside] = unrecorded(torch.uint8)
    return ids


def _actor(ckpt, cp, ep, aux, z, replay=False):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.roles.build import build_actor

    groups = build_parallel_groups(1, 1, cp, ep, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.parallel.cp, cfg.parallel.ep = cp, ep
    cfg.actor.optim.lr = 1e-3
    cfg.actor.micro_batch_size = 2
    cfg.actor.moe_aux_loss_coef, cfg.actor.moe_z_loss_coef = aux, z
    cfg.actor.router_replay = "r3" if replay else "none"
    return build_actor(cfg, groups, optimizer_steps=2), groups, cfg


def _numbers(actor, groups, cfg, batch):
    """Log-probs of this DP rank's rows, then (pg_loss, grad_norm, expert load) of two updates."""
    import torch.distributed as dist

    rows = len(batch) // groups.dp_size
    batch = batch.select(torch.arange(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
    out = {"logprobs": (actor.logprobs(batch, 2, 1.0)["logprobs"] * batch.response_mask).tolist(), "updates": []}
    for _ in range(2):
        (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(rows)], norm_len=8)
        sums = torch.tensor([m["actor/pg_loss"], m["actor/count"]], dtype=torch.float64)
        dist.all_reduce(sums, group=groups.dp)
        load = {k: v for k, v in m.items() if k.startswith("moe/")}
        out["updates"].append((float(sums[0] / sums[1]), m["grad_norm"], load))
    return out


def _job(rank, ckpt, cp, ep, settings):
    from megarl.distributed import init_distributed

    init_distributed()
    return {name: _numbers(*_actor(ckpt, cp, ep, *SETTINGS[name]), fixed_batch(300)) for name in settings}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("moe_cp") / "hf")
    make_tiny_checkpoint(path, ARCH, seed=5)
    return path


def _assert_same(got, want, where):
    diff = (torch.tensor(got["logprobs"]) - torch.tensor(want["logprobs"])).abs().max()
    assert diff <= 1e-5, (where, float(diff))
    for (loss, norm, load), (ref_loss, ref_norm, ref_load) in zip(got["updates"], want["updates"]):
        assert loss == pytest.approx(ref_loss, abs=1e-5, rel=1e-5), where
        assert norm == pytest.approx(ref_norm, abs=1e-5, rel=1e-5), where
        assert set(load) == {"moe/load_max_over_mean", "moe/load_max_over_mean/layer_0",
                             "moe/load_max_over_mean/layer_1"}
        assert load == pytest.approx(ref_load, abs=1e-12), where


def test_cp2_equals_cp1(ckpt):
    cp1 = spawn(_job, 1, ckpt, 1, 1, list(SETTINGS))[0]
    for rank, got in enumerate(spawn(_job, 2, ckpt, 2, 1, list(SETTINGS))):
        for name in SETTINGS:
            _assert_same(got[name], cp1[name], (rank, name))
    norms = {name: cp1[name]["updates"][0][1] for name in SETTINGS}
    assert abs(norms["aux"] - norms["none"]) > 1e-3 and abs(norms["z"] - norms["none"]) > 1e-3  # they act


def test_cp2_ep2_equals_ep2(ckpt):
    """4 processes: DP2 x CP2, experts over EP2, against EP2 x DP2 on 2 processes."""
    settings = ["aux", "z"]
    ep2 = spawn(_job, 2, ckpt, 1, 2, settings)
    for rank, got in enumerate(spawn(_job, 4, ckpt, 2, 2, settings)):
        for name in settings:
            _assert_same(got[name], ep2[rank // 2][name], (rank, name))  # ranks 2r, 2r+1: DP rank r


# ---- router replay (r3) ----

def test_replay_ids_are_cut_like_the_tokens():
    """On each CP rank, the ids model_order hands the routers at local token j are the ones recorded
    at that token's (row, position) of the batch; padding and each row's last token are unrecorded."""
    from megarl.models.router_replay import model_order
    from megarl.roles.inputs import cp_packed_inputs

    batch = fixed_batch(300)
    ids = random_expert_ids(batch)
    for cp in (2, 4):
        for r in range(cp):
            x = cp_packed_inputs(batch.input_ids, batch.lengths, None, cp, r)
            got, valid = model_order(ids, batch.lengths, x, 4)
            position = x.position_ids[0]  # (t,) position in its sequence
            row = torch.searchsorted(x.starts, x.cp.index[r], right=True) - 1  # (t,) its sequence
            want_valid = (position < batch.lengths[row] - 1) & ~x.padding[0]
            assert torch.equal(valid, want_valid)
            inside = position.clamp(max=ids.size(1) - 1)  # CP padding may run past the batch's width
            assert torch.equal(got[valid], ids[row, inside][valid].long())
            assert torch.equal(x.padding[0], position >= batch.lengths[row])


def _replay_job(rank, ckpt, cp):
    """Replayed log-probs, agreement and one update on the whole batch (every rank: DP deals it)."""
    from megarl.distributed import init_distributed

    init_distributed()
    actor, groups, cfg = _actor(ckpt, cp, 1, 0.0, 0.0, replay=True)
    check = ChoiceCheck(actor)
    batch = fixed_batch(300)
    batch.expert_ids = random_expert_ids(batch)
    lp = actor.logprobs(batch, 2, 1.0)["logprobs"] * batch.response_mask
    agreement = actor.replay.read()
    (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(len(batch))], norm_len=8)
    return pickle.dumps({"logprobs": lp, "agreement": agreement, "grad_norm": m["grad_norm"],
                         "wrong": check.wrong, "checked": check.checked})


def test_cp2_replays_the_recorded_experts(ckpt):
    cp1 = pickle.loads(spawn(_replay_job, 1, ckpt, 1)[0])
    recorded = int((fixed_batch(300).lengths - 1).sum())  # tokens with ids, per layer
    assert cp1["wrong"] == 0 and cp1["checked"] == 2 * 2 * recorded  # 2 layers, log-prob + update forwards
    assert cp1["agreement"]["r3/agreement"] < 0.9  # random ids: the router would mostly choose others
    cp2 = [pickle.loads(r) for r in spawn(_replay_job, 2, ckpt, 2)]
    assert sum(got["checked"] for got in cp2) == cp1["checked"]  # each rank checked its own chunks
    for got in cp2:
        assert got["wrong"] == 0 and got["checked"] > 0
        assert (got["logprobs"] - cp1["logprobs"]).abs().max() <= 1e-5
        assert got["agreement"] == pytest.approx(cp1["agreement"], abs=1e-12)  # counted over both CP ranks
        assert got["grad_norm"] == pytest.approx(cp1["grad_norm"], abs=1e-5, rel=1e-5)
