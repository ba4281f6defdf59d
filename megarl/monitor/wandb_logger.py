"""Weights & Biases logging (``trainer.wandb``): rank 0 logs the scalars TensorBoard gets.

The run's id is kept in ``RUN_DIR/wandb_run_id``, so a resumed megarl run
continues the same W&B run. ``wandb`` is optional (``pip install megarl[wandb]``);
the config check refuses ``trainer.wandb.enable=true`` without it.
"""
from __future__ import annotations

import math
import os
import uuid

from megarl.errors import ConfigError

ID_FILE = "wandb_run_id"


def run_id(run_dir: str) -> str:
    """The W&B run id of this run directory, made (and kept) on first use."""
    path = os.path.join(run_dir, ID_FILE)
    if os.path.isfile(path):
        return open(path).read().strip()
    new = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
    with open(path, "w") as f:
        f.write(new + "\n")
    return new


class WandbLogger:
    """One W&B run; ``log`` skips non-finite values as TensorBoard does."""

    def __init__(self, cfg, run_dir: str, config: dict):
        import wandb

        os.makedirs(run_dir, exist_ok=True)
        wandb_dir = cfg.dir or run_dir
        os.makedirs(wandb_dir, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity or None, mode=cfg.mode, dir=wandb_dir,
                name=cfg.name or os.path.basename(os.path.abspath(run_dir)), config=config,
                id=run_id(run_dir), resume="allow")
        except wandb.errors.Error as e:  # no API key, unknown entity, server unreachable
            message = " ".join(str(e).split())
            raise ConfigError(f"trainer.wandb: W&B did not start ({message}); run `wandb login`, "
                              "or set trainer.wandb.mode=offline (upload later with `wandb sync`)") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if finite:
            self.run.log(finite, step=step)

    def close(self) -> None:
        self.run.finish()
