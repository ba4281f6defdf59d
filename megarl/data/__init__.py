"""Prompt data: loading, chat templating, DP-sharded sampling, packing."""
from megarl.data.config import PromptDataConfig
from megarl.data.dataset import (PromptBatch, PromptDataset, PromptItem, load_prompt_dataset,
                                 render_prompt)
from megarl.data.packing import PackedInputs, build_packed_inputs, pack_sequences, unpack
from megarl.data.rows import RawRow, iter_records, parse_row
from megarl.data.sampler import PromptSampler

__all__ = [
    "PromptDataConfig", "PromptBatch", "PromptDataset", "PromptItem", "load_prompt_dataset",
    "render_prompt", "PackedInputs", "build_packed_inputs", "pack_sequences", "unpack",
    "RawRow", "iter_records", "parse_row", "PromptSampler",
]
