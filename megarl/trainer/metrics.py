"""Metrics: reduced over data-parallel ranks, written by rank 0 to the console,
``metrics.jsonl``, TensorBoard and (``trainer.wandb``) W&B; milestones to ``events.jsonl``."""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


def dp_sum(values: dict[str, float], group) -> dict[str, float]:
    """Sums each value over ``group`` (every rank must pass the same keys)."""
    keys = sorted(values)
    if not keys or group is None or dist.get_world_size(group) == 1:
        return dict(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


class PhaseTimer:
    """Wall time (``timing/<phase>``, s) and, on CUDA, peak memory (``memory/<phase>_peak_gb``) per phase,
    and what the phase leaves allocated (``memory/<phase>_live_gb``: a phase that keeps tensors alive
    shows here, while a peak only says the phase's own high-water mark)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}
        self.live_gb: dict[str, float] = {}  # allocated at the phase's end (its last run in the step)

    @contextmanager
    def __call__(self, phase: str):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.peak_gb[phase] = max(self.peak_gb.get(phase, 0.0), peak)
            self.live_gb[phase] = torch.cuda.memory_allocated() / 2**30
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/{k}_peak_gb": v for k, v in self.peak_gb.items()})
        out.update({f"memory/{k}_live_gb": v for k, v in self.live_gb.items()})
        if self.peak_gb:
            out["perf/peak_memory_gb"] = max(self.peak_gb.values())
        return out


class MetricsWriter:
    """Rank 0 writes; other ranks hold a writer that does nothing.

    Sinks: ``metrics.jsonl`` (every value, NaN as null), TensorBoard and W&B (the
    finite ones); ``events.jsonl`` gets the run's milestones (start, export, end)
    with their wall-clock time, for :mod:`megarl.report`.
    """

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True, wandb=None,
                 config: dict | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb is not None and wandb.enable:
            from megarl.monitor.wandb_logger import WandbLogger

            self.wandb = WandbLogger(wandb, run_dir, config or {})

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (v if math.isfinite(v) else None) for k, v in sorted(metrics.items())}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(step, metrics)

    def event(self, name: str, step: int, **fields) -> None:
        """One line of ``events.jsonl``: ``{"event": name, "time": unix s (now, or ``time=``), "step": step, ...}``."""
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, "events.jsonl"), "a") as f:
            f.write(json.dumps({"event": name, "time": time.time(), "step": step, **fields}) + "\n")

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.close()
            self.wandb = None


CONSOLE_KEYS = (
    ("score/mean", "score"), ("eval/accuracy", "acc"), ("actor/pg_loss", "pg"),
    ("critic/vf_loss", "vf"), ("kl/mean", "kl"), ("response/length_mean", "len"),
    ("perf/tokens_per_s_per_gpu", "tok/s/gpu"), ("perf/step_seconds", "s/step"),
    # multi-turn runs: per sample, tool calls, assistant turns, failed calls, cut tool outputs
    ("agent/tool_calls_mean", "tools"), ("agent/turns_mean", "turns"), ("agent/tool_errors_mean", "tool_err"),
    ("agent/tool_truncations_mean", "tool_cut"),
)


def console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """A short human line for the progress bar."""
    parts = [f"step {step}/{total}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {metrics[key]:.4g}")
    return "  ".join(parts)
