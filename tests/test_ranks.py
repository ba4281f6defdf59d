"""Rank discovery (megarl.distributed.ranks) for torchrun, SLURM and MPI.

The env-dict tests pin what each launcher's variables mean. The MPI and SLURM
tests start real launchers (``mpiexec -n 2``; ``srun -N1 -n2`` on a one-node
cluster whose daemons the fixture starts and stops) and check that both ranks
agree on the world, join gloo and all-reduce: sum over ranks of (rank + 1) = 3.
They skip when mpi4py/mpiexec or slurm/munge are not installed; install with
``pip install megarl[mpi]`` and ``apt-get install slurm-wlm munge`` (as root).
Not covered: multi-host jobs (the master address of another host).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.distributed.ranks import RankInfo, discover, first_slurm_host
from slurm_helpers import slurm_cluster  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "SLURM_", "OMPI_", "PMI_", "PMIX_",
                     "MPI_", "HYDRA_")

# Run by every rank of the real-launcher tests.
PROBE = """
import torch, torch.distributed as dist
from megarl.distributed import discover, init_distributed
info = discover()
init_distributed()
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
print(f"rank={info.rank} world={info.world_size} local={info.local_rank} "
      f"launcher={info.launcher} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def probe_lines(stdout: str) -> list[str]:
    """The probes' reports, sorted (the launcher may interleave the two ranks' output)."""
    return sorted(re.findall(r"rank=\d+ world=\d+ local=\d+ launcher=\w+ sum=\d+", stdout))


# --- environment dicts ------------------------------------------------------

def test_torchrun_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # torchrun inside an allocation: torchrun wins
    assert discover(env) == RankInfo(5, 8, 1, "n0", 1234, "torchrun")


def test_torchrun_env_defaults():
    info = discover({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.local_rank, info.master_addr, info.master_port) == (0, "127.0.0.1", 29500)


def test_slurm_env():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1", "SLURM_JOB_ID": "123456"}
    # port: 20000 + 123456 % 20000 = 23456, the same on every task without talking
    assert discover(env) == RankInfo(6, 16, 2, "gpu03", 23456, "slurm")


def test_slurm_env_step_nodes_and_overrides():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEPID": "3",
           "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_STEP_NODELIST": "gpu[05-06]", "SLURM_JOB_ID": "7"}
    info = discover(env)  # an srun step on 2 of the job's 8 nodes, 4 of its 16 tasks
    assert (info.world_size, info.master_addr, info.master_port, info.local_rank) == (4, "gpu05", 20007, 0)
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="40000")
    info = discover(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 40000)


def test_slurm_batch_script_is_not_a_task():
    """The batch script's own environment (seen with sbatch -n2 on SLURM 22.05)."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_ID": "1"}
    assert discover(env).launcher == "single"
    env.update(RANK="0", WORLD_SIZE="2")  # torchrun started from the batch script
    assert discover(env).launcher == "torchrun"


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[03-05,9],cpu1", "gpu03"),
    ("node1,node2", "node1"),
    ("node7", "node7"),
    ("gpu-a[001-004]", "gpu-a001"),
    ("x[7,2-3]", "x7"),
    ("r[1-2]-n[07,9]-ib,login", "r1-n07-ib"),
    ("  h[5] ", "h5"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("bad", ["", "gpu[03-05", ",a"])
def test_first_slurm_host_rejects(bad):
    with pytest.raises(ValueError):
        first_slurm_host(bad)


def test_single_process():
    info = discover({})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (0, 1, 0, "single")
    assert 0 < info.master_port < 65536


def test_mpi_env_without_mpi4py_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"pip install megarl\[mpi\]"):
        discover({"PMI_RANK": "0"})


# --- real launchers ---------------------------------------------------------

def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"  # the mpich wheel puts it in the venv
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (pip install megarl[mpi])")
@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (pip install mpich)")
def test_mpiexec_two_ranks(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p = subprocess.run([_mpiexec(), "-n", "2", sys.executable, str(script)], env=clean_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert probe_lines(p.stdout) == [
        "rank=0 world=2 local=0 launcher=mpi sum=3",
        "rank=1 world=2 local=1 launcher=mpi sum=3",
    ], p.stdout + p.stderr


def test_srun_two_tasks(slurm_cluster, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p = subprocess.run(["srun", "-N1", "-n2", "--time=3", sys.executable, str(script)],
                       env={**clean_env(), **slurm_cluster}, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert probe_lines(p.stdout) == [
        "rank=0 world=2 local=0 launcher=slurm sum=3",
        "rank=1 world=2 local=1 launcher=slurm sum=3",
    ], p.stdout + p.stderr


@pytest.mark.slow
def test_sbatch_script_runs_ppo(slurm_cluster, tmp_path):
    """launch/slurm/ppo.sbatch as shipped, resized by sbatch options to 2 CPU tasks, one PPO step."""
    out = tmp_path / "job.out"
    p = subprocess.run(
        ["sbatch", "--wait", "-N1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
         "--time=10", "-o", str(out), "launch/slurm/ppo.sbatch", "yaml/tiny.yaml", "trainer.steps=1",
         "data.batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=16",
         "critic.micro_batch_size=16", "trainer.eval_samples=16", f"trainer.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env={**clean_env(), **slurm_cluster, "MEGARL_LAUNCH": "srun"},
        capture_output=True, text=True, timeout=400)
    log = out.read_text() if out.exists() else "(no job output)"
    assert p.returncode == 0, p.stdout + p.stderr + log
    assert "step 1/1" in log and (tmp_path / "run" / "hf" / "config.json").is_file(), log
