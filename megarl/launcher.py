"""The ``megarl`` command: ``megarl train CONFIG.yaml [--nproc N] [key=value ...]``.

Checks the config once in this process (the loader and checks of
``launch/ppo.py``), then runs torchrun's elastic agent in-process on this node
(``torch.distributed.launcher.api.elastic_launch``) with ``launch/ppo.py`` as
every worker's program. What the user sees:

- a config mistake: its one line, exit 2, no worker started;
- a worker's own mistake (data file, checkpoint): the worker prints its one
  line; this process adds nothing and exits 2;
- Ctrl-C (SIGINT) or SIGTERM: the agent forwards it to the workers (they finish
  their step, save a checkpoint and exit), then one line, exit 130 (SIGTERM: 143);
- any other worker failure: the worker's own output, then one line naming the
  rank and its exit code, exit 1.

torchrun's log lines and its ChildFailedError traceback are not printed.
Multi-node runs use torchrun or srun (``launch/slurm/``) with ``launch/ppo.py``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from megarl.cli import main_guard
from megarl.config import Config
from megarl.errors import ConfigError

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "ppo.py"
USAGE = """usage: megarl train CONFIG.yaml [--nproc N] [--max-restarts N] [--stop-timeout S] [key=value ...]
       megarl report RUN_DIR

train    check the config, then run launch/ppo.py on N processes of this node (torchrun's agent)
report   summary of a run directory (python -m megarl.report)
"""


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl train", add_help=False, exit_on_error=False)
    parser.add_argument("config", nargs="?")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nproc", type=int, default=1, help="processes on this node (one per GPU)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole job after a failure")
    parser.add_argument("--stop-timeout", type=int, default=600,
                        help="seconds the workers get to save their step after Ctrl-C / SIGTERM")
    try:
        args, unknown = parser.parse_known_intermixed_args(argv)
    except argparse.ArgumentError as e:  # a non-integer --nproc, a missing value
        raise ConfigError(f"megarl train: {e}; see megarl train --help") from None
    bad = [a for a in unknown if a.startswith("-")]
    if bad:
        raise ConfigError(f"megarl train: unknown option {bad[0]}; known: --nproc, --max-restarts, --stop-timeout")
    args.overrides += unknown
    if args.config and "=" in args.config:  # no yaml, only overrides
        args.overrides.insert(0, args.config)
        args.config = None
    for key in ("nproc", "max_restarts", "stop_timeout"):
        if getattr(args, key) < (1 if key == "nproc" else 0):
            raise ConfigError(f"megarl train: --{key.replace('_', '-')}={getattr(args, key)} is out of range")
    return args


def check_config(args) -> list[str]:
    """The config checked as each worker will check it; returns the workers' argv."""
    from megarl.cli import load_config
    from megarl.trainer.run_config import validate_run
    from megarl.launch_common import quiet_libraries

    quiet_libraries()
    argv = ([args.config] if args.config else []) + list(args.overrides)
    validate_run(load_config(argv, Config), args.nproc)
    if not TRAIN_SCRIPT.is_file():
        raise ConfigError(f"megarl train runs {TRAIN_SCRIPT}, which this install lacks; install megarl from "
                          "its checkout (pip install -e .) or run torchrun ... launch/ppo.py")
    return argv


def quiet_torchrun() -> None:
    """torch's elastic agent logs its set-up and shutdown at WARNING and above; the outcome is ours to say."""
    import torch.distributed.launcher.api  # noqa: F401 - creates its loggers

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(args, argv: list[str]) -> int:
    """Runs the workers under the elastic agent; returns this command's exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    quiet_torchrun()
    if args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=args.max_restarts,
                          monitor_interval=0.1, shutdown_timeout=args.stop_timeout)
    try:
        elastic_launch(config, sys.executable)("-u", str(TRAIN_SCRIPT), *argv)
    except ChildFailedError as e:
        return failure_code(e)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"megarl train: stopped by {name}; each worker finished its step and saved it unless it was killed "
              f"after --stop-timeout={args.stop_timeout} s (the same command resumes from the newest checkpoint)",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


def failure_code(error) -> int:
    """2 when a worker reported a user mistake (it printed the line); else one line naming the first failure."""
    failures = sorted(error.failures.items())
    if any(f.exitcode == 2 for _, f in failures):
        return 2
    rank, first = failures[0]
    how = f"signal {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 else f"exit code {first.exitcode}"
    print(f"megarl train: rank {rank} failed ({how}); its output is above", file=sys.stderr, flush=True)
    return 1


def train(argv: list[str]) -> None:
    args = parse_train_args(argv)
    try:
        argv = check_config(args)
    except KeyboardInterrupt:
        print("megarl train: interrupted before any worker started", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(launch(args, argv))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "train":
        main_guard(train, rest, cls=Config, usage=USAGE + "\nconfig keys (key=value):")
    elif command == "report":
        from megarl import report

        main_guard(report.main, rest, usage=report.__doc__)
    elif command in ("-h", "--help"):
        print(USAGE, end="", flush=True)
    else:
        print(f"megarl: unknown command {command!r}\n{USAGE}" if command else USAGE, end="", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
