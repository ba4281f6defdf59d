"""The async weight push: the weights reaching a rollout rank equal the trainer's bitwise.

Ranks: the last one generates (TP1) and the others train (TP1, or TP2 over 2 ranks); or one rank
trains and the last two generate at TP2 (the rollout's own TP layout cut from the pushed tensors,
gathered back over its TP group for the comparison). The training
ranks perturb their loaded weights (so the rollout's own copy, loaded from the same checkpoint,
differs before the push: asserted), push them in small buckets (several per push, so bucket
boundaries fall between parameters), and send the Hugging Face tensors they gather
(``gather_hf_tensors``, the exporter's merge) to the rollout rank separately. The rollout rank's
own gathered tensors after the push must equal those bitwise: every step of the push is a copy
(TP all-gather, merge of QKV / [gate; up] / vocab shards, flat bucket pack / unpack, the loader's
shard cut for its TP size). Qwen2 (QKV bias, tied embeddings) and Llama (untied head), vocab 301
(padded differently at TP1 and TP2), 2 query groups (one per rank at TP2).

Not covered: GPUs (buckets over NCCL), bf16, several rollout replicas.
"""
import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint

CHECK_TAG = 99


def _perturb(module) -> None:
    """The same noise on every TP rank for a given parameter (replicated ones stay replicated)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(module.named_parameters())):
            gen = torch.Generator().manual_seed(1000 + i)
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def _worker(rank, path, train_tp, rollout_tp):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.distributed.init import init_distributed
    from megarl.distributed.placement import build_placement
    from megarl.models.exporter import gather_hf_tensors
    from megarl.roles.build import build_module
    from megarl.trainer.async_channel import Outbox, recv_object, send_object
    from megarl.trainer.weight_push import WeightPusher, WeightReceiver

    init_distributed()
    placement = build_placement(rollout_tp)  # one rollout replica of rollout_tp ranks
    placement.enter()
    cfg = Config()
    groups = build_parallel_groups(rollout_tp if placement.is_rollout else train_tp)
    model_parallel_cuda_manual_seed(0)
    module, info = build_module(path, cfg, groups)
    ranks = placement.directory({"tp_rank": groups.tp_rank})
    source = next(r["rank"] for r in ranks if r["role"] == "train" and r["tp_rank"] == 0)
    result = None
    if placement.is_rollout:
        before = gather_hf_tensors(module, info, groups)
        version = WeightReceiver(module, info, groups, placement, source).receive()
        mine = gather_hf_tensors(module, info, groups)
        if groups.tp_rank > 0:  # the replica's TP rank 0 holds the gathered tensors
            placement.leave()
            return {"version": version}
        theirs = recv_object(placement.objects, source, CHECK_TAG)
        result = {"version": version, "names": sorted(mine) == sorted(theirs),
                  "equal": all(torch.equal(mine[k], theirs[k]) for k in theirs),
                  "differed_before": all(not torch.equal(before[k], theirs[k]) for k in theirs)}
    else:
        _perturb(module)
        pusher = WeightPusher(module, info, groups, placement, placement.rollout_ranks, bucket_bytes=20_000)
        metrics = pusher.push(7)
        full = gather_hf_tensors(module, info, groups)
        if groups.tp_rank == 0:
            outbox = Outbox()
            send_object(placement.objects, full, placement.rollout_ranks[0], CHECK_TAG, outbox)
            outbox.wait()
            result = {"bytes": metrics["weight_sync/bytes"]}
        pusher.outbox.wait()
    placement.leave()
    return result


@pytest.mark.parametrize("arch, train_tp, rollout_tp", [("Qwen2ForCausalLM", 1, 1), ("Qwen2ForCausalLM", 2, 1),
                                                        ("LlamaForCausalLM", 2, 1), ("LlamaForCausalLM", 1, 2)])
def test_pushed_weights_equal_trainer(tmp_path, arch, train_tp, rollout_tp):
    make_tiny_checkpoint(str(tmp_path), arch, seed=4, vocab_size=301)
    results = spawn(_worker, train_tp + rollout_tp, str(tmp_path), train_tp, rollout_tp)
    rollout = results[train_tp]  # the rollout replica's TP rank 0
    assert rollout == {"version": 7, "names": True, "equal": True, "differed_before": True}
    assert all(r == {"version": 7} for r in results[train_tp + 1:])
    sender = results[0]
    assert sender["bytes"] > 20_000 * 3  # several buckets of ~20 kB
