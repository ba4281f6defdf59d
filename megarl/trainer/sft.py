"""Supervised warm start on (prompt, response) rows with the same model code as PPO.

The loss is the mean negative log-likelihood of response tokens (the prompt is
context only), summed over micro-batches and DP ranks and divided once by the
global token count. The export gets ``megarl_sft.json``: the recipe and the weights' hashes
(megarl/trainer/sft_record.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megarl.config import Config
from megarl.data.sft import SFTRow, build_sft_data
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed import build_parallel_groups, device
from megarl.models.builder import build_gpt_model
from megarl.models.exporter import export_hf
from megarl.models.hf_config import read_hf_config
from megarl.models.loader import load_hf_checkpoint
from megarl.roles.batch import SampleBatch
from megarl.roles.build import model_options
from megarl.roles.optim import build_trainable
from megarl.roles.base import RunOptions
from megarl.roles.policy import Policy, token_logprobs
from megarl.trainer.sft_record import sft_recipe, write_sft_record


def sft_batch(rows: list[SFTRow], pad_id: int, dev) -> SampleBatch:
    """Prompt + response + eos, right-padded; the mask covers response and eos."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(rows), width)  # (B, T) 1 = trained token
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        mask[i, r.prompt_len : len(r.ids)] = 1.0
    return SampleBatch(ids.to(dev), mask.to(dev), torch.tensor([len(r.ids) for r in rows], device=dev))


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
    sequence_split = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1  # padded widths split over TP
    return Policy("sft", module, groups, info, trainable, RunOptions(pad_multiple=sequence_split))


def run_sft(cfg: Config, log) -> Policy:
    """Trains ``cfg.sft.epochs`` over ``cfg.sft.train_path`` (or ``train_mix``); exports to ``cfg.sft.out_dir``."""
    s, p = cfg.sft, cfg.parallel
    groups = build_parallel_groups(p.tp, p.pp, p.cp, p.ep, p.etp)
    model_parallel_cuda_manual_seed(cfg.trainer.seed)
    tokenizer_dir = cfg.model.tokenizer or cfg.model.path
    tokenizer = load_tokenizer(tokenizer_dir)
    data = build_sft_data(cfg, tokenizer, groups.dp_rank, groups.dp_size)
    log(0, 0, data.counts)
    policy = build_policy(cfg, groups, data.steps)
    head, pad = nll_head(policy), tokenizer.pad_token_id or 0
    m = {"nll": 0.0, "tokens": 0}
    for step in range(data.steps):
        batch = sft_batch([data.rows[i] for i in next(data.sampler)], pad, device())
        micro = [batch.select(i) for i in batch.micro_batch_index(s.micro_batch_size)]
        m = policy.train_step(micro, head)
        log(step + 1, data.steps, m)
    export_hf(policy.module, policy.info, groups, s.out_dir, copy_from=tokenizer_dir)
    dist.barrier()  # every stage's files are written before rank 0 hashes them
    if dist.get_rank() == 0:
        recipe = sft_recipe(cfg, dist.get_world_size())
        write_sft_record(s.out_dir, recipe, data.steps, float(m["nll"]) / max(float(m["tokens"]), 1.0))
    return policy
