"""The async weight push: the weights reaching a rollout rank equal the trainer's bitwise.

Ranks: the last ``rollout_tp`` generate (one rollout replica, EP 1, no PP; an MoE copy at TP2 splits each
expert over expert-TP 2, cut from the pushed tensors by the loader) and the others train at
the layout under test: TP1, TP2, PP2 (two senders, one per stage, each its own stage's buckets),
EP2 (each rank 2 of the 4 routed experts; the push gathers the others over EP; also megatron-core's
GroupedMLP in bf16, all local experts in one tensor, received by a bf16 SequentialMLP copy, and the
reverse: a grouped rollout parameter needs every expert of its layer, which the trainer's per-expert
parameters bring over several buckets: the receiver holds them until all have come), TP2 x expert-TP2
(each expert's FFN split over 2 ranks), LoRA on TP2 and on the experts of EP2 (SequentialMLP, and
GroupedMLP in bf16 with stacked adapters; the rollout copy has no adapters: it must receive W + s B A). The training ranks perturb their loaded weights (and the
adapters, so B A is not 0), so the rollout's own copy, loaded from the same checkpoint, differs
before the push (asserted); they push in small buckets (several per push, so bucket boundaries fall
between parameters), and send, from each stage's
writer, the Hugging Face tensors the exporter gathers (``gather_hf_tensors`` + ``gather_expert_tensors``
inside ``merged_lora``, the way ``export_hf`` writes a LoRA actor) to the rollout rank separately. The
rollout rank's own gathered tensors after the push must equal the union of those bitwise, with the
same names (every expert, every stage): every step of the push is a copy (TP / EP / expert-TP
all-gather, merge of QKV / [gate; up] / vocab / expert shards, flat bucket pack / unpack, the loader's
shard cut for its layout) and the merge is the exporter's own function. Qwen2 (QKV bias, tied
embeddings: at PP2 the last stage's copy is not sent), Llama (untied head), Qwen2-MoE (shared expert
and its gate, tied embeddings), Qwen3-MoE (QK norm); vocab 301 (padded differently at TP1 and TP2).

Not covered: GPUs (buckets over NCCL), several rollout replicas.
"""
import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint

CHECK_TAG = 99
LORA = dict(rank=4, alpha=8.0)


def _perturb(module) -> None:
    """The same noise on every TP rank for a given parameter (replicated ones stay replicated)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(module.named_parameters())):
            gen = torch.Generator().manual_seed(1000 + i)
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def _build(path, layout: dict, is_rollout: bool, rollout_tp: int):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.models import ModelOptions, build_gpt_model, load_hf_checkpoint, read_hf_config
    from megarl.models.lora import LoraOptions, apply_lora
    from megarl.roles.build import build_module

    cfg = Config()
    cfg.model.dtype = "bfloat16" if layout.get("grouped") else "float32"
    if is_rollout:
        groups = build_parallel_groups(rollout_tp)
    else:
        groups = build_parallel_groups(layout.get("tp", 1), layout.get("pp", 1), 1, layout.get("ep", 1),
                                       layout.get("etp"))
    model_parallel_cuda_manual_seed(0)
    experts = layout.get("grouped")  # "train" / "rollout": that side's experts as GroupedMLP (CUDA's bf16 path)
    if experts:
        info = read_hf_config(path)
        kind = "grouped" if (experts == "rollout") == is_rollout else "sequential"
        module = build_gpt_model(info, groups, ModelOptions(params_dtype="bf16", moe_experts=kind))
        load_hf_checkpoint(module, path, info, groups)
    else:
        module, info = build_module(path, cfg, groups)
    if layout.get("lora") and not is_rollout:
        apply_lora(module, LoraOptions(**LORA, experts=layout["lora"] == "experts"))
    return module, info, groups


def _hf_tensors(module, info, groups) -> dict:
    """The exporter's HF tensors of this stage on its writer (adapters merged as export_hf merges them)."""
    from megarl.models.exporter import gather_expert_tensors, gather_hf_tensors
    from megarl.models.lora import merged_lora

    with merged_lora(module):
        out = gather_hf_tensors(module, info, groups)
        out.update(gather_expert_tensors(module, info, groups) if info.moe else {})
    return out


def _worker(rank, path, layout, rollout_tp):
    from megarl.distributed.init import init_distributed
    from megarl.distributed.placement import build_placement
    from megarl.models.exporter import gather_hf_tensors
    from megarl.trainer.async_channel import Outbox, recv_object, send_object
    from megarl.trainer.weight_push import WeightPusher, WeightReceiver, push_sources

    init_distributed()
    placement = build_placement(rollout_tp)  # one rollout replica of rollout_tp ranks
    placement.enter()
    module, info, groups = _build(path, layout, placement.is_rollout, rollout_tp)
    ranks = placement.directory({"dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank,
                                 "cp_rank": groups.cp_rank})
    sources = push_sources(ranks)
    writer = groups.tp_rank == groups.dp_rank == 0
    result = None
    if placement.is_rollout:
        before = _hf_tensors(module, info, groups)
        version = WeightReceiver(module, info, groups, placement, sources).receive()
        mine = _hf_tensors(module, info, groups)
        if groups.tp_rank > 0:  # the replica's TP rank 0 holds the gathered tensors
            placement.leave()
            return {"version": version}
        theirs = {k: v for src in sources for k, v in recv_object(placement.objects, src, CHECK_TAG).items()}
        result = {"version": version, "names": sorted(mine) == sorted(theirs),
                  "equal": all(torch.equal(mine[k], theirs[k]) for k in theirs),
                  "differed_before": all(not torch.equal(before[k], theirs[k]) for k in theirs),
                  "tensors": len(theirs)}
    else:
        _perturb(module)
        pusher = WeightPusher(module, info, groups, placement, placement.rollout_ranks, bucket_bytes=20_000)
        metrics = pusher.push(7)
        full = _hf_tensors(module, info, groups)
        unmerged = gather_hf_tensors(module, info, groups)
        if writer:
            outbox = Outbox()
            send_object(placement.objects, full, placement.rollout_ranks[0], CHECK_TAG, outbox)
            outbox.wait()
            merged = sum(not torch.equal(unmerged[k], full[k]) for k in unmerged)  # tensors LoRA changes
            result = {"bytes": metrics["weight_sync/bytes"], "merged": merged}
        pusher.outbox.wait()
    placement.leave()
    return result


CASES = {  # name -> (architecture, training layout, rollout TP)
    "qwen2_tp1": ("Qwen2ForCausalLM", {}, 1),
    "qwen2_tp2": ("Qwen2ForCausalLM", {"tp": 2}, 1),
    "llama_tp2": ("LlamaForCausalLM", {"tp": 2}, 1),
    "llama_to_tp2": ("LlamaForCausalLM", {}, 2),
    "qwen2_pp2": ("Qwen2ForCausalLM", {"pp": 2}, 1),
    "qwen2moe_ep2": ("Qwen2MoeForCausalLM", {"ep": 2, "etp": 1}, 1),
    "qwen2moe_grouped_bf16_ep2": ("Qwen2MoeForCausalLM", {"ep": 2, "etp": 1, "grouped": "train"}, 1),
    "qwen2moe_grouped_lora_experts_bf16_ep2": ("Qwen2MoeForCausalLM", {"ep": 2, "etp": 1, "grouped": "train",
                                                                     "lora": "experts"}, 1),
    "qwen2moe_bf16_ep2_to_grouped": ("Qwen2MoeForCausalLM", {"ep": 2, "etp": 1, "grouped": "rollout"}, 1),
    "qwen3moe_ep2_to_tp2": ("Qwen3MoeForCausalLM", {"ep": 2, "etp": 1}, 2),
    "qwen3moe_tp2_etp2": ("Qwen3MoeForCausalLM", {"tp": 2, "etp": 2}, 1),
    "llama_lora_tp2": ("LlamaForCausalLM", {"tp": 2, "lora": "dense"}, 1),
    "qwen2moe_lora_experts_ep2": ("Qwen2MoeForCausalLM", {"ep": 2, "etp": 1, "lora": "experts"}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pushed_weights_equal_trainer(tmp_path, case):
    from megarl.models.hf_config import read_hf_config
    from megarl.models.weight_map import expected_hf_names

    arch, layout, rollout_tp = CASES[case]
    make_tiny_checkpoint(str(tmp_path), arch, seed=4, vocab_size=301)
    train = layout.get("tp", 1) * layout.get("pp", 1) * (2 if layout.get("ep", 1) > 1 else 1)
    results = spawn(_worker, train + rollout_tp, str(tmp_path), layout, rollout_tp)
    rollout = results[train]  # the rollout replica's TP rank 0
    expected = len(expected_hf_names(read_hf_config(str(tmp_path))))
    assert rollout == {"version": 7, "names": True, "equal": True, "differed_before": True, "tensors": expected}
    assert all(r == {"version": 7} for r in results[train + 1:])
    senders = [results[0]] + ([results[1]] if layout.get("pp", 1) > 1 else [])
    assert all(s["bytes"] > 20_000 * 3 for s in senders)  # several buckets of ~20 kB, all stages counted
    assert len({s["bytes"] for s in senders}) == 1
    assert (senders[0]["merged"] > 0) == bool(layout.get("lora"))  # a merge that changed nothing proves nothing
