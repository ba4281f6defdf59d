"""LoRA on megatron's tensor-parallel linears (megarl/models/lora.py), CPU fp32.

At TP2 (and TP1), with non-zero adapters on all four linears of a tiny Llama:
- the adapted forward equals the model whose weights are merged, W + s B A (1e-5);
- the adapters' gradients equal the chain rule through the merged weights,
  dL/dB = s dL/dW A^T and dL/dA = s B^T dL/dW, summed over TP where the factor
  is replicated (1e-5): the TP communication of both split kinds is right;
- only the adapters require gradients; the merge context restores the weights bitwise;
- a checkpoint saved at TP2 loads at TP1 and gives the same logits (B split like
  the weight, fc1's as gate / up halves);
- bad options and a target list matching nothing are one-line errors.
"""
import os

import pytest
import torch

from dist_helpers import spawn

OPTS = dict(rank=4, alpha=8.0, seed=3)


def _ids():
    ids = (torch.arange(14).reshape(2, 7) * 37 + 5) % 300
    return ids, torch.arange(7).expand(2, 7)


def _build(groups, src):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.models import ModelOptions, build_gpt_model, load_hf_checkpoint, read_hf_config

    model_parallel_cuda_manual_seed(1234)
    info = read_hf_config(src)
    model = build_gpt_model(info, groups, ModelOptions())
    load_hf_checkpoint(model, src, info, groups)
    return model, info


def _fill_b(adapters, tp_rank):
    """Non-zero B: a split B differs per rank, a replicated one is the same on every rank."""
    with torch.no_grad():
        for i, ad in enumerate(adapters):
            g = torch.Generator().manual_seed(100 + i + (1000 * tp_rank if ad.column else 0))
            ad.lora_b.copy_(torch.randn(ad.lora_b.shape, generator=g) * 0.05)


def _loss(model, groups, info):
    ids, pos = _ids()  # PP = 1: one forward with autograd, logits gathered over TP
    logits = model(ids, pos, None, runtime_gather_output=True)[..., :info.vocab_size]  # (2, 7, V)
    w = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    return logits, (logits.float() * w).sum()


def _expected_grads(ad, g_w, group):
    """The adapters' gradients through W' = W + s B A, from dL/dW' of this rank's shard."""
    import torch.distributed as dist

    a, b, s = ad.lora_a.detach(), ad.lora_b.detach(), ad.scale
    if ad.column:  # W'_local = W_local + s B_local A, A replicated
        g_a = s * b.t() @ g_w
        dist.all_reduce(g_a, group=group)
        return g_a, s * g_w @ a.t()
    g_b = s * g_w @ a.t()  # W'_local = W_local + s B A_local, B replicated
    dist.all_reduce(g_b, group=group)
    return s * b.t() @ g_w, g_b


def _job(rank, src, ckpt_dir, tp):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.lora import LoraOptions, adapters_off, apply_lora, merged_lora
    from megarl.models.mcore_ckpt import save_mcore

    init_distributed()
    groups = build_parallel_groups(tp=tp, pp=1)
    model, info = _build(groups, src)
    with torch.no_grad():
        base_logits = _loss(model, groups, info)[0]
    adapters = apply_lora(model, LoraOptions(**OPTS))
    _fill_b(adapters, groups.tp_rank)
    with torch.no_grad(), adapters_off(model):  # the reference policy of a LoRA actor
        off_logits = _loss(model, groups, info)[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {"adapters_off_is_base": bool(torch.equal(off_logits, base_logits)),
           "trainable_only_lora": all("lora_" in n for n in trainable) and len(trainable) == 2 * len(adapters),
           "n_adapters": len(adapters)}
    logits, loss = _loss(model, groups, info)
    loss.backward()
    lora_grads = [(ad.lora_a.grad.clone(), ad.lora_b.grad.clone()) for ad in adapters]
    before = [m.weight.detach().clone() for m in model.modules() if hasattr(m, "lora_enabled")]
    with merged_lora(model) as merged:
        for m in merged.linears:
            m.weight.requires_grad_(True)
        merged_logits, merged_loss = _loss(model, groups, info)
        merged_loss.backward()
        expected = [_expected_grads(ad, m.weight.grad, groups.tp) for ad, m in zip(adapters, merged.linears)]
        for m in merged.linears:
            m.weight.requires_grad_(False)
            m.weight.grad = None
    after = [m.weight.detach() for m in model.modules() if hasattr(m, "lora_enabled")]
    out["restored"] = all(torch.equal(x, y) for x, y in zip(before, after))
    out["logits_gap"] = float((logits - merged_logits).abs().max())
    out["grad_gap"] = max(float(((g - e).abs().max() / e.abs().max().clamp_min(1e-12)))
                          for (ga, gb), (ea, eb) in zip(lora_grads, expected) for g, e in ((ga, ea), (gb, eb)))
    out["logits"] = logits.detach().numpy()
    if ckpt_dir:
        save_mcore(model, info, groups, ckpt_dir)
    return out if rank == 0 else None


def _load_job(rank, src, ckpt_dir):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.lora import LoraOptions, apply_lora
    from megarl.models.mcore_ckpt import load_mcore

    init_distributed()
    groups = build_parallel_groups(tp=1, pp=1)
    model, info = _build(groups, src)
    apply_lora(model, LoraOptions(**OPTS))  # B = 0 until the checkpoint is read
    load_mcore(model, groups, ckpt_dir)
    with torch.no_grad():
        return _loss(model, groups, info)[0].numpy()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("lora") / "hf")
    make_tiny_checkpoint(path, "LlamaForCausalLM", seed=5)
    return path


@pytest.fixture(scope="module")
def tp2(src, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("lora_ckpt") / "mcore")
    return spawn(_job, 2, src, ckpt, 2)[0] | {"ckpt": ckpt}


def test_tp2_adapters_equal_merged_weights_and_their_chain_rule(tp2):
    assert tp2["n_adapters"] == 4 * 2  # 4 linears x 2 layers of the tiny model
    assert tp2["trainable_only_lora"] and tp2["restored"] and tp2["adapters_off_is_base"]
    assert tp2["logits_gap"] < 1e-5, tp2["logits_gap"]
    assert tp2["grad_gap"] < 1e-5, tp2["grad_gap"]


def test_tp1_adapters_equal_merged_weights(src):
    out = spawn(_job, 1, src, None, 1)[0]
    assert out["logits_gap"] < 1e-5 and out["grad_gap"] < 1e-5 and out["restored"]


def test_checkpoint_from_tp2_loads_at_tp1(src, tp2):
    logits = spawn(_load_job, 1, src, tp2["ckpt"])[0]
    assert abs(logits - tp2["logits"]).max() < 1e-5
    assert abs(tp2["logits"]).max() > 0  # not a vacuous comparison


def test_bad_options_are_one_line_errors(src):
    out = spawn(_errors_job, 1, src)[0]
    assert out == ["rank=0 must be >= 1", "match no linear of the model"], out


def _errors_job(rank, src):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.lora import LoraOptions, apply_lora

    init_distributed()
    groups = build_parallel_groups(tp=1, pp=1)
    seen = []
    for opts in (LoraOptions(rank=0, alpha=1.0), LoraOptions(rank=2, alpha=1.0, targets=("q_proj",))):
        model, _ = _build(groups, src)
        try:
            apply_lora(model, opts)
        except ValueError as e:
            msg = str(e)
            seen.append(next(n for n in ("rank=0 must be >= 1", "match no linear of the model") if n in msg))
    return seen


# ---------------------------------------------------------------- a real run
def test_lora_grpo_run_at_tp2_resumes_exactly_and_exports_merged(tmp_path):
    """Two GRPO steps at TP2 with adapters (the KL reference is the actor with its adapters
    off): the engine's LoRA-aware decode gives the training log-probs (1e-5), a stop after step 1 and a resume equal the straight run, and the HF
    export changes only the adapted linears (embeddings and norms are the frozen base's)."""
    import json

    from safetensors.torch import load_file
    from test_trainer_runs import SMALL, _comparable, metrics, ppo

    lora = ["parallel.tp=2", "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-3", *SMALL]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ppo("yaml/tiny_grpo.yaml", straight, *lora, steps=2)
    ppo("yaml/tiny_grpo.yaml", split, *lora, "trainer.export_hf=false", steps=1)
    ppo("yaml/tiny_grpo.yaml", split, *lora, steps=2)
    a, b = metrics(straight), metrics(split)
    def train(row):  # the sessions evaluate at their own ends
        return {k: v for k, v in _comparable(row).items() if k != "eval/accuracy"}

    assert train(a[1]) == train(b[1]) and train(a[2]) == train(b[2])
    assert max(a[s]["mismatch/abs_max"] for s in (1, 2)) <= 1e-5
    base = load_file(os.path.join("megarl", "assets", "tiny", "sft", "model.safetensors"))
    out = load_file(str(straight / "hf" / "model.safetensors"))
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(out) == sorted(base)
    for name, t in base.items():
        changed = not torch.equal(out[name], t)  # W + s B A; biases, norms, embeddings frozen
        assert changed == (name.endswith(".weight") and any(p in name for p in adapted)), name
    assert json.load(open(straight / "hf" / "config.json"))["architectures"]
