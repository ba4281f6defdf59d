"""SFT rows from the run's `sft` section, through the same sources as the prompt sets.

    data = build_sft_data(cfg, tokenizer, dp_rank, dp_size)
    data.rows[i]         # SFTRow: prompt + response + eos ids, and where the response starts
    next(data.sampler)   # this rank's row indices for one step
    data.steps           # optimizer steps of the whole run (sft.epochs)

A set is read by :mod:`megarl.data.sources` (a file, a saved dataset or a hub
name; ``sft.prompt_key`` / ``sft.row_map`` map its columns) and templated like
the RL prompts (``data.apply_chat_template``, ``data.max_prompt_len``, ...);
the response is the ``sft.response_key`` column. ``sft.train_path`` alone is
sampled by :class:`PromptSampler`; ``sft.train_mix`` by :class:`MixtureSampler`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megarl.data.config import PromptDataConfig
from megarl.data.dataset import PromptItem, load_prompt_dataset
from megarl.data.mixture import MixtureSampler
from megarl.data.sampler import PromptSampler
from megarl.data.sources import Columns
from megarl.errors import DataError

_ANSWER_KEYS = ("answer", "ground_truth")  # rows.parse_row moves these out of extra, into item.answer


@dataclass
class SFTRow:
    """One trained sequence."""

    ids: list[int]  # prompt ids + response ids + eos
    prompt_len: int  # the loss covers ids[prompt_len:]


@dataclass
class SFTData:
    """The run's rows, its sampler and its length."""

    rows: list[SFTRow]  # every kept row of every set, the sets concatenated
    sampler: Any  # PromptSampler (one set) or MixtureSampler; yields this rank's indices into rows
    steps: int  # optimizer steps of the run
    counts: dict[str, int]  # rows (prompts that fit data.max_prompt_len), too_long (over sft.max_len)


@dataclass(frozen=True)
class SFTPart:
    """How one set is read: its prompt-set options and its response column."""

    prompts: PromptDataConfig
    response_key: str
    weight: float = 1.0


def _pick(entry: Any, section: Any, key: str) -> str:
    """The entry's own value of ``key``, else the ``sft`` section's."""
    own = getattr(entry, key, None)
    return own if own is not None else getattr(section, key)


def sft_parts(cfg: Any) -> list[SFTPart]:
    """``sft.train_mix`` entries (own columns over ``sft.*``'s), or ``sft.train_path`` alone."""
    s = cfg.sft
    parts = []
    for e in s.train_mix or [None]:
        path, split, subset = (s.train_path, s.train_split, s.subset) if e is None else (e.path, e.split, e.subset)
        base = PromptDataConfig.from_section(cfg.data, path, split, subset)
        columns = Columns(_pick(e, s, "prompt_key"), "answer", _pick(e, s, "row_map"))
        parts.append(SFTPart(dataclasses.replace(base, columns=columns), _pick(e, s, "response_key"),
                             1.0 if e is None else e.weight))
    return parts


def response_text(item: PromptItem, key: str) -> str:
    """The row's ``key`` column; one line naming the row and the fix when it is missing or not text."""
    value = item.answer if key in _ANSWER_KEYS else item.extra.get(key)
    if value is None:
        columns = ", ".join(map(str, item.extra)) or "none"
        raise DataError(f"{item.source}: SFT row has no {key!r} column (sft.response_key; its columns besides "
                        f"the prompt: {columns}); set sft.response_key to the response column or map rows "
                        "with sft.row_map")
    if not isinstance(value, str):
        raise DataError(f"{item.source}: SFT response {key!r} is a {type(value).__name__}; it must be a string")
    return value


def sft_rows(items: list[PromptItem], response_key: str, tokenizer: Any, max_len: int) -> list[SFTRow]:
    """Prompt + response + eos of each item whose whole sequence fits ``max_len`` tokens."""
    rows = []
    for item in items:
        response = tokenizer(response_text(item, response_key), add_special_tokens=False)["input_ids"]
        ids = item.prompt_ids + list(response) + [tokenizer.eos_token_id]
        if len(ids) <= max_len:
            rows.append(SFTRow(ids, len(item.prompt_ids)))
    return rows


def build_sft_data(cfg: Any, tokenizer: Any, dp_rank: int, dp_size: int) -> SFTData:
    """Every set read, filtered to ``sft.max_len`` and concatenated; the sampler and step count."""
    s = cfg.sft
    parts = sft_parts(cfg)
    rows: list[SFTRow] = []
    sizes, prompts = [], 0
    for part in parts:
        items = load_prompt_dataset(part.prompts, tokenizer).items
        kept = sft_rows(items, part.response_key, tokenizer, s.max_len)
        if not kept:
            raise DataError(f"{part.prompts.paths[0]}: no SFT row fits sft.max_len={s.max_len} tokens "
                            f"({len(items)} rows); raise sft.max_len")
        prompts += len(items)
        sizes.append(len(kept))
        rows.extend(kept)
    counts = {"rows": prompts, "too_long": prompts - len(rows)}
    per_rank = s.batch_size // dp_size
    if not s.train_mix:
        sampler = PromptSampler(len(rows), per_rank, dp_rank, dp_size, cfg.data.seed)
        return SFTData(rows, sampler, s.epochs * sampler.steps_per_epoch, counts)
    if len(rows) < s.batch_size:
        raise DataError(f"sft.train_mix: {len(rows)} rows in all, fewer than one global batch of "
                        f"sft.batch_size={s.batch_size}; lower it or add data")
    sampler = MixtureSampler(sizes, [p.weight for p in parts], per_rank, dp_rank, dp_size, cfg.data.seed)
    return SFTData(rows, sampler, s.epochs * (len(rows) // s.batch_size), counts)
