"""The shipped MoE run configs: yaml/tiny_moe.yaml (CPU, EP2) and yaml/qwen3-30b-a3b.yaml (8 GPUs, EP8).

- yaml/tiny_moe.yaml validates on 2 ranks (the shipped tiny MoE policy, 8 experts over EP2, the
  native engine) and runs 2 GRPO steps: every step the engine's log-probs equal the training
  forward's (fp32, <= 1e-4; seen ~4e-6), the engine decodes on the actor's weights (zero copy)
  and the update logs the expert load of each of the 4 MoE layers (max/mean >= 1 by definition).
- yaml/qwen3-30b-a3b.yaml passes every config check on 8 ranks with the real model's config.json
  shape standing in for the hub download (128 experts, 48 layers, 32 / 4 heads); on 4 ranks EP8
  does not fit and the error names parallel.ep.
Not covered: the +20-point learning run (``torchrun --nproc_per_node 2 launch/ppo.py
yaml/tiny_moe.yaml``, about a minute; README.md gives its numbers), and the 30B run itself (GPUs).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megarl.cli import load_config
from megarl.config import Config
from megarl.config_checks import moe_experts, validate
from megarl.errors import ConfigError
from test_trainer_runs import metrics, ppo

ROOT = Path(__file__).resolve().parents[1]
# Qwen/Qwen3-30B-A3B's config.json, the fields megarl reads
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645, hidden_act="silu", torch_dtype="bfloat16")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the yaml files name their assets relative to the repository root


def test_tiny_moe_yaml_validates_at_ep2():
    cfg = load_config(["yaml/tiny_moe.yaml"], Config)
    assert (cfg.parallel.ep, cfg.parallel.tp, cfg.rollout.engine, cfg.actor.moe_aux_loss_coef) == (2, 1, "native", 0)
    assert moe_experts(validate(cfg, 2)) == 8


def test_qwen3_30b_a3b_yaml_validates_on_8_ranks(tmp_path):
    stand_in = tmp_path / "Qwen3-30B-A3B"
    shutil.copytree(ROOT / "megarl" / "assets" / "tiny_moe" / "sft", stand_in)
    (stand_in / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = load_config(["yaml/qwen3-30b-a3b.yaml"], Config)
    assert cfg.model.path == "Qwen/Qwen3-30B-A3B" and cfg.data.train_path == "DigitalLearningGmbH/MATH-lighteval"
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.rollout.engine, cfg.actor.moe_aux_loss_coef) == (1, 8, "native", 0)
    local = load_config(["yaml/qwen3-30b-a3b.yaml", f"model.path={stand_in}"], Config)
    assert moe_experts(validate(local, 8)) == 128
    with pytest.raises(ConfigError, match=r"^parallel\.ep=8 x parallel\.etp=1 must divide the 4 ranks"):
        validate(load_config(["yaml/qwen3-30b-a3b.yaml", f"model.path={stand_in}"], Config), 4)


def test_tiny_moe_runs_two_steps(tmp_path):
    out = ppo("yaml/tiny_moe.yaml", tmp_path, "data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16",
              "actor.micro_batch_size=8", "trainer.eval_samples=16", "trainer.tensorboard=false",
              "trainer.export_hf=false", "trainer.save_last=false", steps=2)
    assert "held-out accuracy: before" in out
    rows = metrics(tmp_path)
    for step in (1, 2):
        m = rows[step]
        assert m["mismatch/abs_max"] <= 1e-4 and m["weight_sync/zero_copy"] == 1, m
        loads = [m[f"actor/moe/load_max_over_mean/layer_{i}"] for i in range(4)]
        assert min(loads) >= 1 and m["actor/moe/load_max_over_mean"] == max(loads), loads
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
