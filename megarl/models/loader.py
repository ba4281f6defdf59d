"""Loads a Hugging Face safetensors checkpoint straight into a sharded GPTModel.

Each rank reads only the rows / columns its parameters own (see
``layouts`` for the fused and sharded layouts) and copies them in place. Every
parameter of the model must be found in the checkpoint (else an error lists
the missing tensors); checkpoint tensors the model does not use are logged
and returned.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from megarl.distributed.groups import ParallelGroups
from megarl.models import layouts
from megarl.models.hf_config import ModelConfigError, ModelInfo
from megarl.models.safetensors_io import CheckpointReader
from megarl.models.weight_map import (
    EXPERT_DOWN, EXPERT_GATE_UP, EXPERT_KINDS, GATE_UP, GROUPED_DOWN, GROUPED_GATE_UP, QKV, REPLICATED, ROW,
    VOCAB, Rule, expected_hf_names, model_rules,
)

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load did on this rank."""

    loaded: list[str] = field(default_factory=list)  # Megatron parameter names filled
    skipped: list[str] = field(default_factory=list)  # allowed-missing parameters left as they were
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no model parameter reads


def _read_vocab(reader: CheckpointReader, name: str, rows_per_rank: int, info: ModelInfo, rank: int):
    start = rank * rows_per_rank
    end = min(start + rows_per_rank, info.vocab_size)
    if end <= start:  # this rank holds padding only
        return torch.zeros(rows_per_rank, reader.shape(name)[1], dtype=torch.float32)
    return layouts.pad_rows(reader.read(name, rows=(start, end)), rows_per_rank)


def _read_experts(reader: CheckpointReader, rule: Rule, groups: ParallelGroups) -> torch.Tensor:
    """This expert-TP rank's slice of an expert parameter (one expert, or all local ones grouped)."""
    r, n = groups.etp_rank, groups.etp_size
    names = rule.hf_names
    if rule.kind in (EXPERT_DOWN, GROUPED_DOWN):
        fc2 = [reader.read(d, cols=layouts.chunk_range(reader.shape(d)[1], r, n)) for d in names]
        return fc2[0] if rule.kind == EXPERT_DOWN else layouts.group_fc2(fc2)
    fc1 = []
    for gate, up in zip(names[::2], names[1::2]):
        rows = layouts.chunk_range(reader.shape(gate)[0], r, n)
        fc1.append(torch.cat([reader.read(gate, rows=rows), reader.read(up, rows=rows)]))
    return fc1[0] if rule.kind == EXPERT_GATE_UP else layouts.group_fc1(fc1)


def read_shard(reader: CheckpointReader, rule: Rule, info: ModelInfo, groups: ParallelGroups,
               local_rows: int) -> torch.Tensor:
    """This TP rank's slice of the parameter ``rule`` describes."""
    r, n = groups.tp_rank, groups.tp_size
    names = rule.hf_names
    if rule.kind in EXPERT_KINDS:
        return _read_experts(reader, rule, groups)
    if rule.kind == REPLICATED:
        return reader.read(names[0])
    if rule.kind == ROW:
        return reader.read(names[0], cols=layouts.chunk_range(reader.shape(names[0])[1], r, n))
    if rule.kind == QKV:
        ranges = layouts.qkv_ranges(info.num_groups, info.num_heads, info.head_dim, r, n)
        q, k, v = (reader.read(h, rows=rg) for h, rg in zip(names, ranges))
        return layouts.interleave_qkv(q, k, v, info.num_groups // n)
    if rule.kind == GATE_UP:
        rows = layouts.chunk_range(reader.shape(names[0])[0], r, n)
        return torch.cat([reader.read(names[0], rows=rows), reader.read(names[1], rows=rows)])
    if rule.kind == VOCAB:
        return _read_vocab(reader, names[0], local_rows, info, r)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def _checked_shard(reader: CheckpointReader, rule: Rule, info: ModelInfo, groups: ParallelGroups,
                   param: torch.Tensor) -> torch.Tensor:
    """``read_shard``, or a ModelConfigError when the HF tensors do not have config.json's shapes."""
    if rule.kind == VOCAB and reader.shape(rule.hf_names[0])[0] != info.vocab_size:
        shard = None  # fewer rows would be padded silently
    else:
        try:
            shard = read_shard(reader, rule, info, groups, param.shape[0])
        except (RuntimeError, IndexError):  # slices past a too-small tensor
            shard = None
    if shard is None or shard.shape != param.shape:
        shapes = ", ".join(f"{h} {tuple(reader.shape(h))}" for h in rule.hf_names)
        raise ModelConfigError(
            f"{reader.path!r}: {shapes} do not fit its config.json (hidden_size={info.hidden_size}, "
            f"vocab_size={info.vocab_size}, heads={info.num_heads}/{info.num_groups} kv, "
            f"intermediate_size={info.ffn_hidden_size}{_moe_shape(info)}); the weights and config.json are of different models")
    return shard


def _moe_shape(info: ModelInfo) -> str:
    m = info.moe
    return "" if m is None else f", experts={m.num_experts} of {m.ffn_hidden_size}"


def _check_expert_count(unused: list[str], info: ModelInfo, hf_dir: str) -> None:
    """Expert tensors past config.json's expert count: the weights are of a model with more experts."""
    extra = [n for n in unused if info.moe and f"{info.moe.block}experts." in n]
    if extra:
        raise ModelConfigError(
            f"{hf_dir!r} holds expert tensors its config.json (num_experts={info.moe.num_experts}) has no "
            f"place for, e.g. {extra[0]}; the weights and config.json are of different models")


def _missing(rules: dict[str, Rule], available: set[str]) -> dict[str, list[str]]:
    return {name: [h for h in rule.hf_names if h not in available]
            for name, rule in rules.items() if any(h not in available for h in rule.hf_names)}


def load_hf_checkpoint(
    model: nn.Module, hf_dir: str, info: ModelInfo, groups: ParallelGroups,
    *, allow_missing: tuple[str, ...] = (),
) -> LoadReport:
    """Fills every parameter of ``model`` (this rank's shard) from ``hf_dir``.

    ``allow_missing``: HF tensor names whose absence is fine (e.g. ``score.weight``
    when a value model starts from a causal LM); their parameters are left as is.
    """
    reader = CheckpointReader(hf_dir)
    rules = model_rules(model, info)
    missing = _missing(rules, reader.names())
    fatal = {k: v for k, v in missing.items() if not set(v) <= set(allow_missing)}
    if fatal:
        listed = ", ".join(f"{', '.join(v)} (for {k})" for k, v in sorted(fatal.items()))
        raise ModelConfigError(f"{hf_dir!r} lacks tensors the {info.arch} of its config.json needs: {listed}; "
                               f"the weights are of another model, or the files are incomplete")
    unused = sorted(reader.names() - expected_hf_names(info))
    _check_expert_count(unused, info, hf_dir)
    params = model.state_dict(keep_vars=True)
    report = LoadReport(skipped=sorted(missing), unused=unused)
    with torch.no_grad():
        for name, rule in rules.items():
            if name in missing:
                continue
            param = params[name]
            param.copy_(_checked_shard(reader, rule, info, groups, param))
            report.loaded.append(name)
    reader.close()
    if report.unused and groups.tp_rank == groups.pp_rank == groups.dp_rank == 0:
        log.warning("checkpoint tensors not used by %s: %s", info.hf_architecture(), ", ".join(report.unused))
    return report
