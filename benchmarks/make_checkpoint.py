"""Random-weight Hugging Face checkpoints of real model shapes, for speed tests.

    python benchmarks/make_checkpoint.py --shape qwen2.5-1.5b --out /tmp/q15
    python benchmarks/make_checkpoint.py --shape llama2-7b --out /tmp/l7 --layers 8 --prompts 512
    python benchmarks/make_checkpoint.py --shape qwen3-30b-a3b --out /tmp/q3moe --layers 8

Writes config.json + safetensors (bf16), a synthetic word-level tokenizer with
the model's vocabulary size and a ChatML-like chat template, and
``prompts.jsonl`` of random prompts of a fixed token length (with a dummy
``answer``), so launch/ppo.py can run on it with no download. With
``--classifier`` the checkpoint is a ``*ForSequenceClassification`` (a reward
model of the same shape).
"""
from __future__ import annotations

import argparse
import json
import os
import random

import torch

SHAPES = {
    "llama2-7b": dict(arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
                      rms_norm_eps=1e-5),
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
                         rms_norm_eps=1e-6),
    # the full model is ~61 GB in bf16 (~1.2 GB a layer, 1.2 GB embedding + head): write it with --layers
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
                          rms_norm_eps=1e-6),
    # a CPU-sized Qwen3-MoE (the benchmarks' --tiny runs): vocab 300 pads to 384 in megarl
    "qwen3-moe-tiny": dict(arch="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=1024, rope_theta=1000000.0, tie_word_embeddings=False,
                           rms_norm_eps=1e-6, initializer_range=0.2),
    # a CPU smoke shape (benchmarks' --tiny runs)
    "tiny-llama": dict(arch="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
}
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe"}  # arch -> transformers class prefix
SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")


def write_tokenizer(out: str, vocab_size: int) -> None:
    """Word-level: the specials, then w0, w1, ... up to vocab_size entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["user", "assistant"] + [f"w{i}" for i in range(vocab_size - len(SPECIALS) - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:3])
    fast.chat_template = TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(out)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the model family's own class
    json.dump(cfg, open(cfg_path, "w"), indent=1)


def write_prompts(out: str, n: int, length: int, vocab_size: int, seed: int) -> None:
    """n prompts of ``length`` random words (the chat template adds ~5 tokens)."""
    rng = random.Random(seed)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for _ in range(n):
            words = " ".join(f"w{rng.randrange(vocab_size - 8)}" for _ in range(length))
            f.write(json.dumps({"prompt": words, "answer": "w0"}) + "\n")


def write_model(out: str, shape: dict, classifier: bool, seed: int) -> None:
    import transformers

    arch = shape.pop("arch")
    family = FAMILIES[arch]
    config = getattr(transformers, f"{family}Config")(**shape, pad_token_id=0, eos_token_id=3, bos_token_id=None,
                                                       num_labels=1, torch_dtype="bfloat16")
    head = "ForSequenceClassification" if classifier else "ForCausalLM"
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = getattr(transformers, family + head)(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape")
    ap.add_argument("--classifier", action="store_true", help="a *ForSequenceClassification reward model")
    ap.add_argument("--prompts", type=int, default=256, help="random prompts written to prompts.jsonl")
    ap.add_argument("--prompt-len", type=int, default=128, help="words per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-positions", type=int, default=None, help="max_position_embeddings other than the shape's")
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.max_positions:
        shape["max_position_embeddings"] = args.max_positions
    os.makedirs(args.out, exist_ok=True)
    vocab = shape["vocab_size"]
    write_model(args.out, shape, args.classifier, args.seed)
    write_tokenizer(args.out, vocab)
    write_prompts(args.out, args.prompts, args.prompt_len, vocab, args.seed)
    print(f"wrote {args.out} ({args.shape}, {'classifier' if args.classifier else 'causal LM'})")


if __name__ == "__main__":
    main()
