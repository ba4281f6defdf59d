"""Writes a sharded GPTModel back as a Hugging Face directory ``transformers`` loads.

Every TP rank of data-parallel replica 0 takes part: each parameter is
all-gathered over TP, un-fused (QKV, gate/up) and un-padded (vocab) into its
HF tensors. TP rank 0 of each pipeline stage then writes that stage's tensors
as its own safetensors file(s) (numbered across stages), and global rank 0
writes ``model.safetensors.index.json`` (when there is more than one file),
``config.json`` and copies tokenizer / generation-config files. Every file
gets the mode a new file gets under the umask (0644 under 022). The output
directory must be shared by the writing ranks (one node, or a shared file
system).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megarl.distributed.groups import ParallelGroups
from megarl.errors import NonFiniteError
from megarl.models import layouts
from megarl.models.hf_config import ModelInfo
from megarl.models.safetensors_io import (
    INDEX, default_mode, plan_shards, save_tensors, shard_file_name, write_index)
from megarl.models.weight_map import (
    EXPERT_DOWN, EXPERT_GATE_UP, EXPERT_KINDS, GATE_UP, GROUPED_DOWN, GROUPED_GATE_UP, QKV, REPLICATED, ROW,
    VOCAB, Rule, model_rules,
)

SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportSummary:
    """What :func:`export_hf` wrote: HF tensors and their bytes in the safetensors files."""

    tensors: int
    bytes: int


def _gather(param: torch.Tensor, groups: ParallelGroups, group=None, size=None) -> list[torch.Tensor]:
    """``param`` of every rank of ``group`` (default: the TP group), in rank order."""
    group, size = (groups.tp, groups.tp_size) if group is None else (group, size)
    if size == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def tp_shards(param: torch.Tensor, rule, groups: ParallelGroups) -> list[torch.Tensor]:
    """One parameter's shards over the TP group in rank order (a replicated one: itself alone)."""
    return [param.detach()] if rule.kind == REPLICATED else _gather(param, groups)


def merge_expert_shards(kind: str, names: tuple[str, ...], shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert-TP shards of one expert parameter (one EP rank's) -> its HF tensors."""
    if kind in (GROUPED_GATE_UP, GROUPED_DOWN):  # -> per expert, then as the one-expert kinds
        ungroup = layouts.ungroup_fc1 if kind == GROUPED_GATE_UP else layouts.ungroup_fc2
        experts = len(names) // 2 if kind == GROUPED_GATE_UP else len(names)
        per_shard = [ungroup(s, experts) for s in shards]  # [etp][expert]
        one = EXPERT_GATE_UP if kind == GROUPED_GATE_UP else EXPERT_DOWN
        width = 2 if one == EXPERT_GATE_UP else 1
        out = {}
        for e in range(experts):
            out.update(merge_expert_shards(one, names[e * width:(e + 1) * width], [s[e] for s in per_shard]))
        return out
    if kind == EXPERT_DOWN:
        return {names[0]: torch.cat(shards, dim=1)}
    return dict(zip(names, layouts.split_gate_up(shards)))


def expert_hf_tensors(rule: Rule, param: torch.Tensor, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Collective over EP and expert-TP: the HF tensors of one expert parameter on every EP rank
    (this rank's local experts and the same local slot of the others'), on every rank."""
    out = {}
    for ep_rank, shard in enumerate(_gather(param, groups, groups.ep, groups.ep_size)):
        shards = _gather(shard, groups, groups.etp, groups.etp_size)
        out.update(merge_expert_shards(rule.kind, rule.ep_hf_names[ep_rank], shards))
    return out


def gather_expert_tensors(model: nn.Module, info: ModelInfo, groups: ParallelGroups,
                          dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Collective over every rank of this stage: the HF tensors of all experts (every EP rank's) on
    the stage's writer (TP, DP and CP rank 0, which is also expert-TP rank 0); an empty dict elsewhere."""
    writer = groups.tp_rank == groups.dp_rank == groups.cp_rank == 0
    params = model.state_dict(keep_vars=True)
    out = {}
    for name, rule in model_rules(model, info).items():
        if rule.kind not in EXPERT_KINDS:
            continue
        tensors = expert_hf_tensors(rule, params[name], groups)
        if writer:
            out.update({hf_name: t.to("cpu", dtype or t.dtype).clone() for hf_name, t in tensors.items()})
    return out


def merge_shards(rule: Rule, shards: list[torch.Tensor], info: ModelInfo) -> dict[str, torch.Tensor]:
    """TP shards of one Megatron parameter -> its HF tensors."""
    names = rule.hf_names
    if rule.kind == REPLICATED:
        return {names[0]: shards[0]}
    if rule.kind == ROW:
        return {names[0]: torch.cat(shards, dim=1)}
    if rule.kind == QKV:
        return dict(zip(names, layouts.split_qkv(torch.cat(shards), info.num_groups, info.num_heads)))
    if rule.kind == GATE_UP:
        return dict(zip(names, layouts.split_gate_up(shards)))
    if rule.kind == VOCAB:
        return {names[0]: torch.cat(shards)[: info.vocab_size]}
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def gather_hf_tensors(model: nn.Module, info: ModelInfo, groups: ParallelGroups,
                      dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """This stage's HF tensors on TP rank 0 (CPU); an empty dict on other TP ranks."""
    params = model.state_dict(keep_vars=True)
    out = {}
    for name, rule in model_rules(model, info).items():
        if not rule.export or rule.kind in EXPERT_KINDS:  # experts: gather_expert_tensors
            continue
        shards = tp_shards(params[name], rule, groups)
        if groups.tp_rank == 0:
            for hf_name, t in merge_shards(rule, shards, info).items():
                out[hf_name] = t.to("cpu", dtype or t.dtype).clone()
    return out


def check_finite(model: nn.Module, info: ModelInfo, dtype: Optional[torch.dtype], out_dir: str) -> None:
    """Collective over the world: raises on every rank if any exported parameter shard, on
    any rank, has a NaN or inf (in ``dtype``, where the cast could overflow); the message
    names the first (lowest rank, model order) with its HF names."""
    params = model.state_dict(keep_vars=True)
    bad = None
    for name, rule in model_rules(model, info).items():
        t = params[name].detach()
        if rule.export and not torch.isfinite(t if dtype is None else t.to(dtype)).all():
            bad = f"{name} (HF {', '.join(rule.hf_names)})"
            break
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, bad)
    first = next((f for f in found if f is not None), None)
    if first is not None:
        raise NonFiniteError(f"export refused: {first} has NaN or inf values; nothing written to {out_dir}")


def hf_config_for_export(info: ModelInfo) -> dict:
    cfg = dict(info.hf_config, architectures=[info.hf_architecture()])
    if info.value_head and len(cfg.get("id2label") or {}) != 1:  # one label: num_labels = 1
        cfg.pop("num_labels", None)
        cfg.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return cfg


def _export_dtype(info: ModelInfo, dtype) -> Optional[torch.dtype]:
    if dtype is not None:
        return dtype
    return _DTYPE_NAMES.get(info.hf_config.get("dtype") or info.hf_config.get("torch_dtype"))


def _write_stage(tensors, out_dir, groups, max_shard_bytes) -> tuple[dict[str, str], int]:
    """Writes this stage's files; returns the name -> file map and byte total of all stages."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    files = plan_shards(sizes, max_shard_bytes)
    counts = [None] * groups.pp_size
    dist.all_gather_object(counts, (len(files), sum(sizes.values())), group=groups.pp)
    first, total = sum(c for c, _ in counts[: groups.pp_rank]), sum(c for c, _ in counts)
    weight_map = {}
    for i, names in enumerate(files):
        file = shard_file_name(first + i, total)
        save_tensors(os.path.join(out_dir, file), {k: tensors[k] for k in names})
        weight_map.update({k: file for k in names})
    maps = [None] * groups.pp_size
    dist.all_gather_object(maps, weight_map, group=groups.pp)
    return {k: v for m in maps for k, v in m.items()}, sum(b for _, b in counts)


def _write_side_files(info: ModelInfo, out_dir: str, copy_from: Optional[str]) -> None:
    """config.json, and ``copy_from``'s tokenizer / generation-config files byte for byte."""
    path = os.path.join(out_dir, "config.json")
    with open(path, "w") as f:
        json.dump(hf_config_for_export(info), f, indent=2, sort_keys=True)
    default_mode(path)
    for name in SIDE_FILES if copy_from else ():
        src, dst = os.path.join(copy_from, name), os.path.join(out_dir, name)
        if os.path.isfile(src):
            if os.path.exists(dst):
                os.remove(dst)  # written fresh: an old file's mode (read-only, say) is not kept
            shutil.copyfile(src, dst)  # the contents; the mode is a new file's, not src's


def export_hf(
    model: nn.Module, info: ModelInfo, groups: ParallelGroups, out_dir: str, *,
    copy_from: Optional[str] = None, dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Optional[ExportSummary]:
    """Collective over the world: writes ``model`` as a HF checkpoint into ``out_dir``; returns
    what was written (all stages) on global rank 0 and None on the other ranks.

    ``dtype``: tensor dtype in the files; default the ``dtype`` / ``torch_dtype``
    that config.json declares, else the parameters' own. ``copy_from``: a HF
    directory whose tokenizer and generation-config files are copied. Refused
    (:class:`NonFiniteError` on every rank, nothing written) if any weight is NaN or inf.
    """
    if any(getattr(m, "lora_enabled", False) for m in model.modules()):
        raise ValueError("export_hf: the model has active LoRA adapters; export inside "
                         "megarl.models.lora.merged_lora(model) so the files hold W + s B A")
    dtype = _export_dtype(info, dtype)
    check_finite(model, info, dtype, out_dir)
    summary = None
    experts = gather_expert_tensors(model, info, groups, dtype) if info.moe else {}
    if groups.dp_rank == 0 and groups.cp_rank == 0:
        tensors = gather_hf_tensors(model, info, groups, dtype)
        if groups.tp_rank == 0:
            tensors.update(experts)
            os.makedirs(out_dir, exist_ok=True)
            weight_map, total_bytes = _write_stage(tensors, out_dir, groups, max_shard_bytes)
            if groups.pp_rank == 0:
                if len(set(weight_map.values())) > 1:
                    write_index(out_dir, weight_map, total_bytes)
                elif os.path.exists(os.path.join(out_dir, INDEX)):  # stale, would shadow the file
                    os.remove(os.path.join(out_dir, INDEX))
                _write_side_files(info, out_dir, copy_from)
                summary = ExportSummary(tensors=len(weight_map), bytes=total_bytes)
    dist.barrier()
    return summary

