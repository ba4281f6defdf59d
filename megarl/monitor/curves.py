"""End-of-run figure ``RUN_DIR/curves.png``: reward, KL, entropy, held-out accuracy, tool use and the
eval sets' pass@k / mean@n vs step.

A panel shows each of its metrics that the run logged; a panel with none is
left out, and a run with no such metric at all gets no figure.
"""
from __future__ import annotations

import os
from typing import Optional

from megarl.monitor.run_files import read_metrics, series

PANELS = (  # (title, metric keys drawn in it)
    ("reward", ("score/mean",)),
    ("KL", ("kl/mean", "actor/approx_kl", "actor/kl_loss")),
    ("entropy", ("policy/entropy", "actor/entropy")),
    ("held-out accuracy", ("eval/accuracy",)),
    ("tool use (per sample)", ("agent/tool_calls_mean", "agent/turns_mean", "agent/tool_errors_mean",
                               "agent/tool_truncations_mean", "agent/max_turns_frac")),
)


def eval_set_keys(rows: dict[int, dict[str, float]]) -> list[str]:
    """The data.eval_sets metrics logged (eval/<name>/pass@k, eval/<name>/mean@n), sorted."""
    return sorted({k for row in rows.values() for k in row if k.startswith("eval/") and k.count("/") == 2
                   and "@" in k.rsplit("/", 1)[-1]})


def panels_present(rows: dict[int, dict[str, float]]) -> list[tuple[str, list[str]]]:
    """The panels with at least one logged metric, each with the keys it has."""
    out = []
    for title, keys in PANELS:
        have = [k for k in keys if series(rows, k)[0]]
        if have:
            out.append((title, have))
    sets = eval_set_keys(rows)
    if sets:
        out.append(("eval sets", sets))
    return out


def plot_curves(run_dir: str, out_name: str = "curves.png") -> Optional[str]:
    """Writes the figure and returns its path; None when nothing to draw."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    rows = read_metrics(path)
    panels = panels_present(rows)
    if not panels:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI (Agg renders the PNG)
    from matplotlib.ticker import MaxNLocator

    cols = min(2, len(panels))
    rows_n = (len(panels) + cols - 1) // cols
    fig = Figure(figsize=(5.5 * cols, 3.6 * rows_n))
    axes = fig.subplots(rows_n, cols, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            steps, values = series(rows, key)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = os.path.join(run_dir, out_name)
    fig.savefig(out, dpi=110)
    return out
