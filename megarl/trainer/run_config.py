"""``RUN_DIR/config.yaml``: the resolved config of a run, and the check a resume makes against it.

Every start writes the whole resolved config there (rank 0, before training). A
later start in the same run directory that would resume a checkpoint first
compares the run's identity (:func:`identity`: algorithm, model, critic set-up,
task) with the saved one; a difference is a one-line :class:`ConfigError` naming
each changed key, since resuming would silently train another run's weights and
append to its metrics. ``trainer.resume=force`` resumes anyway (one line says
what differs), ``trainer.resume=false`` starts over. Everything else (learning
rates, steps, logging, batch sizes) may change between sessions.
"""
from __future__ import annotations

import dataclasses
import os

import yaml

from megarl.config import Config
from megarl.config_checks import uses_critic, validate
from megarl.errors import ConfigError
from megarl.trainer.dump import dump_path

RUN_CONFIG = "config.yaml"


def _path(value: str | None) -> str | None:
    """A path compared by where it points (a relative one from this working directory)."""
    if not value:
        return None
    return os.path.realpath(value) if os.path.exists(value) else value


def identity(cfg: Config) -> dict[str, object]:
    """The keys that make two configs the same run: what a checkpoint's weights and metrics mean."""
    critic = uses_critic(cfg)
    return {
        "algorithm.advantage": cfg.algorithm.advantage,
        "actor.policy_loss": cfg.actor.policy_loss,
        "model.path": _path(cfg.model.path),
        "actor.lora.rank": cfg.actor.lora.rank,
        "critic.enable": critic,
        "critic.path": _path(cfg.critic.path or cfg.model.path) if critic else None,
        "data.train_path": _path(cfg.data.train_path),
        "reward.terms": [(t.name, t.weight, t.kwargs) for t in cfg.reward.terms],
        "reward.model.path": _path(cfg.reward.model.path),
    }


def config_file(run_dir: str) -> str:
    return os.path.join(run_dir, RUN_CONFIG)


def read_run_config(run_dir: str) -> Config | None:
    """The config saved in ``run_dir``, or None when there is none (or it no longer loads)."""
    from megarl.cli import build

    path = config_file(run_dir)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return build(Config, yaml.safe_load(f) or {})
    except (yaml.YAMLError, ConfigError, OSError):
        return None  # written by another version: nothing to compare, the checkpoint checks still run


def differences(saved: Config, cfg: Config) -> list[str]:
    """``key: saved -> now`` for each identity key that differs."""
    old, new = identity(saved), identity(cfg)
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in new if old[k] != new[k]]


def has_checkpoint(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, "checkpoints", "latest"))


def check_resume(cfg: Config) -> list[str]:
    """Before a start: refuses (ConfigError) to resume a run of another config; returns the
    differences a ``trainer.resume=force`` start accepts (empty when none)."""
    t = cfg.trainer
    if not t.resume or not has_checkpoint(t.run_dir):
        return []
    saved = read_run_config(t.run_dir)
    diff = differences(saved, cfg) if saved is not None else []
    if diff and t.resume != "force":
        raise ConfigError(f"trainer.run_dir '{t.run_dir}' holds a run of another config ({'; '.join(diff)}); "
                          f"pick a new trainer.run_dir, set trainer.resume=false to start over, or "
                          f"trainer.resume=force to continue it anyway")
    return diff


def save_run_config(cfg: Config) -> str:
    """Writes ``RUN_DIR/config.yaml`` (atomically), input paths made absolute so it reads the same from
    any directory; returns its path."""
    from megarl.cli import _get_dotted, _set_dotted

    tree = dataclasses.asdict(cfg)
    tree["async"] = tree.pop("async_")  # the key a yaml writes (megarl.cli.field_name)
    for key in Config.INPUT_PATH_KEYS:
        value = _get_dotted(tree, key)
        if isinstance(value, str) and value and os.path.exists(value):
            _set_dotted(tree, key, os.path.abspath(value))
    path = config_file(cfg.trainer.run_dir)
    os.makedirs(cfg.trainer.run_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        yaml.safe_dump(tree, f, sort_keys=False)
    os.replace(path + ".tmp", path)
    return path


def validate_run(cfg: Config, world_size: int) -> dict:
    """:func:`megarl.config_checks.validate`, then the run directory: resuming a run of another
    config is refused (:func:`check_resume`; trainer.resume=force overrides). For launch/ppo.py
    and `megarl train`."""
    hf = validate(cfg, world_size)
    check_replay_steps(cfg, world_size)
    check_resume(cfg)
    return hf


def check_replay_steps(cfg: Config, world_size: int) -> None:
    """trainer.replay_rollouts holds a dump of every step 1..trainer.steps for every DP rank: checked
    up front, so a replay never stops half-way through the run (and its trained steps)."""
    replay = cfg.trainer.replay_rollouts
    if not replay:
        return
    p = cfg.parallel
    dp = world_size // (p.tp * p.pp * p.cp)
    missing = next(((step, r) for step in range(1, cfg.trainer.steps + 1) for r in range(dp)
                    if not os.path.isfile(dump_path(replay, step, r))), None)
    if missing is None:
        return
    step, rank = missing
    if step == 1:
        raise ConfigError(f"trainer.replay_rollouts: '{replay}' has no dump of step 1 for data-parallel rank {rank}; "
                          f"replay with the data-parallel size it was dumped with")
    raise ConfigError(f"trainer.replay_rollouts: '{replay}' has no dump of step {step} for data-parallel rank "
                      f"{rank} (dumped: steps 1..{step - 1}); set trainer.steps={step - 1} or fewer, or dump "
                      f"more steps with the same data-parallel size")
