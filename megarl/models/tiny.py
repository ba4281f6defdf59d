"""Tiny random Hugging Face checkpoints for tests (no download).

``make_tiny_checkpoint(out_dir, "Qwen3ForCausalLM")`` builds the model with
``transformers`` from a small config (2 layers, hidden 64, GQA 4 query heads
over 2 key/value groups, vocab 300: not a multiple of 128), draws every
weight (norms around 1, biases nonzero) from a seed so that all of them matter
for the logits, and saves it with ``save_pretrained`` in fp32.
"""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-6,
    pad_token_id=0,
)
# What each architecture's tiny checkpoint exercises on top of BASE.
VARIANTS = {
    "Llama": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=5000.0),
    "Mistral": dict(sliding_window=None, rope_theta=20000.0),
    "Qwen2": dict(tie_word_embeddings=True),
    "Qwen3": dict(head_dim=32),  # heads * head_dim = 128 != hidden 64; QK norm is built in
    # mixtures of experts: 4 experts (2 per rank at EP2), top-2
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, rope_theta=20000.0),
    "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=True),
    "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     head_dim=32),
}


def tiny_config(arch: str, **overrides):
    import transformers

    family = max((f for f in VARIANTS if arch.startswith(f)), key=len)  # Qwen2Moe, not Qwen2
    config_cls = getattr(transformers, f"{family}Config")
    kwargs = {**BASE, **VARIANTS[family], **overrides}
    if arch.endswith("ForSequenceClassification"):
        kwargs["num_labels"] = 1
    return config_cls(**kwargs)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Every weight ~ N(0, std); norm weights ~ 1 + N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(noise + 1.0 if "norm" in name else noise)


def make_tiny_checkpoint(out_dir: str, arch: str, seed: int = 0, max_shard_size=None, **overrides):
    """Saves a random tiny ``arch`` model to ``out_dir``; returns the model (eval, fp32)."""
    import transformers

    config = tiny_config(arch, **overrides)
    model = getattr(transformers, arch)(config).float().eval()
    randomize_(model, seed)
    if config.tie_word_embeddings and hasattr(model, "lm_head"):
        model.lm_head.weight = model.model.embed_tokens.weight
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def make_tiny_checkpoints(root, archs: list[str], first_seed: int) -> dict[str, str]:
    """A tiny random checkpoint per architecture under ``root``/<arch> (seeds first_seed, first_seed + 1, ...);
    arch -> its directory."""
    dirs = {arch: str(Path(root) / arch) for arch in archs}
    for i, arch in enumerate(archs):
        make_tiny_checkpoint(dirs[arch], arch, seed=first_seed + i)
    return dirs
