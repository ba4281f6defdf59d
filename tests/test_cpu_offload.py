"""actor.optim.cpu_offload / critic.optim.cpu_offload: megatron-core's HybridDeviceOptimizer.

What megatron-core 0.16.1 supports, found by running it:
- it needs the distributed optimizer (megarl passes the DP shards to it);
- every trained parameter must be bf16/fp16: the distributed optimizer hands an
  fp32 parameter over as a non-leaf view of the model's own storage, and the
  offload optimizer's constructor (a ``torch.optim.Optimizer``) raises "can't
  optimize a non-leaf Tensor". fp32 models are therefore refused; so is a role
  that trains the local spec's norms (fp32 weights until they were built in the
  params dtype; not run on a GPU with offload since); a LoRA actor (norms
  frozen, adapters bf16) or the TE spec fit;
- it needs CUDA: on a CPU-only machine nothing is "on the GPU", the optimizer
  keeps no GPU twin of its parameters and its first step fails (KeyError in
  ``_set_sub_optimizer_grads``). The equality test is therefore a ``gpu`` test.

CPU here: each refused combination is a one-line config error naming the key,
and a bf16 LoRA actor gets a HybridDeviceOptimizer with the whole shard offloaded
(construction only). GPU: two updates with offload equal two without: fp32
master weights 1e-6, the moments in host memory, no GPU sub-optimizer.
"""
import pytest
import torch

from dist_helpers import spawn


def _cfg(**actor):
    from megarl.config import Config

    cfg = Config()
    cfg.model.dtype = "bfloat16"
    cfg.actor.lora.rank = 4
    cfg.actor.optim.cpu_offload = True
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.parallel, "distributed_optimizer", False),
     "actor.optim.cpu_offload=true needs parallel.distributed_optimizer=true"),
    (lambda c: setattr(c.model, "dtype", "float32"), "actor.optim.cpu_offload=true needs model.dtype=bfloat16"),
    (lambda c: setattr(c.actor.lora, "rank", 0), "with the local layer spec and trained norms is not verified on a GPU yet"),
])
def test_unsupported_combinations_are_config_errors(change, message):
    from megarl.cli import ConfigError
    from megarl.config_checks import check_actor

    cfg = _cfg()
    change(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        check_actor(cfg)
    assert "\n" not in str(e.value) and "cpu_offload=false" in str(e.value)


def test_critic_and_cuda_errors():
    from megarl.cli import ConfigError
    from megarl.config_checks import check_actor, check_critic

    cfg = _cfg()
    cfg.critic.enable, cfg.critic.optim.cpu_offload = True, True
    with pytest.raises(ConfigError, match="critic.optim.cpu_offload=true with the local layer spec"):
        check_critic(cfg)
    if not torch.cuda.is_available():  # the one combination that fits, on this CPU machine
        with pytest.raises(ConfigError, match="actor.optim.cpu_offload=true needs a CUDA device"):
            check_actor(cfg)


def _on_device(batch):
    from dataclasses import fields, replace

    from megarl.distributed import device

    return replace(batch, **{f.name: getattr(batch, f.name).to(device()) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _offload_job(rank, offload: bool, steps: int, lora_rank: int = 4):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from test_recompute import _batch

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = _cfg(micro_batch_size=4)
    cfg.actor.optim.cpu_offload, cfg.actor.optim.lr, cfg.actor.lora.rank = offload, 1e-4, lora_rank
    actor = build_actor(cfg, groups, 8)
    (dist_opt,) = actor.trainable.optimizer.chained_optimizers
    inner = dist_opt.optimizer
    out = {"hybrid": isinstance(inner, HybridDeviceOptimizer),
           "fraction": getattr(inner, "offload_fraction", None)}
    masters = [p for g in dist_opt.shard_fp32_from_float16_groups for p in g]  # fp32 copies of what trains
    out["fp32_params"] = sum(len(g) for g in dist_opt.shard_fp32_groups)  # none: offload takes half precision only

    def flat():
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in masters]).numpy()

    out["masters_before"] = flat()
    b = _on_device(_batch(actor.info.vocab_size))  # step 1 moves B only (B starts at 0), step 2 both factors
    out["losses"] = [actor.update(b, cfg.actor, 1.0, [torch.arange(len(b))], norm_len=8)[0]["actor/pg_loss"]
                     for _ in range(steps)]
    out["masters"] = flat()
    if out["hybrid"]:
        moments = [v for st in inner.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        out["moments_on_host"] = bool(moments) and all(v.device.type == "cpu" for v in moments)
        out["gpu_sub_optimizer"] = inner.gpu_optimizer is not None
    return out


def test_bf16_lora_actor_gets_the_offload_optimizer():
    out = spawn(_offload_job, 1, True, 0)[0]
    assert out["hybrid"] and out["fraction"] == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_offloaded_steps_equal_device_steps(lora_rank):
    """Two Adam steps (bf16 actor, fp32 masters, lr 1e-4): host AdamW == device AdamW to 1e-6.
    LoRA (adapters only) and a full fine-tune (every weight, the bf16 norms included).

    Step 1 differs only by the two AdamW implementations' rounding (~1e-11); step 2 also by
    bf16 weights that rounded apart (an Adam step moves a master by at most ~lr)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    on, off = spawn(_offload_job, 1, True, 2, lora_rank)[0], spawn(_offload_job, 1, False, 2, lora_rank)[0]
    assert on["hybrid"] and not off["hybrid"] and on["fp32_params"] == 0
    assert on["moments_on_host"] and not on["gpu_sub_optimizer"]
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-6)  # the same weights
    assert on["losses"][1] == pytest.approx(off["losses"][1], rel=1e-4)  # bf16 weights may round apart by an ulp
    assert abs(on["masters"] - off["masters"]).max() <= 1e-6
    moved = abs(on["masters"] - on["masters_before"]).max()  # the offloaded steps did update the weights
    assert moved > 1e-5, moved
