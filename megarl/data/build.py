"""The run's prompt sets from its `data` section: training set and sampler, held-out set, eval sets.

    train_set, sampler = build_train_data(cfg.data, tokenizer, dp_rank, dp_size)
    held_out = build_held_out(cfg.data, tokenizer)          # data.eval_path, or None
    sets = build_eval_sets(cfg.data, tokenizer)             # {name: PromptDataset} of data.eval_sets
"""
from __future__ import annotations

from typing import Any

from megarl.data.config import PromptDataConfig
from megarl.data.dataset import PromptDataset, load_prompt_dataset
from megarl.data.mixture import MixtureSampler, load_mixture
from megarl.data.sampler import PromptSampler


def build_train_data(data: Any, tokenizer: Any, dp_rank: int, dp_size: int):
    """(dataset, sampler): ``data.train_mix`` mixed by weight when set, else ``data.train_path`` alone
    (whose sampler is the one-set :class:`PromptSampler`, so older checkpoints resume)."""
    per_rank = data.batch_size // dp_size
    if not data.train_mix:
        cfg = PromptDataConfig.from_section(data, data.train_path, data.train_split, data.subset)
        dataset = load_prompt_dataset(cfg, tokenizer)
        return dataset, PromptSampler(len(dataset), per_rank, dp_rank, dp_size, seed=data.seed)
    parts = [PromptDataConfig.from_section(data, s.path, s.split, s.subset, s) for s in data.train_mix]
    dataset, sizes = load_mixture(parts, tokenizer)
    weights = [s.weight for s in data.train_mix]
    return dataset, MixtureSampler(sizes, weights, per_rank, dp_rank, dp_size, seed=data.seed)


def build_held_out(data: Any, tokenizer: Any) -> PromptDataset | None:
    """``data.eval_path`` (eval/accuracy), or None when unset."""
    if not data.eval_path:
        return None
    return load_prompt_dataset(PromptDataConfig.from_section(data, data.eval_path, data.eval_split, data.subset),
                               tokenizer)


def build_eval_sets(data: Any, tokenizer: Any) -> dict[str, PromptDataset]:
    """Each of ``data.eval_sets`` by name, in the order given."""
    return {s.name: load_prompt_dataset(PromptDataConfig.from_section(data, s.path, s.split, s.subset, s), tokenizer)
            for s in data.eval_sets}
