"""Checks of the files a run reads and writes: output directories, data sources, tokenizer, SFT data."""
from __future__ import annotations

import os
from pathlib import Path

from megarl.errors import ConfigError
from megarl.config import Config
from megarl.algos.registry import load_dotted
from megarl.config_checks.common import check_counts, check_numbers, one_line_error, read_hf_config
from megarl.data.tokenizer import check_tokenizer_dir, check_vocab_fits
from megarl.rewards.registry import get_reward


def check_output_dir(key: str, path: str) -> None:
    """``path`` is, or can be created as, a directory this process may write to."""
    if not path.strip():
        raise ConfigError(f"{key} is empty; name a directory, e.g. {key}=runs/my_run")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: '{out}' is a file, not a directory; pick another directory")
    parent = next((p for p in [out, *out.parents] if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{key}: '{out}' cannot be created: '{parent}' is not a directory; pick another path")
    if parent is not None and not os.access(parent, os.W_OK):
        raise ConfigError(f"{key}: '{parent}' is not writable; pick a directory you can write to")


def check_paths(cfg: Config) -> None:
    check_output_dir("trainer.run_dir", cfg.trainer.run_dir)
    if cfg.trainer.dump_rollouts:
        check_output_dir("trainer.dump_rollouts", cfg.trainer.dump_rollouts)
    replay = cfg.trainer.replay_rollouts
    if replay and (not Path(replay).is_dir() or not any(Path(replay).glob("step_*_dp*.pt"))):
        raise ConfigError(f"trainer.replay_rollouts: '{replay}' holds no dumped rollouts (step_*_dp*.pt); "
                          f"dump them first with trainer.rollout_only=true trainer.dump_rollouts={replay}")
    if not cfg.data.train_mix and not data_source_found(cfg.data.train_path):
        raise ConfigError(f"data.train_path: '{cfg.data.train_path}' not found")
    if cfg.data.eval_path and not data_source_found(cfg.data.eval_path):
        raise ConfigError(f"data.eval_path: '{cfg.data.eval_path}' not found; unset it to skip evaluation")
    for key, path in (("critic.path", cfg.critic.path), ("ref.path", cfg.ref.path),
                      ("reward.model.path", cfg.reward.model.path)):
        if path:
            read_hf_config(path, key)


def data_source_found(path: str) -> bool:
    """A file, a saved dataset, or a name the hub may hold (checked when it is read)."""
    from megarl.data.sources import source_kind
    from megarl.errors import DataError

    try:
        source_kind(path)
    except DataError:
        return False
    return True


def check_data(cfg: Config) -> None:
    """data.train_mix and data.eval_sets entries: paths, weights, names, samples, pass@k, metric."""
    d = cfg.data
    maps = [("data.row_map", d.row_map)] + [(f"data.train_mix[{i}].row_map", s.row_map)
                                            for i, s in enumerate(d.train_mix)]
    for key, path in maps + [(f"data.eval_sets[{i}].row_map", s.row_map) for i, s in enumerate(d.eval_sets)]:
        if path:
            try:
                load_dotted(path)  # imports module:function the way the loader will
            except ValueError as e:
                raise ConfigError(f"{key}={path!r}: {one_line_error(e)}") from None
    for i, s in enumerate(d.train_mix):
        if not data_source_found(s.path):
            raise ConfigError(f"data.train_mix[{i}].path: '{s.path}' not found")
        check_numbers(s, f"data.train_mix[{i}]", ["weight"], low=0, strict=True)
    names = [s.name for s in d.eval_sets]
    for i, s in enumerate(d.eval_sets):
        key = f"data.eval_sets[{i}]"
        if not s.name or "/" in s.name or s.name in names[:i]:
            raise ConfigError(f"{key}.name={s.name!r}: give each eval set its own name without '/'")
        if not data_source_found(s.path):
            raise ConfigError(f"{key}.path: '{s.path}' not found")
        check_counts(s, key, ["n"])
        check_counts(s, key, ["limit", "max_new_tokens"], low=0)
        if s.max_new_tokens > cfg.rollout.max_new_tokens:
            raise ConfigError(f"{key}.max_new_tokens={s.max_new_tokens} exceeds rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens}, which sizes the model's sequences; raise "
                              "rollout.max_new_tokens or lower the eval set's")
        check_numbers(s, key, ["temperature", "pass_threshold"], low=0)
        if s.temperature == 0 and s.n > 1:
            raise ConfigError(f"{key}: n={s.n} with temperature=0 gives {s.n} equal greedy samples; set "
                              f"{key}.temperature (e.g. 0.6) or n=1")
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"{key}.top_p={s.top_p} must be in (0, 1]")
        bad = [k for k in s.k if not 1 <= k <= s.n]
        if bad:
            raise ConfigError(f"{key}.k={s.k}: each k must be in 1..n={s.n}; raise n or drop {bad}")
        try:
            get_reward(s.metric)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{key}.metric={s.metric!r}: {one_line_error(e)}") from None


def check_model_inputs(cfg: Config, hf: dict, length_key: str, length: int, room: int) -> None:
    """The tokenizer directory holds a vocabulary whose ids the model's embedding covers, and
    ``length`` (config key ``length_key``) leaves ``room`` of the model's positions free."""
    key, path = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    check_tokenizer_dir(path, key)
    if isinstance(hf.get("vocab_size"), int):
        check_vocab_fits(path, key, hf["vocab_size"])
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and length + room > positions:
        need = f"{length} + {room} prompt token" if room else str(length)
        raise ConfigError(f"{length_key}={length}: {need} exceed the {positions} positions of the model "
                          f"(max_position_embeddings in {cfg.model.path}/config.json); lower {length_key}")


def check_sft_data(s) -> None:
    """sft.train_path or sft.train_mix: sources found, weights > 0, columns named, row maps importable."""
    if not s.train_mix and not data_source_found(s.train_path):
        raise ConfigError(f"sft.train_path: '{s.train_path}' not found; name a .jsonl / .json / .parquet file, "
                          "a datasets save_to_disk directory or a hub dataset")
    for i, e in enumerate(s.train_mix):
        if not data_source_found(e.path):
            raise ConfigError(f"sft.train_mix[{i}].path: '{e.path}' not found")
        check_numbers(e, f"sft.train_mix[{i}]", ["weight"], low=0, strict=True)
    sources = [("sft", s)] + [(f"sft.train_mix[{i}]", e) for i, e in enumerate(s.train_mix)]
    for key, src in sources:
        for name in ("prompt_key", "response_key"):
            if getattr(src, name) == "":
                raise ConfigError(f"{key}.{name} is empty; name the column (e.g. {key}.{name}=question)")
        if src.row_map:
            try:
                load_dotted(src.row_map)  # imports module:function the way the loader will
            except ValueError as e:
                raise ConfigError(f"{key}.row_map={src.row_map!r}: {one_line_error(e)}") from None
