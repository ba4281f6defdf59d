"""Small random Hugging Face checkpoints for tests, made with ``transformers``."""
from __future__ import annotations

import torch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def make_causal_lm(path, arch: str = "llama", seed: int = 0, **overrides):
    """Saves a random fp32 model to ``path`` (with the tiny tokenizer); returns the model."""
    import transformers

    from megarl.assets import asset_path

    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = dict(vocab_size=57, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, eos_token_id=3, pad_token_id=0, bos_token_id=None,
                  initializer_range=0.1)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float()
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(asset_path("tiny/tokenizer")).save_pretrained(path)
    return model
