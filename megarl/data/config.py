"""Typed config for the prompt dataset section (`data.*`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from megarl.data.sources import Columns
from megarl.errors import DataError


@dataclass
class PromptDataConfig:
    """Where prompts come from and how they become token ids."""

    paths: list[str] = field(default_factory=list)
    """JSONL / Parquet files, read in order and concatenated."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens are dropped and counted as `too_long`."""
    apply_chat_template: bool = True
    """Render through tokenizer.apply_chat_template when the tokenizer has a template."""
    skip_malformed: bool = False
    """Skip and count malformed rows instead of raising on the first one."""
    system_prompt: str | None = None
    """Optional system message prepended to every chat-templated prompt."""
    split: str | None = None
    """Split read from a saved `DatasetDict` or a hub dataset (files have none)."""
    subset: str | None = None
    """Configuration name of a hub dataset (e.g. "main" for openai/gsm8k)."""
    columns: Columns = field(default_factory=Columns)
    """Column mapping: prompt_key, answer_key, or a row_map function."""

    @classmethod
    def from_section(cls, data: Any, path: str, split: str | None = None,
                     subset: str | None = None, entry: Any = None) -> "PromptDataConfig":
        """Options for one source from the run config's `data` section (megarl.config.DataConfig);
        ``entry`` (a data.train_mix / data.eval_sets entry) may name its own columns."""
        def pick(key: str, default: str) -> str:
            own = getattr(entry, key, None)
            return own if own is not None else getattr(data, key, default)

        columns = Columns(pick("prompt_key", "prompt"), pick("answer_key", "answer"), pick("row_map", ""))
        return cls(paths=[path], max_prompt_len=data.max_prompt_len,
                   apply_chat_template=data.apply_chat_template,
                   skip_malformed=data.skip_malformed,
                   system_prompt=getattr(data, "system_prompt", None),
                   split=split, subset=subset, columns=columns)

    def validate(self) -> None:
        """Raise one clear line naming the bad key and the fix."""
        if isinstance(self.paths, str):
            raise DataError("data.paths is a string; write it as a list: data.paths=[...]")
        if not self.paths:
            raise DataError("data.paths is empty; set data.paths=[path/to/train.jsonl]")
        if self.max_prompt_len <= 0:
            raise DataError(f"data.max_prompt_len={self.max_prompt_len}; set a positive token count")
