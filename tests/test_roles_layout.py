"""The same batch gives the same policy loss and gradient norm under every layout.

A fixed batch of 8 sequences (random old log-probs and advantages, ragged
response lengths) goes through one actor update at TP1 (one process), TP2,
PP2 and DP2 (two processes each; DP2 splits the rows in halves). Because each
micro-batch returns (sum of token losses, token count) and megatron-core
divides the summed gradient once by the global count, the loss, and so the
gradient, is the global token mean in every layout: pg_loss and grad_norm
must agree to 1e-5 in fp32. Dynamic (token-budget) micro-batches must agree
with fixed ones. Not covered: CP (Ulysses), interleaved pipelines.
"""
import pytest
import torch

from dist_helpers import spawn

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def fixed_batch(vocab: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(0)
    b, width, prompt = 8, 12, 4
    ids = torch.randint(5, vocab, (b, width), generator=gen)
    lengths = torch.tensor([12, 9, 7, 12, 5, 10, 8, 11])
    mask = torch.zeros(b, width)
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt:n] = 1.0
        ids[i, n:] = 0
    return SampleBatch(ids, mask, lengths, old_logprobs=-torch.rand(b, width, generator=gen) * 4,
                       advantages=torch.randn(b, width, generator=gen))


def _update(rank, ckpt, tp, pp, max_tokens):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(tp, pp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.actor.optim.lr = 0.0
    cfg.actor.micro_batch_size = 2
    cfg.actor.max_tokens_per_micro = max_tokens
    actor = build_actor(cfg, groups, optimizer_steps=2)
    batch = fixed_batch(57)
    rows = len(batch) // groups.dp_size
    batch = batch.select(torch.arange(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
    out = {}
    for loss_agg in AGG_MODES:
        cfg.actor.loss_agg = loss_agg
        (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(rows)], norm_len=8)
        sums = torch.tensor([m["actor/pg_loss"], m["actor/count"]], dtype=torch.float64)
        if groups.dp_size > 1:
            dist.all_reduce(sums, group=groups.dp)
        out[loss_agg] = (float(sums[0] / sums[1]), m["grad_norm"])
    return out


def test_loss_and_grad_norm_match_across_layouts(ckpt):
    (ref,) = spawn(_update, 1, ckpt, 1, 1, 0)
    layouts = {"tp2": (2, 1, 0), "pp2": (1, 2, 0), "dp2": (1, 1, 0), "dp2-dynamic": (1, 1, 24)}
    for name, (tp, pp, max_tokens) in layouts.items():
        for result in spawn(_update, 2, ckpt, tp, pp, max_tokens):
            for mode in AGG_MODES:
                loss, grad_norm = result[mode]
                assert loss == pytest.approx(ref[mode][0], abs=1e-5, rel=1e-5), (name, mode)
                assert grad_norm == pytest.approx(ref[mode][1], abs=1e-5, rel=1e-5), (name, mode)
