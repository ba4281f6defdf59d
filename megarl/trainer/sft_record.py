"""What an SFT export was made from: ``OUT_DIR/megarl_sft.json`` beside the weights.

    recipe = sft_recipe(cfg, world_size)     # the settings and inputs that decide the weights
    write_sft_record(out_dir, recipe, steps, final_nll)

The recipe is every config value launch/sft.py reads (``sft.*`` except
``out_dir``, the model, the data templating, the layout, the seeds), the
world size, and the SHA-256 of the local inputs (training files, the model's
config.json). The record adds the weights' SHA-256, the run's length and last
loss, and the torch / megatron-core versions. A shipped checkpoint is pinned
to its yaml by comparing the recipe the yaml gives today with the recorded
one (``recipe_differences``), and the files' hashes with the recorded ones (tests/test_sft_assets.py).
Same recipe, code and versions give the same bits; the record says which
versions made them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

RECORD = "megarl_sft.json"
_DATA_KEYS = ("max_prompt_len", "apply_chat_template", "skip_malformed", "seed", "system_prompt")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _local_inputs(cfg: Any) -> dict[str, str]:
    """SHA-256 of every local file the run reads (hub and saved datasets are named in the recipe only)."""
    s = cfg.sft
    paths = [e.path for e in s.train_mix] if s.train_mix else [s.train_path]
    paths.append(str(Path(cfg.model.path) / "config.json"))
    return {p: file_sha256(p) for p in paths if Path(p).is_file()}


def sft_recipe(cfg: Any, world_size: int) -> dict[str, Any]:
    """The settings and inputs that decide an SFT run's weights (JSON-ready)."""
    sft = dataclasses.asdict(cfg.sft)
    sft.pop("out_dir")
    return {
        "sft": sft,
        "model": {"path": cfg.model.path, "tokenizer": cfg.model.tokenizer, "dtype": cfg.model.dtype},
        "data": {k: getattr(cfg.data, k, None) for k in _DATA_KEYS},  # system_prompt: None where data has none
        "parallel": dataclasses.asdict(cfg.parallel),
        "trainer_seed": cfg.trainer.seed,
        "world_size": world_size,
        "inputs_sha256": _local_inputs(cfg),
    }


def weights_sha256(out_dir: str | Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(Path(out_dir).glob("*.safetensors"))}


def write_sft_record(out_dir: str | Path, recipe: dict[str, Any], steps: int, final_nll: float) -> None:
    import megatron.core
    import torch

    record = {"recipe": recipe, "steps": steps, "final_nll": round(final_nll, 6),
              "weights_sha256": weights_sha256(out_dir),
              "versions": {"torch": torch.__version__, "megatron_core": megatron.core.__version__}}
    (Path(out_dir) / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_sft_record(out_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(out_dir) / RECORD).read_text())


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def recipe_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: recorded A, now B' for each recorded value the current recipe does not repeat. Keys the
    record lacks (a setting added since, at a default that keeps the old behaviour) are not compared."""
    now = _flat(json.loads(json.dumps(current)))
    return [f"{k}: recorded {v!r}, now {now.get(k, '<absent>')!r}"
            for k, v in _flat(recorded).items() if now.get(k, object()) != v]
