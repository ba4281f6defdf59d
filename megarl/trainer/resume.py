"""What a resume checks before it loads, and what it rewinds.

A checkpoint's ``state.json`` records the parallel layout it was saved with and
a signature of each role's model. Before anything is loaded, a checkpoint that
cannot be resumed is a one-line :class:`CheckpointError` naming the directory
and the fix: an unreadable or incomplete ``state.json``, a role directory
without megatron's metadata, another model (a different shape), or a layout
megatron's distributed checkpoint cannot reshard. The optimizer is saved in
megatron's ``dp_reshardable`` format, so the data-parallel size may change
(any number of processes) while tp, pp and cp may not.

``rewind_metrics`` drops the rows a killed run logged after its last
checkpoint, so a resumed run's ``metrics.jsonl`` has each step once.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from megarl.errors import CheckpointError

# files megatron-core's torch_dist format needs in each role directory
ROLE_FILES = ("metadata.json", ".metadata", "common.pt")
_SIGNATURE_KEYS = ("arch", "value_head", "num_layers", "hidden_size", "num_heads", "num_groups", "head_dim",
                   "ffn_hidden_size", "vocab_size")
FIX_DAMAGED = ("delete that step directory and write an earlier saved step number into checkpoints/latest, "
               "or set trainer.resume=false to start over")


@dataclass(frozen=True)
class Layout:
    """How the trainable roles were sharded: the axes a checkpoint's shards depend on."""

    tp: int
    pp: int
    cp: int
    dp: int
    distributed_optimizer: bool

    @staticmethod
    def of(groups, distributed_optimizer: bool) -> "Layout":
        return Layout(groups.tp_size, groups.pp_size, groups.cp_size, groups.dp_size, distributed_optimizer)

    def describe(self) -> str:
        optimizer = "distributed optimizer" if self.distributed_optimizer else "replicated optimizer"
        return f"tp={self.tp} pp={self.pp} cp={self.cp} dp={self.dp} ({optimizer})"

    def reshardable_to(self, other: "Layout") -> bool:
        """Only the data-parallel size may differ (megatron's dp_reshardable optimizer format)."""
        return (self.tp, self.pp, self.cp, self.distributed_optimizer) == (
            other.tp, other.pp, other.cp, other.distributed_optimizer)


def model_signature(info) -> dict:
    """The shape-defining fields of a role's ModelInfo (what another model's checkpoint differs in)."""
    full = asdict(info)
    return {k: full[k] for k in _SIGNATURE_KEYS}


def read_state(path: str, roles, expect: tuple[str, ...]) -> dict:
    """``path``/state.json, checked to hold the keys a load reads."""
    file = os.path.join(path, "state.json")
    try:
        with open(file) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; {FIX_DAMAGED}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = "is empty" if os.path.getsize(file) == 0 else f"is not valid JSON ({getattr(e, 'msg', e)})"
        raise CheckpointError(f"{file} {why}; {FIX_DAMAGED}") from None
    need = ["step", "optimizer_saved", "adam_steps", *expect]
    missing = [k for k in need if not isinstance(state, dict) or k not in state]
    missing += [f"optimizer_saved.{r}" for r in roles if not missing and r not in state["optimizer_saved"]]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)} (written by another program or version?); "
                              f"{FIX_DAMAGED}")
    return state


def check_role_dirs(path: str, roles) -> None:
    """Each role's directory holds megatron's metadata files."""
    for name in roles:
        role_dir = os.path.join(path, name)
        if not os.path.isdir(role_dir):
            raise CheckpointError(f"{role_dir} is missing: the checkpoint has no {name} (was it saved without "
                                  f"one?); {FIX_DAMAGED}")
        absent = [f for f in ROLE_FILES if not os.path.isfile(os.path.join(role_dir, f))]
        if absent:
            raise CheckpointError(f"{role_dir} lacks megatron's {', '.join(absent)}: an incomplete or damaged "
                                  f"checkpoint; {FIX_DAMAGED}")


def check_models(path: str, state: dict, roles) -> None:
    """The saved model of each role has the shapes of the one this run built."""
    saved = state.get("models") or {}
    for name, role in roles.items():
        if name not in saved:
            continue  # a checkpoint from before signatures were recorded
        mine = model_signature(role.info)
        diff = {k: (saved[name].get(k), v) for k, v in mine.items() if saved[name].get(k) != v}
        if diff:
            listed = ", ".join(f"{k} {a} (this run: {b})" for k, (a, b) in diff.items())
            raise CheckpointError(f"{path} holds another {name} model: {listed}; point trainer.run_dir at a new "
                                  f"directory, or use the model.path (critic.path) this run was started from")


def check_layout(path: str, state: dict, layout: Layout | None) -> bool:
    """Whether the checkpoint was saved with exactly ``layout``; an unreshardable change is an error."""
    if layout is None or "layout" not in state:
        return True  # nothing to compare (a checkpoint from before layouts were recorded)
    saved = Layout(**state["layout"])
    if not saved.reshardable_to(layout):
        raise CheckpointError(
            f"{path} was saved with {saved.describe()}, this run has {layout.describe()}: the optimizer "
            f"checkpoint reshards only over data-parallel ranks; resume with parallel.tp={saved.tp} "
            f"parallel.pp={saved.pp} parallel.cp={saved.cp} parallel.distributed_optimizer="
            f"{str(saved.distributed_optimizer).lower()} (any multiple of {saved.tp * saved.pp * saved.cp} "
            f"processes), or start a new trainer.run_dir")
    return saved == layout


def load_failure(role_dir: str, error: Exception) -> CheckpointError:
    """megatron / torch.distributed.checkpoint failed reading a role: one line with the first cause."""
    failures = getattr(error, "failures", None)  # torch's CheckpointException: rank -> (error, traceback)
    cause = next(iter(failures.values()))[0] if failures else error
    text = " ".join(str(cause).split())[:300]
    why = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    return CheckpointError(f"cannot read {role_dir} (a truncated or damaged shard?): {why}; {FIX_DAMAGED}")


def rewind_metrics(run_dir: str, step: int | None) -> int:
    """Drops ``metrics.jsonl`` rows after ``step`` (all rows when None: the run starts over).

    The dropped rows (a killed run's steps after its last checkpoint, and a row
    cut off mid-write) go to ``metrics.rewound.jsonl``. Returns how many.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    keep, drop = [], []
    for line in open(path):
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None
        (keep if step is not None and row_step is not None and row_step <= step else drop).append(line)
    if drop:
        with open(os.path.join(run_dir, "metrics.rewound.jsonl"), "a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in drop)
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return len(drop)
