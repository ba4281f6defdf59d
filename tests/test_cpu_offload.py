"""actor.optim.cpu_offload / critic.optim.cpu_offload: megatron-core's HybridDeviceOptimizer.

What megatron-core 0.16.1 supports, found by running it:
- it needs the distributed optimizer (megarl passes the DP shards to it);
- every trained parameter must be bf16/fp16: the distributed optimizer hands an
  fp32 parameter over as a non-leaf view of the model's own storage, and the
  offload optimizer's constructor (a ``torch.optim.Optimizer``) raises "can't
  optimize a non-leaf Tensor". fp32 models are therefore refused; a bf16 model's
  weights are all bf16, the local spec's norms included (built in the params
  dtype), so a full fine-tune fits as well as a LoRA actor;
- it needs CUDA: on a CPU-only machine nothing is "on the GPU", the optimizer
  keeps no GPU twin of its parameters and its first step fails (KeyError in
  ``_set_sub_optimizer_grads``). The equality test is therefore a ``gpu`` test.

CPU here: each refused combination is a one-line config error naming the key,
and a bf16 actor (LoRA or full) gets a HybridDeviceOptimizer with the whole shard
offloaded (construction only). GPU: two updates with offload equal two without
(fp32 master weights 1e-6, the moments in host memory, no GPU sub-optimizer), and
an offloaded actor saved after one update and loaded into a fresh one takes the
same second update as the one that went on.
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
])
def test_unsupported_combinations_are_config_errors(change, message):
    from megarl.errors import ConfigError
    from megarl.config_checks import check_actor

    cfg = _cfg()
    change(cfg)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        check_actor(cfg)
    assert "\n" not in str(e.value) and "cpu_offload=false" in str(e.value)


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_offload_fits_a_bf16_actor_and_critic(lora_rank):
    from megarl.errors import ConfigError
    from megarl.config_checks import check_actor, check_critic

    cfg = _cfg()
    cfg.actor.lora.rank = lora_rank
    cfg.critic.enable, cfg.critic.optim.cpu_offload = True, True
    for check, key in ((check_actor, "actor"), (check_critic, "critic")):
        if torch.cuda.is_available():
            check(cfg)
        else:  # on this CPU machine the one thing missing is the GPU
            with pytest.raises(ConfigError, match=f"{key}.optim.cpu_offload=true needs a CUDA device"):
                check(cfg)


def _on_device(batch):
    from dataclasses import fields, replace

    from megarl.distributed import device

    return replace(batch, **{f.name: getattr(batch, f.name).to(device()) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def _actor(offload: bool, lora_rank: int):
    """In a spawned worker: (cfg, groups, a bf16 actor, lr 1e-4, micro-batches of 4)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = _cfg(micro_batch_size=4)
    cfg.actor.optim.cpu_offload, cfg.actor.optim.lr, cfg.actor.lora.rank = offload, 1e-4, lora_rank
    return cfg, groups, build_actor(cfg, groups, 8)


def _offload_job(rank, offload: bool, steps: int, lora_rank: int = 4):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from test_recompute import _batch

    cfg, _, actor = _actor(offload, lora_rank)
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


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_bf16_actor_gets_the_offload_optimizer(lora_rank):
    out = spawn(_offload_job, 1, True, 0, lora_rank)[0]
    assert out["hybrid"] and out["fraction"] == 1.0 and out["fp32_params"] == 0


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


def _resume_job(rank, root):
    """Full fine-tune with offload: update, save, update again; a fresh actor loads and updates."""
    from test_broken_inputs_checkpoint import _checkpointer
    from test_recompute import _batch

    def update(a):
        return a.update(b, cfg.actor, 1.0, [torch.arange(len(b))], norm_len=8)[0]["actor/pg_loss"]

    def masters(a):
        (opt,) = a.trainable.optimizer.chained_optimizers
        return torch.cat([p.detach().reshape(-1).float().cpu() for g in opt.shard_fp32_from_float16_groups
                          for p in g]).numpy()

    cfg, groups, straight = _actor(True, 0)
    b = _on_device(_batch(straight.info.vocab_size))
    update(straight)
    ck = _checkpointer(root, groups)
    ck.save(1, {"actor": straight}, {"step": 1})
    saved = masters(straight)
    losses = [update(straight)]
    _, _, resumed = _actor(True, 0)
    ck.load(1, {"actor": resumed})
    loaded = masters(resumed)
    losses.append(update(resumed))
    return {"saved": saved, "loaded": loaded, "straight": masters(straight), "resumed": masters(resumed),
            "losses": losses}


@pytest.mark.gpu
def test_offloaded_actor_resumes(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = spawn(_resume_job, 1, str(tmp_path))[0]
    assert (out["loaded"] == out["saved"]).all()  # the masters back exactly
    assert out["losses"][1] == pytest.approx(out["losses"][0], rel=1e-6)  # the same weights
    assert abs(out["resumed"] - out["straight"]).max() <= 1e-6  # and the same second step
    assert abs(out["straight"] - out["saved"]).max() > 1e-5
