"""Summary of a run: python -m megarl.report RUN_DIR

Reads the run directory's files only (metrics.jsonl, events.jsonl, checkpoints/,
hf/), so it works on a finished run, a stopped one, or one still running.
"""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass

from megarl.cli import main_guard
from megarl.monitor.curves import eval_set_keys
from megarl.monitor.run_files import RunDirError, read_events, read_metrics, series


@dataclass
class RunFiles:
    """What a run directory holds."""

    run_dir: str
    rows: dict[int, dict[str, float]]  # step -> merged metrics
    events: list[dict]  # start / export / end / stopped, in order
    checkpoints: list[str]  # checkpoints/step_* names, oldest first


def load_run(run_dir: str) -> RunFiles:
    if not os.path.isdir(run_dir):
        raise RunDirError(f"'{run_dir}' is not a directory; pass a run's trainer.run_dir")
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.isfile(path) else {}
    if not rows:
        raise RunDirError(f"'{run_dir}' has no metrics (metrics.jsonl missing or empty); "
                          "pass the trainer.run_dir of a run that has started")
    ckpt_root = os.path.join(run_dir, "checkpoints")
    ckpts = sorted(n for n in os.listdir(ckpt_root) if n.startswith("step_")) if os.path.isdir(ckpt_root) else []
    return RunFiles(run_dir, rows, read_events(run_dir), ckpts)


def duration(seconds: float) -> str:
    """45.2 s, 12m 05s, 3h 04m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


SESSION_ENDS = {"end": "finished", "stopped": "stopped (the same command resumes it)",
                "already_finished": "finished"}


def wall_seconds(events: list[dict]) -> tuple[float, int]:
    """Seconds over the sessions that ended (an end event after their start), and how many."""
    total, sessions, start = 0.0, 0, None
    for e in events:
        if e["event"] == "start":
            start = e["time"]
        elif e["event"] in SESSION_ENDS and start is not None:
            total, sessions, start = total + e["time"] - start, sessions + 1, None
    return total, sessions


def first_last_extreme(rows, key: str, label: str = "best", pick=max) -> str | None:
    """'first 0.0625 (step 1)  last 0.5 (step 40)  best 0.6 (step 38)', or None when not logged."""
    steps, values = series(rows, key)
    if not steps:
        return None
    i = values.index(pick(values))
    return (f"first {values[0]:.4g} (step {steps[0]})  last {values[-1]:.4g} (step {steps[-1]})  "
            f"{label} {values[i]:.4g} (step {steps[i]})")


def eval_rows(rows, limit: int = 8) -> str | None:
    steps, values = series(rows, "eval/accuracy")
    cells = [f"step {s}: {v:.3f}" for s, v in zip(steps, values)]
    if len(cells) > limit:
        cells = cells[: limit // 2] + ["..."] + cells[-limit // 2:]
    return ", ".join(cells) or None


def eval_sets_line(rows) -> str | None:
    """'gsm8k pass@1 0.41 -> 0.52, gsm8k mean@4 0.40 -> 0.49' (first -> last logged value)."""
    cells = []
    for key in eval_set_keys(rows):
        steps, values = series(rows, key)
        cells.append(f"{key[5:].replace('/', ' ')} {values[0]:.3f} (step {steps[0]}) -> {values[-1]:.3f} "
                     f"(step {steps[-1]})")
    return ", ".join(cells) or None


def throughput(run: RunFiles) -> str | None:
    """Median tokens/s per GPU over the steps (the first, warm-up, left out when there are more)."""
    _, per_gpu = series(run.rows, "perf/tokens_per_s_per_gpu")
    if not per_gpu:
        return None
    median = statistics.median(per_gpu[1:] if len(per_gpu) > 1 else per_gpu)
    world = next((e.get("world_size") for e in reversed(run.events) if e["event"] == "start"), None)
    total = f", {median * world:.4g} tokens/s on {world} process{'es' * (world != 1)}" if world else ""
    return f"{median:.4g} tokens/s per GPU (median){total}"


def step_time(rows) -> str | None:
    _, seconds = series(rows, "perf/step_seconds")
    if not seconds:
        return None
    return f"{duration(sum(seconds))} in steps, {statistics.mean(seconds):.3g} s per step"


def peak_memory(rows) -> str | None:
    parts = []
    for key, name in (("resources/process_rss_gb_max", "rank-0 RSS"), ("resources/gpu_memory_gb_max", "GPU (NVML)"),
                      ("perf/peak_memory_gb", "CUDA allocated")):
        _, values = series(rows, key)
        if values:
            parts.append(f"{name} {max(values):.3g} GB")
    return ", ".join(parts) or None


def export_line(run: RunFiles) -> str | None:
    out = os.path.join(run.run_dir, "hf")
    event = next((e for e in reversed(run.events) if e["event"] == "export"), None)
    if event:
        return f"{event['path']} ({event['tensors']} tensors, {event['bytes'] / 2**20:.1f} MB, at step {event['step']})"
    return os.path.abspath(out) if os.path.isdir(out) else None


def checkpoint_line(run: RunFiles) -> str | None:
    if not run.checkpoints:
        return None
    return f"{os.path.abspath(os.path.join(run.run_dir, 'checkpoints'))}/ {', '.join(run.checkpoints)}"


AGENT_KEYS = (("agent/tool_calls_mean", "calls"), ("agent/turns_mean", "turns"),
              ("agent/tool_errors_mean", "errors"), ("agent/tool_truncations_mean", "truncated outputs"),
              ("agent/max_turns_frac", "at the turn limit"))


def tool_use(rows) -> str | None:
    """Multi-turn runs, per sample: 'calls 0.3 -> 0.95, turns 1.3 -> 2, errors 0.1 -> 0, ...' (first -> last step)."""
    parts = []
    for key, name in AGENT_KEYS:
        _, values = series(rows, key)
        if values:
            parts.append(f"{name} {values[0]:.3g} -> {values[-1]:.3g}")
    return ", ".join(parts) or None


def summary_rows(run: RunFiles) -> list[tuple[str, str]]:
    """(label, value) lines of the table; a quantity the run did not log is left out."""
    steps, _ = series(run.rows, "perf/step_seconds")
    wall, sessions = wall_seconds(run.events)
    last = next((e["event"] for e in reversed(run.events) if e["event"] == "start" or e["event"] in SESSION_ENDS), None)
    status = SESSION_ENDS.get(last, "running, or ended without closing (crashed?)") if last else None
    rows = [
        ("run dir", os.path.abspath(run.run_dir)),
        ("steps", f"{steps[-1] if steps else 0}" + (f" ({status})" if status else "")),
        ("wall time", f"{duration(wall)} over {sessions} session{'s' * (sessions != 1)}" if sessions else None),
        ("step time", step_time(run.rows)),
        ("reward (score/mean)", first_last_extreme(run.rows, "score/mean")),
        ("accuracy (eval)", first_last_extreme(run.rows, "eval/accuracy")),
        ("eval rows", eval_rows(run.rows)),
        ("eval sets", eval_sets_line(run.rows)),
        ("KL (kl/mean)", first_last_extreme(run.rows, "kl/mean", "max")),
        ("entropy", first_last_extreme(run.rows, "policy/entropy", "min", min)),
        ("tool use per sample", tool_use(run.rows)),
        ("throughput", throughput(run)),
        ("peak memory", peak_memory(run.rows)),
        ("checkpoints", checkpoint_line(run)),
        ("export", export_line(run)),
    ]
    return [(label, value) for label, value in rows if value is not None]


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def main(argv) -> None:
    if len(argv) != 1:
        raise RunDirError("usage: python -m megarl.report RUN_DIR (one run directory)")
    table = format_table(summary_rows(load_run(argv[0])))
    try:
        print(table, flush=True)
    except BrokenPipeError:  # `| head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main_guard(main, usage=__doc__)
