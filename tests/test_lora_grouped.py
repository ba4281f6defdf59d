"""LoRA on GroupedMLP experts (megarl/models/lora_grouped.py): grouped GEMMs == the per-expert loop == SequentialMLP.

One process: :func:`grouped_lora` (two ``torch._grouped_mm`` launches) equals its loop reference
:func:`grouped_lora_ref`, forward and gradients, on ragged expert groups (3, 0, 7, 1 rows), in
fp32 (1e-5) and bf16 (bf16 rounding of products of size ~1: 3e-2), at ranks whose rows break
``_grouped_mm``'s 16-byte stride rule (bf16 r = 3, 4; fp32 r = 3), padded inside with zeros.

Two processes, fp32 (megarl runs GroupedMLP in any dtype ``torch._grouped_mm`` takes, so the
comparison is exact up to fp32 reordering), at EP2 (2 experts per rank) and at expert-TP 2 (tp 1,
each expert's FFN split in two): the tiny Qwen2-MoE built with SequentialMLP and with GroupedMLP
from the same HF checkpoint, rank-3 adapters on every linear, experts included, every B filled
with non-zero values drawn whole per (layer, global expert, linear):
- the adapters' initial A are equal by global expert (same streams), and the adapted logits and a
  loss's adapter gradients are equal (1e-5): expert e's stacked slices act as SequentialMLP's
  expert e's linears;
- EP2 and expert-TP 2 give the same logits (1e-5), for both modules: under expert-TP the experts'
  outputs are partial sums the dispatcher adds, and the adapters add theirs the same way;
- ``merged_lora`` gives the adapted logits (W + s B A, 1e-5) and restores weight1 / weight2 bitwise;
  under it the HF weight stream (SGLang's) of GroupedMLP equals SequentialMLP's (1e-6);
- a model checkpoint of the grouped model loads into the sequential one: adapters equal exactly
  (fc1's B as [gate | up] halves over expert-TP).
Not covered: bf16 models (the dtype only changes rounding, the GEMM path is the same), the grouped
GEMMs on a GPU.
"""
import pytest
import torch

from dist_helpers import spawn

OPTS = dict(rank=3, alpha=6.0, seed=5)


class _OneRank:
    """A process group of size 1 (expert-TP 1)."""

    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("dtype,rank", [(torch.float32, 3), (torch.float32, 8), (torch.bfloat16, 3),
                                        (torch.bfloat16, 4), (torch.bfloat16, 16)])
def test_grouped_lora_matches_loop(dtype, rank):
    from megarl.models.lora_grouped import GroupedAdapter, grouped_lora_ref, padded_rank
    from megarl.models.moe import grouped_gemm_torch

    gen = torch.Generator().manual_seed(rank)
    sizes = torch.tensor([3, 0, 7, 1])
    x = torch.randn(11, 16, generator=gen).to(dtype).requires_grad_(True)
    a = torch.randn(4, rank, 16, generator=gen).to(dtype)
    b = torch.randn(4, 24, rank, generator=gen).to(dtype)
    adapter = GroupedAdapter("linear_fc1", a.clone(), b.clone(), 0.5, _OneRank(), False)
    assert adapter.factors()[0].shape[1] == padded_rank(rank, x.element_size())
    got = adapter(x, sizes, grouped_gemm_torch)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    (got.float() * g.float()).sum().backward()
    x_ref, a_ref, b_ref = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    want = grouped_lora_ref(x_ref, a_ref, b_ref, sizes, 0.5)
    (want.float() * g.float()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for mine, ref in ((got, want), (x.grad, x_ref.grad), (adapter.lora_a.grad, a_ref.grad),
                      (adapter.lora_b.grad, b_ref.grad)):
        assert mine.shape == ref.shape
        assert ((mine.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= tol
    assert adapter.lora_a.grad[1].abs().max() == 0  # expert 1 had no rows


def test_padded_rank():
    from megarl.models.lora_grouped import padded_rank

    assert [padded_rank(r, 4) for r in (1, 3, 4, 5)] == [4, 4, 4, 8]
    assert [padded_rank(r, 2) for r in (1, 4, 8, 9)] == [8, 8, 8, 16]


LAYOUTS = {"ep2": dict(ep=2, etp=1), "etp2": dict(ep=1, etp=2)}  # 2 experts per rank | each expert split in 2


def _global_expert(groups, i: int) -> int:
    return groups.ep_rank * (4 // groups.ep_size) + i


def _by_expert(model, groups, grads: bool) -> dict:
    """{"L.E.fc1.lora_a": tensor} of every expert adapter of the EP group (E global; this expert-TP
    rank's shard), params or grads."""
    import torch.distributed as dist

    local = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." not in name or "lora_" not in name:
            continue
        value = (p.grad if grads else p).detach().clone()
        parts = name.split(".")
        layer, factor = parts[2], parts[-1]
        if "local_experts" in parts:  # SequentialMLP: ...experts.local_experts.I.linear_fcK.lora_x
            i, kind = int(parts[parts.index("local_experts") + 1]), parts[-2][len("linear_"):]
            local[f"{layer}.{_global_expert(groups, i)}.{kind}.{factor}"] = value
        else:  # GroupedMLP: ...experts.lora_fcK.lora_x, (E_local, ...)
            kind = parts[-2][len("lora_"):]
            for i, v in enumerate(value):
                local[f"{layer}.{_global_expert(groups, i)}.{kind}.{factor}"] = v
    every = [None] * groups.ep_size
    dist.all_gather_object(every, local, group=groups.ep)
    return {k: v for part in every for k, v in part.items()}


def _global_b(name: str, shape, expert: int, groups) -> torch.Tensor:
    """This rank's shard of a B drawn whole per (layer, global expert, fc): fc1's (2F, r) as this
    expert-TP rank's [gate | up] rows, fc2's (h, r) replicated."""
    parts = name.split(".")
    layer, fc1 = int(parts[2]), parts[-2].endswith("fc1")
    rows = shape[0] * (groups.etp_size if fc1 else 1)
    g = torch.Generator().manual_seed(1000 * layer + 10 * expert + int(fc1))
    full = torch.randn(rows, shape[1], generator=g) * 0.05
    if not fc1:
        return full
    gate, up = full.chunk(2)
    return torch.cat([gate.chunk(groups.etp_size)[groups.etp_rank], up.chunk(groups.etp_size)[groups.etp_rank]])


def _fill_b(model, groups):
    """Every B non-zero, a function of the whole model (not of the layout or the experts module)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("lora_b"):
                continue
            parts = name.split(".")
            if ".mlp.experts.lora_" in name:  # GroupedMLP: (E_local, out, r)
                for i in range(p.shape[0]):
                    p[i].copy_(_global_b(name, p.shape[1:], _global_expert(groups, i), groups))
            elif "local_experts" in parts:
                p.copy_(_global_b(name, p.shape, _global_expert(groups, int(parts[parts.index("local_experts") + 1])),
                                  groups))
            else:  # attention, shared expert: TP 1 here, the same on every rank
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)


def _module_job(rank, src, ckpt_dir, layout):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, load_hf_checkpoint, read_hf_config
    from megarl.models.lora import LoraOptions, adapters_off, apply_lora, merged_lora
    from megarl.models.mcore_ckpt import load_mcore, save_mcore

    init_distributed()
    groups = build_parallel_groups(**LAYOUTS[layout])
    info = read_hf_config(src)
    ids, pos = (torch.arange(14).reshape(2, 7) * 37 + 5) % 300, torch.arange(7).expand(2, 7)
    out, models = {}, {}
    for kind in ("sequential", "grouped"):
        model_parallel_cuda_manual_seed(0)
        model = build_gpt_model(info, groups, ModelOptions(moe_experts=kind))
        load_hf_checkpoint(model, src, info, groups)
        apply_lora(model, LoraOptions(experts=True, **OPTS))
        out[f"{kind}_a"] = _by_expert(model, groups, grads=False)
        _fill_b(model, groups)
        logits = model(ids, pos, None, runtime_gather_output=True)[..., :info.vocab_size]  # (2, 7, V)
        (logits * torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)).sum().backward()
        out[f"{kind}_logits"], out[f"{kind}_grads"] = logits.detach(), _by_expert(model, groups, grads=True)
        models[kind] = model
    grouped = models["grouped"]
    before = {n: p.detach().clone() for n, p in grouped.named_parameters()}
    with torch.no_grad(), merged_lora(grouped) as merged:
        assert len(merged.grouped) == 2
        out["merged_logits"] = grouped(ids, pos, None, runtime_gather_output=True)[..., :info.vocab_size]
    with torch.no_grad(), adapters_off(grouped):
        out["base_logits"] = grouped(ids, pos, None, runtime_gather_output=True)[..., :info.vocab_size]
    out["restored"] = all(torch.equal(p, before[n]) for n, p in grouped.named_parameters())
    out["stream_gap"] = _stream_gap(models, groups, info)
    save_mcore(grouped, info, groups, ckpt_dir)
    sequential = models["sequential"]
    with torch.no_grad():
        for n, p in sequential.named_parameters():
            if "lora_" in n:
                p.zero_()
    load_mcore(sequential, groups, ckpt_dir)
    out["loaded"], out["saved"] = _by_expert(sequential, groups, False), _by_expert(grouped, groups, False)
    return _numpy(out) if rank == 0 else None


def _stream_gap(models, groups, info) -> float:
    """Largest difference between the two modules' merged weight streams (SGLang's HF tensors), all experts."""
    from megarl.models.lora import merged_lora
    from megarl.rollout.weight_stream import iter_hf_tensors

    streams = {}
    for kind, model in models.items():
        with torch.no_grad(), merged_lora(model):
            streams[kind] = dict(iter_hf_tensors(model, groups, info))
    assert set(streams["grouped"]) == set(streams["sequential"])
    assert any(".experts.3.down_proj" in name for name in streams["grouped"])
    return max((streams["grouped"][k] - t).abs().max().item() for k, t in streams["sequential"].items())


def _numpy(obj):
    """Tensors -> numpy arrays (tensors do not outlive the worker through the result queue)."""
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    return obj.float().numpy() if torch.is_tensor(obj) else obj


def _torch(obj):
    if isinstance(obj, dict):
        return {k: _torch(v) for k, v in obj.items()}
    return torch.from_numpy(obj) if hasattr(obj, "dtype") and not isinstance(obj, bool) else obj


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora_grouped")
    make_tiny_checkpoint(str(root / "hf"), "Qwen2MoeForCausalLM", seed=5)
    return {layout: _torch(spawn(_module_job, 2, str(root / "hf"), str(root / f"mcore_{layout}"), layout)[0])
            for layout in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_equals_sequential_forward_and_grads(module_runs, layout):
    run = module_runs[layout]
    assert len(run["grouped_a"]) == 2 * 4 * 2 * 2  # layers x global experts x fc1, fc2 x A, B
    for name, a in run["sequential_a"].items():
        assert torch.equal(run["grouped_a"][name], a), name
    assert (run["grouped_logits"] - run["sequential_logits"]).abs().max().item() <= 1e-5
    assert (run["grouped_logits"] - run["base_logits"]).abs().max().item() > 1e-2  # the adapters matter
    assert set(run["grouped_grads"]) == set(run["sequential_grads"])
    for name, g in run["sequential_grads"].items():
        assert g.abs().max() > 0, name
        assert (run["grouped_grads"][name] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_expert_tp_gives_the_expert_parallel_model(module_runs):
    """The same adapters (A by stream, B drawn whole) at EP2 and at expert-TP 2: the same logits, with
    either experts module (the fc2 partial sums and the replicated factors' gradients over expert-TP)."""
    ep2, etp2 = module_runs["ep2"], module_runs["etp2"]
    for kind in ("sequential", "grouped"):
        assert (etp2[f"{kind}_logits"] - ep2[f"{kind}_logits"]).abs().max().item() <= 1e-5, kind


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_grouped_weights_give_the_adapted_logits(module_runs, layout):
    """merged_lora: the adapted logits, weights restored, and the weight stream SGLang would get (every
    expert's W + s B A under its HF name) equal to SequentialMLP's (fp32 rounding of the merge)."""
    run = module_runs[layout]
    assert run["restored"]
    assert run["stream_gap"] <= 1e-6
    assert (run["merged_logits"] - run["grouped_logits"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_checkpoint_loads_into_sequential(module_runs, layout):
    loaded, saved = module_runs[layout]["loaded"], module_runs[layout]["saved"]
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
