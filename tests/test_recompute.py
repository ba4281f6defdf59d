"""Activation recompute (actor.recompute / critic.recompute) changes memory, never numbers.

Recompute runs a forward again inside backward from the inputs it kept
(megatron-core's reentrant ``CheckpointFunction``, RNG states restored). On
the CPU in fp32 the recomputed forward is the same sequence of kernels on the
same inputs, so its activations are bitwise the saved ones and the backward
that reads them is bitwise the same: the actor update's loss, grad norm and
every entry of the gradient buffer are asserted *equal* for none / selective
/ full, at TP1 and TP2, packed (THD) and padded micro-batches. The test also
counts forward calls, so a recompute setting that is silently ignored fails:
with M micro-batches and L layers, core attention runs L*M times (none),
2*L*M (selective: once more in backward) and the layers run 2*L*M times (full).

LoRA + full recompute: the embedding is frozen, so without
:func:`~megarl.roles.build.keep_layer_inputs_differentiable` the first
checkpoint's input would not require grad and the adapters would get none
(megatron's reentrant checkpoint only follows inputs); with it the adapters'
gradients equal those without recompute, bitwise, and are non-zero.

Forward-only roles (reference) are built without recompute whatever the actor's
setting. Not covered: the TE spec, PP > 1 stages, bf16 on the GPU (the
benchmark measures memory there).
"""
import pytest
import torch

from dist_helpers import spawn

LENGTHS = [12, 9, 12, 7, 5, 11, 6, 3]
MICRO = 2  # 4 micro-batches of 2 sequences
LAYERS = 4  # the tiny checkpoint's


def _batch(vocab: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(0)
    b, width, prompt = len(LENGTHS), max(LENGTHS), 2
    ids = torch.randint(5, vocab, (b, width), generator=gen)
    mask = torch.zeros(b, width)
    for i, n in enumerate(LENGTHS):
        mask[i, prompt:n] = 1.0
        ids[i, n:] = 0
    return SampleBatch(ids, mask, torch.tensor(LENGTHS), old_logprobs=-torch.rand(b, width, generator=gen) * 4,
                       advantages=torch.randn(b, width, generator=gen))


def _count_calls(module) -> dict:
    """Forward calls of every layer and every core attention, counted by pre-hooks."""
    calls = {"layer": 0, "core_attn": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1
        return hook

    for layer in module.decoder.layers:
        layer.register_forward_pre_hook(counter("layer"))
        layer.self_attention.core_attention.register_forward_pre_hook(counter("core_attn"))
    return calls


def _update(cfg, groups, recompute: str, lora: int, packing: bool) -> dict:
    """One actor update (lr 0, no clipping: the gradient buffer is the raw gradient)."""
    from dataclasses import replace

    from megarl.roles.build import build_actor

    cfg.actor.recompute, cfg.actor.lora.rank = recompute, lora
    actor = build_actor(cfg, groups, 4)
    actor.options = replace(actor.options, packing=packing)
    calls = _count_calls(actor.module)
    batch = _batch(actor.info.vocab_size)
    (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(len(batch))], norm_len=8)
    grads = torch.cat([b.grad_data.detach().reshape(-1) for b in actor.trainable.model.buffers])
    c = actor.module.config
    return {"loss": m["actor/pg_loss"], "grad_norm": m["grad_norm"], "grads": grads.numpy().copy(),
            "calls": dict(calls), "megatron": (c.recompute_granularity, c.recompute_method, c.recompute_num_layers)}


def _job(rank, tp: int, cases: list):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_critic, build_reference

    init_distributed()
    groups = build_parallel_groups(tp, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.actor.optim.lr, cfg.actor.optim.clip_grad = 0.0, 0.0
    cfg.actor.micro_batch_size = MICRO
    cfg.actor.lora.alpha = 8.0
    out = {case: _update(cfg, groups, *case) for case in cases}
    cfg.actor.recompute, cfg.critic.recompute = "full", "selective"
    out["ref_granularity"] = build_reference(cfg, groups).module.config.recompute_granularity
    out["critic_granularity"] = build_critic(cfg, groups, 4).module.config.recompute_granularity
    return out


PACKED = [(r, 0, True) for r in ("none", "selective", "full")] + [("none", 4, True), ("full", 4, True)]
CASES = PACKED + [(r, 0, False) for r in ("none", "selective", "full")]


def _check(out: dict, packings=(True, False)) -> None:
    mbs = len(LENGTHS) // MICRO
    assert out[("selective", 0, True)]["megatron"] == ("selective", None, None)
    assert out[("full", 0, True)]["megatron"] == ("full", "uniform", 1)
    assert out[("none", 0, True)]["megatron"] == (None, None, None)
    assert out["ref_granularity"] is None and out["critic_granularity"] == "selective"
    for packing in packings:
        base = out[("none", 0, packing)]
        assert base["calls"] == {"layer": LAYERS * mbs, "core_attn": LAYERS * mbs}
        assert out[("selective", 0, packing)]["calls"] == {"layer": LAYERS * mbs, "core_attn": 2 * LAYERS * mbs}
        assert out[("full", 0, packing)]["calls"] == {"layer": 2 * LAYERS * mbs, "core_attn": 2 * LAYERS * mbs}
        assert abs(base["grads"]).max() > 0
        for r in ("selective", "full"):
            got = out[(r, 0, packing)]
            assert (got["loss"], got["grad_norm"]) == (base["loss"], base["grad_norm"]), (r, packing)
            assert (got["grads"] == base["grads"]).all(), (r, packing, abs(got["grads"] - base["grads"]).max())
    lora, lora_full = out[("none", 4, True)], out[("full", 4, True)]
    assert lora["grads"].size < out[("none", 0, True)]["grads"].size / 10  # only the adapters have gradient buffers
    assert abs(lora["grads"]).max() > 0 and (lora_full["grads"] == lora["grads"]).all()
    assert lora_full["loss"] == lora["loss"]


def test_recompute_equal_gradients_tp1():
    _check(spawn(_job, 1, 1, CASES)[0])


def test_recompute_equal_gradients_tp2():
    """Each TP rank holds its own shard of the gradient buffer; rank 1's is checked too (packed
    micro-batches only, to keep CI short: padded ones take the same recompute path at TP1)."""
    for out in spawn(_job, 2, 2, PACKED):
        _check(out, packings=(True,))


def test_recompute_is_a_config_key():
    from megarl.errors import ConfigError
    from megarl.cli import load_config
    from megarl.config import Config

    cfg = load_config(["actor.recompute=full", "critic.recompute=selective"], Config)
    assert (cfg.actor.recompute, cfg.critic.recompute) == ("full", "selective")
    with pytest.raises(ConfigError, match="actor.recompute"):
        load_config(["actor.recompute=block"], Config)
