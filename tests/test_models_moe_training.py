"""An MoE actor update gives the same loss, gradient norm and expert load at every expert layout.

A fixed batch of 8 sequences (random old log-probs and advantages, ragged lengths) goes
through two actor updates (Adam, lr 1e-3) of the tiny Qwen2-MoE (4 experts, top-2, shared
expert) at two 2-process layouts: DP2 (every rank holds all 4 experts) and EP2 (2 experts
per rank, tokens exchanged by alltoall; DP2 for everything else), and EP2 with full
activation recompute (every layer, the MoE layer's alltoalls included, runs again in
backward: the same numbers), EP2 on right-padded rows instead of packed THD micro-batches
(the padding tokens go to the model as megatron-core's padding_mask: routed to no expert and
out of the expert load, megarl/models/moe_padding.py; MoE routing is per token: the same experts
for the real ones), and EP2 with megatron's plain optimizer instead of the
distributed one (every layout above shards the Adam state over DP, expert-DP for experts).
Each micro-batch returns (sum of token losses, token count) and megatron-core divides the
summed gradients once by the global count, for the expert parameters too (reduced over the
expert-data-parallel group), so the first update's pg_loss and grad norm, and the second
update's pg_loss (after one identical step), agree to 1e-5 in fp32. The expert load
(tokens per expert, summed over the DP ranks' tokens) counts the same routed tokens in
every layout, so its max/mean ratios are equal. With actor.moe_aux_loss_coef and
moe_z_loss_coef > 0 the gradient changes (the losses reach the router) and still agrees
across layouts. Not covered: TP (megatron-core's MoE layer trains TP only with sequence
parallelism: TP2 and TP2 x EP2 updates equal TP1's in tests/test_moe_r3_tp.py), PP with EP; CP:
tests/test_models_moe_cp.py.
"""
import pytest
import torch

from dist_helpers import spawn
from test_roles_layout import fixed_batch

# (tp, ep, recompute, packing, distributed optimizer)
LAYOUTS = {"dp2": (1, 1, "none", True, True), "ep2": (1, 2, "none", True, True),
           "ep2_recompute": (1, 2, "full", True, True), "ep2_unpacked": (1, 2, "none", False, True),
           "ep2_plain_optimizer": (1, 2, "none", True, False)}


def _update(rank, ckpt, tp, ep, recompute, packing, distributed, aux):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(tp, 1, 1, ep, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.actor.optim.lr = 1e-3
    cfg.actor.micro_batch_size = 2
    cfg.actor.moe_aux_loss_coef = cfg.actor.moe_z_loss_coef = aux
    cfg.actor.recompute = recompute
    cfg.actor.packing, cfg.parallel.distributed_optimizer = packing, distributed
    actor = build_actor(cfg, groups, optimizer_steps=2)
    batch = fixed_batch(300)
    rows = len(batch) // groups.dp_size
    batch = batch.select(torch.arange(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
    out = []
    for _ in range(2):
        (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(rows)], norm_len=8)
        sums = torch.tensor([m["actor/pg_loss"], m["actor/count"]], dtype=torch.float64)
        dist.all_reduce(sums, group=groups.dp)
        load = {k: v for k, v in m.items() if k.startswith("moe/")}
        out.append((float(sums[0] / sums[1]), m["grad_norm"], load))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("moe_actor") / "hf")
    make_tiny_checkpoint(path, "Qwen2MoeForCausalLM", seed=5)
    return path


@pytest.fixture(scope="module")
def runs(ckpt):
    """{(layout, aux coef): per-rank [(pg_loss, grad_norm, load) of update 1, of update 2]}."""
    return {(name, aux): spawn(_update, 2, ckpt, *layout, aux)
            for name, layout in LAYOUTS.items() for aux in AUX
            if name in ("dp2", "ep2") or aux == 0.0}


AUX = (0.0, 0.01)


@pytest.mark.parametrize("aux", AUX)
def test_update_matches_across_expert_layouts(runs, aux):
    first, second = runs[("dp2", aux)][0]
    assert set(first[2]) == {"moe/load_max_over_mean", "moe/load_max_over_mean/layer_0",
                             "moe/load_max_over_mean/layer_1"}
    assert all(1.0 <= v <= 2.0 for v in first[2].values())  # 4 experts, top-2: at most 4 / 2
    for name in [n for n in LAYOUTS if (n, aux) in runs]:
        for rank_result in runs[(name, aux)]:  # every rank reports the same numbers
            for (loss, norm, load), (ref_loss, ref_norm, ref_load) in zip(rank_result, (first, second)):
                assert loss == pytest.approx(ref_loss, abs=1e-5, rel=1e-5), name
                assert norm == pytest.approx(ref_norm, abs=1e-5, rel=1e-5), name
                assert load == pytest.approx(ref_load, abs=1e-12), name  # padding routed nowhere


def test_aux_and_z_losses_reach_the_gradient(runs):
    """Same batch and weights: the first update's loss is the same, its gradient is not."""
    (loss0, norm0, _), _ = runs[("dp2", 0.0)][0]
    (loss1, norm1, _), _ = runs[("dp2", 0.01)][0]
    assert loss1 == pytest.approx(loss0, abs=1e-6)  # pg_loss does not include the MoE losses
    assert abs(norm1 - norm0) > 1e-6
