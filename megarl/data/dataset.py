"""Prompt dataset: rows -> rendered prompt text -> token ids, with drop counts.

    ds = load_prompt_dataset(cfg, tokenizer)
    ds.counts    # {"rows": 2000, "malformed": 0, "too_long": 3, "kept": 1997}
    ds[i]        # PromptItem with index == i
    ds.batch([4, 9])  # PromptBatch

Chat templating: when `cfg.apply_chat_template` and the tokenizer has a
`chat_template`, a row's `messages` (or its `prompt` as one user message) is
rendered with add_generation_prompt=True and tokenized without adding
special tokens again. Otherwise the plain `prompt` text is tokenized with the
tokenizer's own special tokens (e.g. BOS); `messages` rows are then an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from megarl.data.config import PromptDataConfig
from megarl.data.rows import RawRow, parse_row
from megarl.data.sources import iter_source, load_row_map, map_columns
from megarl.errors import DataError

_TOKENIZE_CHUNK = 1024  # rows per tokenizer call; bounds peak memory of one call


@dataclass
class PromptItem:
    """One prompt ready for rollout."""

    index: int  # position in the dataset after filtering; what the sampler yields
    prompt_ids: list[int]  # token ids of prompt_text
    prompt_text: str  # text exactly as tokenized (after chat templating)
    answer: str | None  # ground truth for the reward, or None
    extra: dict[str, Any] = field(default_factory=dict)  # free fields for rewards
    messages: list[dict[str, str]] | None = None  # chat form, when templated
    source: str = ""  # "file:line" of the row, for debugging


@dataclass
class PromptBatch:
    """The prompts one DP rank rolls out in one step."""

    items: list[PromptItem]
    epoch: int = 0  # sampler epoch these came from
    step: int = 0  # batch index within that epoch

    def __len__(self) -> int:
        return len(self.items)

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [it.prompt_ids for it in self.items]

    @property
    def prompt_texts(self) -> list[str]:
        return [it.prompt_text for it in self.items]

    @property
    def answers(self) -> list[str | None]:
        return [it.answer for it in self.items]

    @property
    def extras(self) -> list[dict[str, Any]]:
        return [it.extra for it in self.items]

    @property
    def indices(self) -> list[int]:
        return [it.index for it in self.items]


class PromptDataset:
    """Tokenized, filtered prompts; `counts` says what was dropped and why."""

    def __init__(self, items: list[PromptItem], counts: dict[str, int]):
        self.items = items
        self.counts = counts  # rows, malformed, too_long, kept

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def batch(self, indices: Sequence[int], epoch: int = 0, step: int = 0) -> PromptBatch:
        return PromptBatch([self.items[i] for i in indices], epoch=epoch, step=step)


def uses_chat_template(tokenizer: Any, cfg: PromptDataConfig) -> bool:
    return bool(cfg.apply_chat_template and getattr(tokenizer, "chat_template", None))


def render_prompt(row: RawRow, tokenizer: Any, cfg: PromptDataConfig) -> tuple[str, list | None]:
    """Return (text to tokenize, chat messages or None)."""
    if not uses_chat_template(tokenizer, cfg):
        if row.prompt is None:
            raise DataError(
                f"{row.where}: row has 'messages' but chat templating is off "
                "(data.apply_chat_template=false or the tokenizer has no chat_template); "
                "use 'prompt' rows or a tokenizer with a chat template")
        return row.prompt, None
    messages = row.messages or [{"role": "user", "content": row.prompt}]
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, messages


def _read_rows(cfg: PromptDataConfig, tokenizer: Any, counts: dict[str, int]) -> list:
    """Parse and render every row; skip (and count) or raise on malformed ones."""
    rendered = []  # (row, text, messages)
    row_map = load_row_map(cfg.columns.row_map) if cfg.columns.row_map else None
    for path in cfg.paths:
        for where, rec in iter_source(path, cfg.split, cfg.subset):
            counts["rows"] += 1
            try:
                row = parse_row(where, map_columns(where, rec, cfg.columns, row_map))
                rendered.append((row, *render_prompt(row, tokenizer, cfg)))
            except ValueError:
                if not cfg.skip_malformed:
                    raise
                counts["malformed"] += 1
    return rendered


def _tokenize(tokenizer: Any, texts: list[str], templated: bool) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), _TOKENIZE_CHUNK):
        enc = tokenizer(texts[i:i + _TOKENIZE_CHUNK], add_special_tokens=not templated)
        out.extend(list(ids) for ids in enc["input_ids"])
    return out


def _empty_hint(counts: dict, cfg: PromptDataConfig) -> str:
    """The fix for an empty prompt set, from why the rows were dropped."""
    if counts.get("too_long"):
        return f"{counts['too_long']} prompts are longer than data.max_prompt_len={cfg.max_prompt_len}: raise it"
    if not counts.get("rows"):
        return "the files hold no rows: check the data paths"
    return "every row was skipped: fix the rows counted above or the prompt field / template"


def load_prompt_dataset(cfg: PromptDataConfig, tokenizer: Any) -> PromptDataset:
    """Read cfg.paths, template, tokenize, and drop prompts over cfg.max_prompt_len."""
    cfg.validate()
    counts = {"rows": 0, "malformed": 0, "too_long": 0, "kept": 0}
    rendered = _read_rows(cfg, tokenizer, counts)
    templated = uses_chat_template(tokenizer, cfg)
    all_ids = _tokenize(tokenizer, [text for _, text, _ in rendered], templated)
    items: list[PromptItem] = []
    for (row, text, messages), ids in zip(rendered, all_ids):
        if len(ids) > cfg.max_prompt_len:
            counts["too_long"] += 1
            continue
        items.append(PromptItem(index=len(items), prompt_ids=ids, prompt_text=text,
                                answer=row.answer, extra=row.extra,
                                messages=messages, source=row.where))
    counts["kept"] = len(items)
    if not items:
        raise DataError(f"{cfg.paths}: no prompts left after filtering ({counts}); {_empty_hint(counts, cfg)}")
    return PromptDataset(items, counts)
