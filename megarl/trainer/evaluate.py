"""Held-out accuracy: greedy responses to the eval prompts, scored by exact answer match."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.data import PromptDataset
from megarl.rewards import math_answer_reward
from megarl.rollout.engine import RolloutEngine, SamplingParams, sample_requests


def eval_count(num_items: int, limit: int) -> int:
    """Eval prompts evaluated over all DP ranks: the first ``limit`` (0: all)."""
    return min(num_items, limit) if limit > 0 else num_items


def eval_indices(num_items: int, limit: int, dp_rank: int, dp_size: int) -> list[int]:
    """This DP rank's share of the first ``limit`` (0: all) eval prompts."""
    return list(range(dp_rank, eval_count(num_items, limit), dp_size))


def held_out_accuracy(engine: RolloutEngine, dataset: PromptDataset, tokenizer, groups,
                      max_new_tokens: int, limit: int = 0) -> float:
    """Fraction of eval prompts whose greedy response has the right answer (all DP ranks)."""
    index = eval_indices(len(dataset), limit, groups.dp_rank, groups.dp_size)
    items = [dataset[i] for i in index]
    correct = 0.0
    if items:
        requests = sample_requests([it.prompt_ids for it in items], 1, 0, max_new_tokens)  # greedy: seed unused
        from megarl.trainer.rollout import bind_items

        bind_items(engine, dict(enumerate(items)))
        results = engine.generate(requests, SamplingParams(temperature=0.0))
        answers = [r.extra.get("final_turn_ids", r.response_ids) for r in results]  # multi-turn: the last turn
        texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
        correct = sum(math_answer_reward(t, it.answer) for t, it in zip(texts, items) if it.answer is not None)
    counts = torch.tensor([correct, float(len(items))], dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(counts, group=groups.dp)
    return float(counts[0] / counts[1].clamp_min(1.0))
