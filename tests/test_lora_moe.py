"""LoRA on a mixture of experts (megarl/models/lora.py, actor.lora.experts), CPU fp32, 2 processes.

The tiny Qwen2-MoE (4 experts, top-2, a shared expert with its sigmoid gate) is the actor with
rank-4 adapters on every linear: the routed experts' fc1 / fc2 included (``experts``: one A / B
pair per expert) or not, the experts as SequentialMLP (CPU's "auto") or GroupedMLP
(model.moe_experts=grouped: stacked adapters in grouped GEMMs, run in fp32 on CPU). Two actor
updates (Adam, lr 1e-3) on a fixed batch (tests/test_models_moe_training.py's) at EP1 (DP2, every
rank all 4 experts) and EP2 (2 experts per rank):
- B = 0 at the start, so the adapted model's logits equal the plain model's exactly;
- an update changes adapters only: base weights (experts, router, attention) stay bitwise, and
  without ``experts`` no expert carries an adapter; with it, expert adapters do move;
- EP2 equals EP1, with either module, and GroupedMLP equals SequentialMLP: the updates' losses and
  every adapter, by global expert (1e-6). Each expert's A comes from its own (layer, global
  expert) stream and its adapters reduce over expert-DP, so the layouts draw and train the same
  numbers;
- a checkpoint saved at EP2 after update 1 (adapters and Adam state) resumes at EP2 (either module), and update 2
  gives the loss and adapters of the uninterrupted update 2 exactly; its model (the adapters, each
  expert's by global index) read at EP1, by SequentialMLP and by GroupedMLP, equals EP2's after
  update 1 exactly;
- the native engine's sampled log-probs equal the training forward's (1e-5) and its greedy tokens
  are the training forward's argmax: expert adapters merged into its stacked expert copy (for
  GroupedMLP too, which otherwise runs on views: a GroupedMLP run without expert adapters checks
  that path), the shared expert's run unmerged;
- the HF export (adapters merged, W + s B A) loads in ``transformers`` and gives the adapted
  model's logits (1e-5).
Not covered: resuming the optimizer at another EP size (megatron-core chains a separate expert
optimizer at EP > 1, so the saved optimizer state has another structure), GroupedMLP in bf16 on a
GPU, TP / ETP > 1 (MoE training at TP needs sequence parallelism, which LoRA refuses), PP.
"""
import os

import pytest
import torch

from dist_helpers import spawn
from test_models_moe_training import fixed_batch

LORA = dict(rank=4, alpha=8.0)


def _actor(ckpt, ep, experts, kind="auto"):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups
    from megarl.roles.build import build_actor

    groups = build_parallel_groups(tp=1, pp=1, ep=ep, etp=1 if ep > 1 else None)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.model.moe_experts = kind
    cfg.parallel.ep = ep
    cfg.actor.optim.lr = 1e-3
    cfg.actor.micro_batch_size = 2
    cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.experts = LORA["rank"], LORA["alpha"], experts
    return build_actor(cfg, groups, optimizer_steps=2), groups, cfg


def _update(actor, groups, cfg) -> float:
    import torch.distributed as dist

    batch = fixed_batch(300)
    rows = len(batch) // groups.dp_size
    batch = batch.select(torch.arange(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
    (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(rows)], norm_len=8)
    sums = torch.tensor([m["actor/pg_loss"], m["actor/count"]], dtype=torch.float64)
    dist.all_reduce(sums, group=groups.dp)
    return float(sums[0] / sums[1])


def _adapters(module, groups) -> dict:
    """{name with the global expert index: adapter tensor (numpy)} of the whole EP group."""
    import torch.distributed as dist

    local = {}
    for name, p in module.named_parameters():
        if "lora_" not in name:
            continue
        parts, first = name.split("."), groups.ep_rank * (4 // groups.ep_size)
        if "local_experts" in parts:
            at = parts.index("local_experts")
            parts[at:at + 2] = ["experts", str(first + int(parts[at + 1]))]
        elif ".mlp.experts.lora_" in name:  # GroupedMLP: lora_fcK.lora_x (E_local, ...) -> per expert
            at = parts.index("experts") + 1
            for i, value in enumerate(p.detach()):
                expert = parts[:at] + ["experts", str(first + i), "linear_" + parts[at][len("lora_"):], parts[-1]]
                local[".".join(q for q in expert if q != "module")] = value.clone().numpy()
            continue
        local[".".join(q for q in parts if q != "module")] = p.detach().clone().numpy()
    every = [None] * groups.ep_size
    dist.all_gather_object(every, local, group=groups.ep)
    return {k: v for part in every for k, v in part.items()}


def _logits(module, groups, info):
    from megarl.models import forward_logits

    ids = (torch.arange(14).reshape(2, 7) * 37 + 5) % 300
    return forward_logits(module.eval(), groups, ids, torch.arange(7).expand(2, 7), vocab_size=info.vocab_size)


def _rollout_gap(actor, groups) -> float:
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    prompts = [[7, 8, 9, 10, 11, 12], list(range(20, 33))]
    sampled = engine.generate(sample_requests(prompts, 2, 100 + groups.dp_rank, 6), SamplingParams(temperature=0.8))
    batch = to_sample_batch(sampled, 0, "cpu")
    train = actor.logprobs(batch, micro_batch_size=4, temperature=0.8)["logprobs"]
    return float(((train - batch.rollout_logprobs).abs() * batch.response_mask).max())


def _greedy_mismatches(actor, groups) -> int:
    """Greedy engine tokens that are not the argmax of the training forward's logits at their position."""
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.001)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    prompts = [[7, 8, 9, 10, 11, 12], list(range(20, 33))]
    batch = to_sample_batch(engine.generate(sample_requests(prompts, 1, 0, 6), SamplingParams(temperature=0.0)),
                            0, "cpu")
    ids = batch.input_ids
    logits = _logits_of(actor.module, groups, actor.info, ids)  # (B, L, V)
    predicted = torch.cat([ids[:, :1], logits[:, :-1].argmax(-1)], dim=1)  # token t as argmax at t - 1
    return int(((predicted != ids) & batch.response_mask.bool()).sum())


def _logits_of(module, groups, info, ids):
    from megarl.models import forward_logits

    return forward_logits(module.eval(), groups, ids, torch.arange(ids.shape[1]).expand_as(ids),
                          vocab_size=info.vocab_size)


def _job(rank, ckpt, ep, experts, run_dir, resume=False, ep2_step1=None, kind="auto"):
    from megarl.distributed import init_distributed
    from megarl.models import export_hf
    from megarl.models.lora import merged_lora
    from megarl.models.mcore_ckpt import load_training_model
    from megarl.roles.build import build_module
    from megarl.trainer.checkpoint import Checkpointer

    init_distributed()
    actor, groups, cfg = _actor(ckpt, ep, experts, kind)
    checkpoints = Checkpointer(run_dir, keep_last=1)
    out = {}
    if resume:
        checkpoints.load(1, {"actor": actor})
    else:
        plain, info = build_module(ckpt, cfg, groups)
        out["init_is_base"] = bool(torch.equal(_logits(actor.module, groups, actor.info), _logits(plain, groups, info)))
        before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
        out["loss1"] = _update(actor, groups, cfg)
        out["changed"] = sorted(n for n, p in actor.module.named_parameters() if not torch.equal(p, before[n]))
        out["lora_names"] = sorted(n for n, _ in actor.module.named_parameters() if "lora_" in n)
        out["adapters1"] = _adapters(actor.module, groups)
        checkpoints.save(1, {"actor": actor}, {"step": 1})
    out["loss2"] = _update(actor, groups, cfg)
    out["adapters"] = _adapters(actor.module, groups)
    if not resume:
        out["rollout_gap"] = _rollout_gap(actor, groups)
        out["greedy_mismatches"] = _greedy_mismatches(actor, groups)
        out["logits"] = _logits(actor.module, groups, actor.info).numpy()
        with merged_lora(actor.module):
            export_hf(actor.module, actor.info, groups, os.path.join(run_dir, "hf"))
    if ep2_step1:  # the model alone (adapters) from EP2's step 1, read at this layout
        load_training_model(actor.module, ep2_step1)
        out["adapters_from_ep2"] = _adapters(actor.module, groups)
    return out if rank == 0 else None


GROUPED1, GROUPED2 = (1, True, "grouped"), (2, True, "grouped")  # model.moe_experts=grouped (GroupedMLP, fp32)
GROUPED_PLAIN = (2, False, "grouped")  # experts without adapters: the engine runs on views of weight1 / weight2


def _dir(key) -> str:
    return "ep" + "_".join(str(k) for k in key)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("lora_moe") / "hf")
    make_tiny_checkpoint(path, "Qwen2MoeForCausalLM", seed=5)
    return path


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe_runs")
    ep2_step1 = str(root / "ep2_True" / "checkpoints" / "step_000001" / "actor")
    out = {key: spawn(_job, 2, ckpt, key[0], key[1], str(root / _dir(key)), False,
                      ep2_step1 if key[0] == 1 else None, key[2] if len(key) > 2 else "auto")[0]
           for key in ((2, True), (1, True), (2, False), GROUPED2, GROUPED1, GROUPED_PLAIN)}
    out["resumed"] = spawn(_job, 2, ckpt, 2, True, str(root / "ep2_True"), True)[0]
    out["resumed_grouped"] = spawn(_job, 2, ckpt, 2, True, str(root / _dir(GROUPED2)), True, None, "grouped")[0]
    out["dirs"] = root
    return out


@pytest.mark.parametrize("key", [(1, True), (2, True), (2, False), GROUPED1, GROUPED2, GROUPED_PLAIN])
def test_zero_b_is_the_base_model_and_updates_touch_adapters_only(runs, key):
    run = runs[key]
    assert run["init_is_base"]
    assert run["changed"] and set(run["changed"]) <= set(run["lora_names"])
    expert_adapters = [n for n in run["lora_names"] if ".mlp.experts." in n]
    if key in (GROUPED1, GROUPED2):  # 2 layers x fc1, fc2 x A, B, each stacked over the local experts
        assert len(expert_adapters) == 2 * 2 * 2 and all(".experts.lora_fc" in n for n in expert_adapters)
        assert any(".experts.lora_fc" in n and n.endswith("lora_b") for n in run["changed"])
    elif key[1]:  # 2 layers x (4 / ep) experts x fc1, fc2 x A, B
        assert len(expert_adapters) == 2 * (4 // key[0]) * 2 * 2
        assert any(".experts.local_experts." in n and n.endswith("lora_b") for n in run["changed"])
    else:
        assert expert_adapters == []
        assert any("shared_experts.linear_fc1.lora_b" in n for n in run["changed"])


@pytest.mark.parametrize("ep1_key,ep2_key", [((1, True), (2, True)), (GROUPED1, GROUPED2), ((2, True), GROUPED2)])
def test_ep2_equals_ep1(runs, ep1_key, ep2_key):
    """EP1 == EP2, with either experts module; and GroupedMLP == SequentialMLP (fp32: sums reordered only)."""
    ep1, ep2 = runs[ep1_key], runs[ep2_key]
    for loss in ("loss1", "loss2"):
        assert ep2[loss] == pytest.approx(ep1[loss], abs=1e-6, rel=1e-6)
    assert set(ep1["adapters"]) == set(ep2["adapters"]) and len(ep1["adapters"]) == 2 * (4 * 2 * 2 + 4 * 2)
    for name, value in ep1["adapters"].items():
        assert abs(ep2["adapters"][name] - value).max() <= 1e-6, name


def test_grouped_experts_without_adapters_train_as_the_loop(runs):
    """GroupedMLP (megarl's forward, fp32) under attention / shared-expert adapters: SequentialMLP's updates."""
    plain, loop = runs[GROUPED_PLAIN], runs[(2, False)]
    for loss in ("loss1", "loss2"):
        assert plain[loss] == pytest.approx(loop[loss], abs=1e-6, rel=1e-6)
    for name, value in loop["adapters"].items():
        assert abs(plain["adapters"][name] - value).max() <= 1e-6, name


def test_checkpoint_resumes_and_reshards_to_ep1(runs):
    """Resumed at EP2 (adapters and the expert / dense Adam states): update 2 as if never stopped, exactly.
    Read at EP1 (the model: each expert's adapters found by global index): update 1's adapters, exactly."""
    for ep2, resumed in ((runs[(2, True)], runs["resumed"]), (runs[GROUPED2], runs["resumed_grouped"])):
        assert resumed["loss2"] == ep2["loss2"]
        for name, value in ep2["adapters"].items():
            assert (resumed["adapters"][name] == value).all(), name
    ep2 = runs[(2, True)]
    for reader in ((1, True), GROUPED1):  # EP2 SequentialMLP's checkpoint read by either module at EP1
        loaded = runs[reader]["adapters_from_ep2"]
        assert set(loaded) == set(ep2["adapters1"])
        for name, value in ep2["adapters1"].items():
            assert (loaded[name] == value).all(), name


@pytest.mark.parametrize("key", [(1, True), (2, True), (2, False), GROUPED1, GROUPED2, GROUPED_PLAIN])
def test_rollout_logprobs_match_training(runs, key):
    assert runs[key]["rollout_gap"] <= 1e-5
    assert runs[key]["greedy_mismatches"] == 0


@pytest.mark.parametrize("key", [(1, True), (2, True), GROUPED1, GROUPED2])
def test_merged_export_loads_in_transformers(runs, key):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs["dirs"] / _dir(key) / "hf"))
    with torch.no_grad():
        logits = model((torch.arange(14).reshape(2, 7) * 37 + 5) % 300).logits
    assert (logits - torch.from_numpy(runs[key]["logits"])).abs().max().item() <= 1e-5
