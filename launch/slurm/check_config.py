"""Checks a config for a SLURM job before it is submitted (launch/slurm/submit.sh runs it).

    python launch/slurm/check_config.py [SBATCH OPTIONS ...] CONFIG.yaml [key=value ...]

The first argument ending in .yaml / .yml is the config; the arguments before it are
sbatch options, those after it overrides. The world size the job will have comes from
the options and the #SBATCH lines of launch/slurm/ppo.sbatch (the options win): nodes
(-N / --nodes) times processes per node (--ntasks-per-node with MEGARL_LAUNCH=srun,
--gpus-per-node or GPUS_PER_NODE with torchrun); MEGARL_WORLD_SIZE overrides it.
The entry script's own checks then run (launch/sft.py's for it, launch/ppo.py's
otherwise). A mistake is one line and exit code 2; nothing is started.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from megarl.errors import ConfigError, UserInputError

SBATCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ppo.sbatch")


def split_args(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(sbatch options, config, overrides)."""
    for i, arg in enumerate(argv):
        if arg.endswith((".yaml", ".yml")) and not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1:]
    raise ConfigError(f"no CONFIG.yaml among the arguments {' '.join(argv)!r}; usage: "
                      "[SBATCH OPTIONS ...] CONFIG.yaml [key=value ...]")


def script_options(path: str = SBATCH_SCRIPT) -> list[str]:
    """The options of the script's #SBATCH lines, in order."""
    options = []
    with open(path) as f:
        for line in f:
            if line.startswith("#SBATCH "):
                options += shlex.split(line[len("#SBATCH "):], comments=True)
    return options


def _count(text: str | None, option: str) -> int | None:
    """'8', 'h100:8' -> 8; None stays None; anything else (a range such as 2-4) is an error."""
    if text is None:
        return None
    value = text.rsplit(":", 1)[-1]
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{option}={text}: not a count this check can use; set MEGARL_WORLD_SIZE to the job's "
                         "number of processes")
    return int(value)


def world_size(options: list[str], env=os.environ) -> int:
    """Processes the job will start: nodes x processes per node (see the module docstring)."""
    if env.get("MEGARL_WORLD_SIZE"):
        return _count(env["MEGARL_WORLD_SIZE"], "MEGARL_WORLD_SIZE")
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-N", "--nodes")
    parser.add_argument("--ntasks-per-node")
    parser.add_argument("--gpus-per-node")
    known, _ = parser.parse_known_args(script_options() + options)  # later options win
    nodes = _count(known.nodes, "--nodes") or 1
    if env.get("MEGARL_LAUNCH", "srun") == "torchrun":
        per_node = _count(env.get("GPUS_PER_NODE"), "GPUS_PER_NODE") or _count(known.gpus_per_node, "--gpus-per-node")
    else:
        per_node = _count(known.ntasks_per_node, "--ntasks-per-node")
    return nodes * (per_node or 1)


def main(argv: list[str]) -> int:
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate, validate_sft
    from megarl.launch_common import quiet_libraries

    entry = os.environ.get("MEGARL_ENTRY", "launch/ppo.py")
    checks = validate_sft if os.path.basename(entry) == "sft.py" else validate
    quiet_libraries()
    try:
        options, config, overrides = split_args(argv)
        size = world_size(options)
        checks(load_config([config, *overrides], Config), size)
    except UserInputError as e:
        print(f"{e.kind}: {e}", file=sys.stderr)
        return 2
    print(f"config ok for {os.path.basename(entry)} on {size} processes: {config} {' '.join(overrides)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
