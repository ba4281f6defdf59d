"""The engine on CUDA: decode graphs equal eager decoding, see weight updates, and refuse moved weights.

On a random Qwen2-shaped checkpoint (bf16): greedy responses with CUDA graphs
(the prefill's included: 32 prompts, 1,024 tokens in all, fill a prefill
bucket exactly) equal eager responses token for token (same kernels, same inputs);
a padded prefill's first tokens equal eager's up to bf16 rounding; after an
in-place change of the weights (what the optimizer does), the already
captured graphs decode with the new weights — equal to eager again; a
re-allocated parameter makes ``update_weights`` raise instead of decoding
stale weights (32 prompts that all decode 48 tokens: every decode batch is a
bucket size, so graph and eager run the same GEMM shapes). With 8 slots the same
prompts run in 4 waves, each refill launched before the last decode's tokens are
read (its tokens fed to the next decode on the device): equal to eager too; and refills that
carry the running sequences' decode rows (mixed steps, their tokens still on the device). The bf16
rollout-vs-training log-prob gap is measured (not bitwise: the training forward
uses other kernels). Skipped without CUDA.
"""
import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=512, vocab_size=1000, max_position_embeddings=512)


def _run(rank, ckpt, lora=False):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path, cfg.model.dtype = ckpt, "bfloat16"
    if lora:
        cfg.actor.lora.rank = 8
    actor = build_actor(cfg, groups, optimizer_steps=1)
    if lora:  # non-zero adapters: the decode reads x A^T B^T beside each linear
        with torch.no_grad():
            for name, p in actor.module.named_parameters():
                if name.endswith("lora_b"):
                    p.copy_(torch.randn_like(p) * 0.05)
    make = lambda graphs: NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0,  # noqa: E731
                                       EngineOptions(max_batch=64, cuda_graphs=graphs, max_model_len=160))
    graphed, eager = make(True), make(False)
    g = torch.Generator().manual_seed(0)
    lengths = [32] * 32  # 1,024 prompt tokens of 32 prompts: a prefill graph's bucket exactly (same GEMMs)
    for i, d in enumerate(torch.randint(-20, 21, (16,), generator=g).tolist()):
        lengths[2 * i] += d
        lengths[2 * i + 1] -= d
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]
    greedy, one_each = SamplingParams(temperature=0.0), sample_requests(prompts, 1, 0, 48)
    out = {"graph": [r.response_ids for r in graphed.generate(one_each, greedy)],
           "eager": [r.response_ids for r in eager.generate(one_each, greedy)],
           "graph_steps": graphed.stats["rollout/graph_steps"],
           "prefill_graph_steps": graphed.stats["rollout/prefill_graph_steps"]}
    if not lora:  # 32 prompts of 32 tokens on 8 slots: refills of 256 tokens (a bucket), decode batches of 8
        slots = lambda graphs: NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0,  # noqa: E731
                                            EngineOptions(max_batch=8, cuda_graphs=graphs, max_model_len=160))
        waves = sample_requests([torch.randint(5, 1000, (32,), generator=g).tolist() for _ in range(32)], 1, 0, 48)
        refilled = slots(True)
        out["waves_graph"] = [r.response_ids for r in refilled.generate(waves, greedy)]
        out["waves_eager"] = [r.response_ids for r in slots(False).generate(waves, greedy)]
        out["refills_ahead"] = refilled.stats["rollout/planned_ahead_prefills"]
        # mixed steps: 4 of 8 slots free at tokens 16 and 32; each refill of 4 prompts of 15 tokens
        # carries the 4 running rows (64 tokens, 8 rows: a bucket exactly, so eager runs the same GEMMs)
        prompts_15 = [torch.randint(5, 1000, (15,), generator=g).tolist() for _ in range(8)]
        mixed = sample_requests([w.prompt for w in waves[:8]] + prompts_15, 1, 0, [16] * 4 + [48] * 4 + [16] * 8)
        mixed_graph = slots(True)
        out["mixed_graph"] = [r.response_ids for r in mixed_graph.generate(mixed, greedy)]
        out["mixed_eager"] = [r.response_ids for r in slots(False).generate(mixed, greedy)]
        out["mixed_steps"] = mixed_graph.stats["rollout/mixed_steps"]
        out["mixed_ahead"] = mixed_graph.stats["rollout/planned_ahead_prefills"]
    # a padded prefill (19 prompts, ~550 tokens -> the 640-token, 24-row graph) against eager: first tokens
    padded = sample_requests([p[:-3] for p in prompts[:19]], 1, 0, 1)
    first = [graphed.generate(padded, greedy), eager.generate(padded, greedy)]
    out["padded_first"] = [[(r.response_ids[0], r.logprobs[0]) for r in side] for side in first]
    with torch.no_grad():  # an optimizer step, as far as the graphs can tell
        for p in actor.module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    graphed.update_weights()
    graphed.release_memory()  # the pinned KV cache gives its memory back, keeps its address
    out["graph_after"] = [r.response_ids for r in graphed.generate(one_each, greedy)]
    out["eager_after"] = [r.response_ids for r in eager.generate(one_each, greedy)]
    sampled = graphed.generate(sample_requests(prompts, 2, 5, 48), SamplingParams(temperature=1.0))
    batch = to_sample_batch(sampled, 0, "cuda")
    train = actor.logprobs(batch, micro_batch_size=16, temperature=1.0)["logprobs"]
    gap = (train - batch.rollout_logprobs).abs()[batch.response_mask > 0]
    out["gap_mean"], out["gap_max"] = float(gap.mean()), float(gap.max())
    p = next(actor.module.parameters())
    p.data = p.data.clone()  # moved: the graphs would read the old address
    try:
        graphed.update_weights()
        out["moved_raises"] = False
    except RuntimeError:
        out["moved_raises"] = True
    return out


def test_graphs_equal_eager_and_follow_in_place_weight_updates(tmp_path):
    make_tiny_checkpoint(str(tmp_path), "Qwen2ForCausalLM", seed=3, **SHAPE)
    (r,) = spawn(_run, 1, str(tmp_path))
    assert r["graph_steps"] > 0 and r["prefill_graph_steps"] > 0
    assert r["graph"] == r["eager"]
    assert r["refills_ahead"] >= 3 and r["waves_graph"] == r["waves_eager"]
    assert r["mixed_steps"] == 2 and r["mixed_ahead"] >= 1 and r["mixed_graph"] == r["mixed_eager"]
    # padded to its bucket the prefill runs other GEMM shapes than eager: bf16 rounding apart, the same
    graph_first, eager_first = r["padded_first"]
    same = sum(g[0] == e[0] for g, e in zip(graph_first, eager_first))
    gap = max(abs(g[1] - e[1]) for g, e in zip(graph_first, eager_first) if g[0] == e[0])
    print(f"padded prefill graph vs eager: {same}/{len(graph_first)} first tokens equal, log-prob gap {gap:.2e}")
    assert same >= len(graph_first) - 2 and gap < 0.05
    assert r["graph_after"] == r["eager_after"] and r["graph_after"] != r["graph"]
    assert r["moved_raises"]
    print(f"bf16 rollout-vs-training |log-prob gap|: mean {r['gap_mean']:.2e} max {r['gap_max']:.2e}")
    # bf16 logits of a random model with large weights: ~4e-2 measured (H200, 2026-12-01); tokens
    # fed wrongly (the graphs' device-side inputs) would put the gap at several nats
    assert r["gap_mean"] < 0.1


def test_lora_adapters_in_graphs_equal_eager_and_follow_their_updates(tmp_path):
    make_tiny_checkpoint(str(tmp_path), "Qwen2ForCausalLM", seed=3, **SHAPE)
    (r,) = spawn(_run, 1, str(tmp_path), True)
    assert r["graph_steps"] > 0 and r["graph"] == r["eager"]
    assert r["graph_after"] == r["eager_after"] and r["graph_after"] != r["graph"]
    print(f"LoRA, bf16 rollout-vs-training |log-prob gap|: mean {r['gap_mean']:.2e} max {r['gap_max']:.2e}")
    assert r["gap_mean"] < 0.1


def test_pinned_buffer_gives_memory_back_and_keeps_its_address():
    from megarl.rollout.vmm import PinnedAddressBuffer

    size = 1 << 30
    buf = PinnedAddressBuffer(size, torch.device("cuda", 0))
    t = buf.view((size // 4,), torch.float32)
    t.fill_(3.0)
    assert float(t[-1]) == 3.0
    free_mapped, _ = torch.cuda.mem_get_info()
    buf.unmap()
    free_unmapped, _ = torch.cuda.mem_get_info()
    assert free_unmapped - free_mapped >= size * 0.99
    buf.map()
    assert buf.view((size // 4,), torch.float32).data_ptr() == t.data_ptr()
    t.fill_(5.0)
    assert float(t.sum()) == 5.0 * (size // 4)
