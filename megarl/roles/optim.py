"""A trainable megatron-core model: DDP wrapper, optimizer and LR schedule.

megatron-core's ``DistributedDataParallel`` keeps gradients in contiguous
buffers and reduces them over dp x cp; its ``DistributedOptimizer`` shards
Adam state over the same ranks; ``OptimizerParamScheduler`` drives warmup and
constant / cosine decay.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarl.config import OptimConfig
from megarl.distributed import ParallelGroups, device
from megarl.roles import apex_free


@dataclass
class Trainable:
    """A DDP-wrapped model with its optimizer and scheduler."""

    model: DistributedDataParallel
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: OptimizerParamScheduler
    loss_scaled: bool = False  # fp16: megatron's grad scaler checks the gradients itself

    @property
    def chunks(self) -> list:
        return [self.model]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, loss_finite: bool = True) -> dict:
        """Optimizer step after the backward passes; returns grad norm, LR and flags.

        The schedule already ran ``finalize_model_grads`` (DP reduction, tied
        embeddings across PP, division by the global loss normalizer).

        Guard: when ``loss_finite`` is False or a gradient is not finite, on any
        rank, every rank skips the update alike: the gradients are zeroed and
        ``optimizer.step()`` is not called, so parameters and Adam moments stay
        bitwise unchanged, and the LR schedule does not advance
        (``nonfinite`` = 1). megatron-core skips by itself only under fp16 loss
        scaling (``found_inf``; then ``update_ok`` = 0, ``nonfinite`` = 0, and
        the loss scale backs off); under bf16 / fp32 its ``step()`` clips by a
        NaN norm and Adam writes NaN into parameters and moments.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        live = _allocated_gb()
        if not self._all_finite(loss_finite):
            self.zero_grad()
            return {"grad_norm": 0.0, "lr": lr, "update_ok": 0.0, "nonfinite": 1.0, **live}
        ok, grad_norm, _ = self.optimizer.step()
        if ok:  # as megatron's training loop: no schedule step for a skipped fp16 update
            self.scheduler.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        return {"grad_norm": float(grad_norm or 0.0), "lr": lr, "update_ok": float(bool(ok)), "nonfinite": 0.0, **live}

    def _all_finite(self, loss_finite: bool) -> bool:
        """The loss and every gradient finite on every rank (one MAX all-reduce over the world).

        Each rank checks its whole grad buffer: reduced or not, a non-finite local
        entry makes the DP-reduced one non-finite too, so the OR over ranks is
        "the reduced gradient has a non-finite entry" for any layout.
        """
        bad = [torch.tensor(not loss_finite, device=device())]
        if not self.loss_scaled:
            bad += [nonfinite(b.grad_data) for b in self.model.buffers + self.model.expert_parallel_buffers]
        flag = torch.stack([b.to(device(), torch.float32) for b in bad]).max().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0


def _allocated_gb() -> dict[str, float]:
    """On CUDA, ``memory_before_step_gb``: what is allocated once the backward passes are done and before the
    optimizer step (weights, grad buffers, master weights, Adam state once made, the reference, the batch;
    activations of a micro-batch still alive here are a leak) and cuBLAS's workspaces (one per stream that ran a
    GEMM, 32 MiB each on Hopper: a fresh process and a resumed one differ by a few); {} on CPU."""
    return {"memory_before_step_gb": torch.cuda.memory_allocated() / 2**30} if torch.cuda.is_available() else {}


CHECK_CHUNK = 1 << 26  # elements isfinite reads at once: a 64 MiB bool temporary, not one the buffer's size


def nonfinite(grad: torch.Tensor) -> torch.Tensor:
    """0-dim bool: some entry of the 1-D ``grad`` is NaN or inf, checked chunk by chunk on the device."""
    chunks = grad.split(CHECK_CHUNK)
    return torch.stack([~torch.isfinite(c).all() for c in chunks]).any() if chunks else torch.tensor(False)


def wrap_ddp(module, groups: ParallelGroups, distributed_optimizer: bool) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    return DistributedDataParallel(
        module.config, ddp_config, module, pg_collection=groups.collection
    )


def build_trainable(module, groups: ParallelGroups, optim: OptimConfig, total_steps: int,
                    distributed_optimizer: bool = True) -> Trainable:
    """Wraps ``module`` (a megatron-core model on this rank) for training."""
    module.config.calculate_per_token_loss = True  # read by DDP: sum, don't average
    model = wrap_ddp(module, groups, distributed_optimizer)
    apex_free.fuse_wgrad(module)  # after DDP: needs each weight's main_grad
    dtype = module.config.params_dtype
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed_optimizer,
        **_cpu_offload(optim.cpu_offload),
    )
    optimizer = get_megatron_optimizer(
        config, [model], use_gloo_process_groups=False, pg_collection=groups.collection
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if optim.decay == "cosine" else optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
        lr_decay_style="cosine" if optim.decay == "cosine" else "constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    _sum_losses_then_normalize(module.config, groups, optimizer)
    if torch.cuda.is_available() and not optim.cpu_offload:
        _fused_adam(optimizer)
    if optim.cpu_offload:
        _offload_masters_are_fp32(optimizer)
    return Trainable(model, optimizer, scheduler, loss_scaled=dtype == torch.float16)


def inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (chained, distributed) wrappers."""
    return [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _fused_adam(optimizer) -> None:
    """torch's single-kernel AdamW for the fp32 master shards on CUDA. Without apex or
    transformer-engine megatron-core falls back to ``torch.optim.AdamW`` with its default
    multi-tensor ("foreach") step; the fused step is the same update in fewer passes over the
    master weights and moments. Set before any state exists, so the step counters are created on
    the device as the fused kernel needs (checkpoint loads move them there too)."""
    for opt in inner_optimizers(optimizer):
        if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and not opt.state:
            for group in opt.param_groups:
                if all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                    group.update(fused=True, foreach=False)


def _cpu_offload(enabled: bool) -> dict:
    """megatron-core's optimizer CPU offload, all of it (fraction 1): HybridDeviceOptimizer
    copies this rank's fp32 master shard to pinned host memory, runs torch's fused AdamW there
    (moments in host memory) and copies the updated shard back; the GPU keeps the weights, the
    grad buffer and the master shard. Synchronous copies (no side streams)."""
    if not enabled:
        return {}
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=False)


def _hybrid_optimizers(optimizer) -> list:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return [o for o in inner_optimizers(optimizer) if isinstance(o, HybridDeviceOptimizer)]


def _offload_masters_are_fp32(optimizer) -> None:
    """megatron-core 0.16.1 builds its HybridDeviceOptimizer with ``param_update_in_fp32=True``
    (keep fp32 copies of half-precision parameters). Under the distributed optimizer its
    parameters are the fp32 master shards, so it makes no copies, yet its load hook looks one up
    for every parameter: every checkpoint load raised KeyError (on the GPU). With the flag
    off for parameters that are fp32 already the update is the same; `resync_offloaded_masters`
    then does what the flag's aliasing did on a load."""
    for hdo in _hybrid_optimizers(optimizer):
        if not hdo.param_to_fp32_param:
            hdo.param_update_in_fp32 = hdo.defaults["param_update_in_fp32"] = False


@torch.no_grad()
def resync_offloaded_masters(optimizer) -> None:
    """After a checkpoint load: the host copies that the offloaded AdamW steps take the loaded
    master shards. megatron-core's load writes the masters on the GPU after its load hook has
    cloned the host copies from them, and (dp_reshardable format) does not copy them over again;
    the moments are loaded in place into the tensors the host optimizer holds."""
    for hdo in _hybrid_optimizers(optimizer):
        for master, host in hdo.gpu_params_map_cpu_copy.items():
            host.copy_(master)


def _sum_losses_then_normalize(config, groups: ParallelGroups, optimizer) -> None:
    """Gradients are summed over micro-batches and DP ranks, then divided once.

    Loss functions return ``(sum of losses, count, metrics)``; megatron-core's
    schedule adds the counts, ``finalize_model_grads`` all-reduces them over
    dp x cp and divides every gradient by the total. The gradient is then that
    of the global mean, whatever the TP / PP / DP layout or micro-batch split.
    """
    assert config.calculate_per_token_loss
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=groups.collection)
    config.grad_scale_func = optimizer.scale_loss
