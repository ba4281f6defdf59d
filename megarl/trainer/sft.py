"""Supervised warm start on (prompt, response) rows with the same model code as PPO.

The loss is the mean negative log-likelihood of response tokens (the prompt is
context only), summed over micro-batches and DP ranks and divided once by the
global token count.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megarl.config import Config
from megarl.errors import DataError
from megarl.data import PromptDataConfig, PromptSampler, load_prompt_dataset
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed import build_parallel_groups, device
from megarl.models.builder import build_gpt_model
from megarl.models.exporter import export_hf
from megarl.models.hf_config import read_hf_config
from megarl.models.loader import load_hf_checkpoint
from megarl.roles.batch import SampleBatch
from megarl.roles.build import model_options
from megarl.roles.optim import build_trainable
from megarl.roles.policy import Policy, token_logprobs


def sft_sequence(item, tokenizer) -> list[int]:
    """Prompt ids + response ids + eos."""
    response = tokenizer(item.extra["response"], add_special_tokens=False)["input_ids"]
    return item.prompt_ids + response + [tokenizer.eos_token_id]


def within_length(data, tokenizer, max_len: int) -> list[int]:
    """Indices of rows with a response whose full sequence fits in ``max_len``."""
    keep = []
    for i in range(len(data)):
        item = data[i]
        if "response" not in item.extra:
            raise DataError(f"{item.source}: SFT row has no 'response'; add one")
        if len(sft_sequence(item, tokenizer)) <= max_len:
            keep.append(i)
    return keep


def sft_batch(items, tokenizer, pad_id: int, dev) -> SampleBatch:
    """Prompt + response + eos, right-padded; the mask covers response and eos."""
    seqs = [sft_sequence(it, tokenizer) for it in items]
    starts = [len(it.prompt_ids) for it in items]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (s, p) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, p : len(s)] = 1.0
    return SampleBatch(ids.to(dev), mask.to(dev), torch.tensor(list(map(len, seqs)), device=dev))


def nll_head(policy: Policy):
    def head(mb: SampleBatch, logits):
        lp, _ = token_logprobs(logits, mb.model_inputs, policy.groups, policy.info.vocab_size, 1.0)
        tokens = mb.response_mask.sum()
        nll = -(lp * mb.response_mask).sum()
        return nll, tokens.long(), {"nll": nll.detach(), "tokens": tokens.detach()}

    return head


def build_policy(cfg: Config, groups, total_steps: int) -> Policy:
    info = read_hf_config(cfg.model.path)
    module = build_gpt_model(info, groups, model_options(cfg))
    if cfg.sft.init == "pretrained":
        load_hf_checkpoint(module, cfg.model.path, info, groups)
    trainable = build_trainable(module, groups, cfg.sft.optim, total_steps, cfg.parallel.distributed_optimizer)
    return Policy("sft", module, groups, info, trainable)


def run_sft(cfg: Config, log) -> Policy:
    """Trains ``cfg.sft.epochs`` over ``cfg.sft.train_path``; exports to ``cfg.sft.out_dir``."""
    s, p = cfg.sft, cfg.parallel
    groups = build_parallel_groups(p.tp, p.pp, p.cp, p.ep, p.etp)
    model_parallel_cuda_manual_seed(cfg.trainer.seed)
    tokenizer_dir = cfg.model.tokenizer or cfg.model.path
    tokenizer = load_tokenizer(tokenizer_dir)
    data_cfg = PromptDataConfig.from_section(cfg.data, s.train_path)
    data = load_prompt_dataset(data_cfg, tokenizer)
    rows = within_length(data, tokenizer, s.max_len)
    log(0, 0, {"rows": len(data), "too_long": len(data) - len(rows)})
    sampler = PromptSampler(len(rows), s.batch_size // groups.dp_size, groups.dp_rank, groups.dp_size, cfg.data.seed)
    steps = s.epochs * sampler.steps_per_epoch
    policy = build_policy(cfg, groups, steps)
    head, pad = nll_head(policy), tokenizer.pad_token_id or 0
    for step in range(steps):
        items = [data[rows[i]] for i in next(sampler)]
        batch = sft_batch(items, tokenizer, pad, device())
        micro = [batch.select(i) for i in batch.micro_batch_index(s.micro_batch_size)]
        m = policy.train_step(micro, head)
        log(step + 1, steps, m)
    export_hf(policy.module, policy.info, groups, s.out_dir, copy_from=tokenizer_dir)
    return policy
