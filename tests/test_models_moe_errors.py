"""Bad mixture-of-experts input is one line that names the key and the fix.

Config reading (``read_hf_config``): an unsupported architecture names the supported ones;
dense layers between MoE layers (decoder_sparse_step, mlp_only_layers), router jitter and
top-1 renormalized routing are refused. Run config (``config_checks``): parallel.ep not
dividing the experts or, with parallel.etp, the ranks of a stage; ep on a dense model;
LoRA, CP with TP, or TP without sequence parallelism with MoE (CP alone is fine:
tests/test_models_moe_cp.py); the native engine with parallel.etp not dividing parallel.tp.
Checkpoints: HF weights with more experts than config.json; a megatron checkpoint whose
expert count or top-k differs from the config it is exported with (launch/convert.py,
exit 2). And the conversion HF -> megatron at EP2 -> HF at EP1 is bitwise.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import free_port, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "convert.py")
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("change, needle", [
    (dict(architectures=["DeepseekV3ForCausalLM"]), "supported: "),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers=[0]"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
])
def test_unsupported_configs(change, needle):
    from megarl.models.hf_config import ModelConfigError, read_hf_config

    with pytest.raises(ModelConfigError) as e:
        read_hf_config({**QWEN3_MOE, **change})
    assert needle in one_line(e)
    if needle == "supported: ":
        for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"):
            assert arch in str(e.value)


def test_routing_per_family():
    """Qwen3-MoE renormalizes when norm_topk_prob; Qwen2-MoE's default does not; Mixtral always does."""
    from megarl.models.hf_config import read_hf_config

    assert read_hf_config(QWEN3_MOE).moe.renormalize
    qwen2 = {**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 48}
    qwen2.pop("norm_topk_prob")
    m = read_hf_config(qwen2).moe
    assert not m.renormalize and m.shared_ffn_hidden_size == 48
    mixtral = {**QWEN3_MOE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
    m = read_hf_config(mixtral).moe
    assert m.renormalize and m.num_experts == 8 and m.ffn_hidden_size == 128 and m.block == "block_sparse_moe."


def _cfg(**parallel):
    from megarl.config import Config

    cfg = Config()
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("world, parallel, needle", [
    (4, dict(ep=3), "parallel.ep=3 must divide the model's 4 experts"),
    (2, dict(ep=2, etp=2), "parallel.ep=2 x parallel.etp=2 must divide the 2 ranks"),
    (4, dict(ep=4, pp=2), "parallel.ep=4 x parallel.etp=1 must divide the 2 ranks"),
    (2, dict(tp=2), "parallel.sequence_parallel=true"),
    (4, dict(cp=2, tp=2, sequence_parallel=True), "parallel.cp=2 with parallel.tp=2 on a mixture-of-experts"),
])
def test_parallel_errors(world, parallel, needle):
    from megarl.config_checks import check_experts
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_experts(_cfg(**parallel), world, QWEN3_MOE)
    assert needle in one_line(e)


def test_ep_on_dense_model_lora_and_rollout_rules():
    from megarl.config_checks import check_experts, check_moe_rollout
    from megarl.errors import ConfigError

    dense = {k: v for k, v in QWEN3_MOE.items() if "expert" not in k}
    dense["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError) as e:
        check_experts(_cfg(ep=2), 2, dense)
    assert "need a mixture-of-experts model" in one_line(e)
    cfg = _cfg(ep=2)
    cfg.actor.lora.rank, cfg.actor.lora.experts = 8, True
    check_experts(cfg, 2, QWEN3_MOE)  # LoRA on the experts too (tests/test_lora_moe.py)
    dense_lora = _cfg()
    dense_lora.actor.lora.rank, dense_lora.actor.lora.experts = 8, True
    with pytest.raises(ConfigError) as e:
        check_experts(dense_lora, 2, dense)
    assert "actor.lora.experts=true needs a mixture-of-experts model" in one_line(e)
    cfg.actor.lora.targets = ["linear_qkv", "linear_proj"]
    with pytest.raises(ConfigError) as e:
        check_experts(cfg, 2, QWEN3_MOE)
    assert "actor.lora.experts=true adapts the experts' linear_fc1 / linear_fc2" in one_line(e)
    cfg.actor.lora.experts = False
    check_experts(cfg, 2, QWEN3_MOE)  # attention-only adapters
    check_experts(_cfg(ep=2), 2, QWEN3_MOE)  # fine: 2 experts per rank
    check_experts(_cfg(cp=2, ep=2), 4, QWEN3_MOE)  # context parallelism with experts over EP (tp = 1)
    check_moe_rollout(_cfg(), dense)  # a dense model generates
    check_moe_rollout(_cfg(ep=2), QWEN3_MOE)  # the native engine generates at TP1, any EP
    check_moe_rollout(_cfg(tp=2, sequence_parallel=True), QWEN3_MOE)  # and at TP2 (etp = tp)
    check_moe_rollout(_cfg(tp=2, ep=2, etp=1, sequence_parallel=True), QWEN3_MOE)  # and at etp 1 under TP2
    with pytest.raises(ConfigError) as e:  # expert-tensor ranks across DP hold other rows
        check_moe_rollout(_cfg(ep=1, etp=2), QWEN3_MOE)
    assert "when parallel.etp divides parallel.tp (etp=2, tp=1)" in one_line(e)
    cfg = _cfg(ep=2)
    cfg.rollout.engine = "sglang"
    check_moe_rollout(cfg, QWEN3_MOE)  # its weight stream sends every expert (tests/test_rollout_sglang_moe.py)


def test_checkpoint_experts_must_match_config():
    from megarl.models.hf_config import ModelConfigError, read_hf_config
    from megarl.models.mcore_ckpt import check_same_experts

    info = read_hf_config(QWEN3_MOE)
    check_same_experts(info, info, "ckpt")
    for change in (dict(num_experts=8), dict(num_experts_per_tok=3)):
        with pytest.raises(ModelConfigError) as e:
            check_same_experts(info, read_hf_config({**QWEN3_MOE, **change}), "ckpt")
        assert "was saved with num_experts=4 top-k=2" in one_line(e)


def _load(rank, src, config_dir):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, load_hf_checkpoint, read_hf_config

    init_distributed()
    groups = build_parallel_groups()
    info = read_hf_config(config_dir)
    try:
        load_hf_checkpoint(build_gpt_model(info, groups, ModelOptions()), src, info, groups)
    except ValueError as e:
        return str(e)
    return None


def test_weights_with_more_experts_than_config(tmp_path):
    """8 experts in the safetensors, 4 in config.json: refused (a smaller count fails as missing tensors)."""
    from megarl.models.tiny import make_tiny_checkpoint

    src = str(tmp_path / "eight")
    make_tiny_checkpoint(src, "Qwen3MoeForCausalLM", num_experts=8)
    four = tmp_path / "four"
    four.mkdir()
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["num_local_experts"] = cfg["num_experts"] = 4
    (four / "config.json").write_text(json.dumps(cfg))
    (message,) = spawn(_load, 1, src, str(four))
    assert message and "num_experts=4" in message and "experts.4." in message and "\n" not in message


# ---------------------------------------------------------------- launch/convert.py at EP2
def torchrun(*args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), SCRIPT, *args]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_convert_ep2_to_ep1_is_bitwise_and_checks_experts(tmp_path):
    from safetensors.torch import load_file

    from megarl.models.tiny import make_tiny_checkpoint

    src, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    make_tiny_checkpoint(src, "MixtralForCausalLM", seed=4)
    done = torchrun("hf-to-mcore", "--hf", src, "--out", ckpt, "--ep", "2")
    assert "megatron-core checkpoint (tp=1, pp=1, ep=2, fp32)" in done.stdout
    torchrun("mcore-to-hf", "--ckpt", ckpt, "--out", out, nproc=1)
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    other = tmp_path / "topk1"
    other.mkdir()
    cfg = json.load(open(os.path.join(src, "config.json")))
    (other / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 3}))
    bad = {"was saved with num_experts=4 top-k=2": ["mcore-to-hf", "--ckpt", ckpt, "--out", out,
                                                    "--hf-config-from", str(other)],
           "--ep 3 x --etp 1 must divide the 1 ranks": ["hf-to-mcore", "--hf", src, "--out", ckpt, "--ep", "3"]}
    for needle, args in bad.items():
        run = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and needle in lines[0], run.stderr


@pytest.mark.parametrize("override, needle", [
    ("parallel.ep=3", "parallel.ep=3 must divide the model's 8 experts"),
])
def test_ppo_entry_exits_2_with_one_line(tmp_path, override, needle):
    """launch/ppo.py on the shipped tiny MoE policy (one process): the config error, exit 2."""
    args = [sys.executable, os.path.join(ROOT, "launch", "ppo.py"), "yaml/tiny.yaml",
            "model.path=megarl/assets/tiny_moe/sft", override, f"trainer.run_dir={tmp_path / 'run'}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr


@pytest.mark.parametrize("kind, legacy", [("grouped", True), ("sequential", None)])
def test_te_spec_builds_the_grouped_module_megarl_reads(tmp_path, monkeypatch, kind, legacy):
    """With transformer-engine, grouped experts are megatron-core's legacy GroupedMLP (weight1 / weight2,
    what the loader, the engine and LoRA read), not TEGroupedMLP; the per-expert module stays as it is."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megarl.models import ModelOptions, builder, read_hf_config
    from megarl.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path), "Qwen3MoeForCausalLM", seed=3)
    seen = {}
    monkeypatch.setattr(builder, "uses_te", lambda opts: True)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: seen.update(kw) or "te-spec")
    info = read_hf_config(str(tmp_path))
    assert builder.layer_spec(info, ModelOptions(params_dtype="bf16", moe_experts=kind)) == "te-spec"
    assert seen["moe_grouped_gemm"] == (kind == "grouped")
    assert seen.get("moe_use_legacy_grouped_gemm") is legacy
