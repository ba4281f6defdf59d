"""launch/slurm/ppo.sbatch builds the right srun line: plain, in a pyxis container, under apptainer.

A stand-in ``srun`` on PATH records its arguments, so these run without SLURM
(tests/test_ranks.py runs the script for real on a one-node cluster where SLURM
is installed). Bad container settings exit 2 with one line.
"""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "slurm", "ppo.sbatch")


def run_script(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    srun.chmod(0o755)
    args_file = tmp_path / "args.txt"
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_ARGS=str(args_file),
                    SLURM_SUBMIT_DIR=ROOT, **env)
    done = subprocess.run(["bash", SCRIPT, "yaml/tiny.yaml", "trainer.steps=1"], env=full_env,
                          capture_output=True, text=True, timeout=60)
    return done, (args_file.read_text().splitlines() if args_file.exists() else None)


def test_plain_srun_runs_the_entry_with_the_overrides(tmp_path):
    done, args = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert args[-4:] == ["python", "launch/ppo.py", "yaml/tiny.yaml", "trainer.steps=1"]
    assert not any(a.startswith("--container") for a in args)


def test_pyxis_image_mounts_the_submit_dir_as_workdir(tmp_path):
    done, args = run_script(tmp_path, MEGARL_IMAGE="megarl:latest", MEGARL_MOUNTS="/models:/models")
    assert done.returncode == 0, done.stderr
    assert "--container-image=megarl:latest" in args
    assert f"--container-workdir={ROOT}" in args
    assert f"--container-mounts={ROOT}:{ROOT},/models:/models" in args
    assert args[-4:] == ["python", "launch/ppo.py", "yaml/tiny.yaml", "trainer.steps=1"]


def test_apptainer_wraps_the_command(tmp_path):
    sif = tmp_path / "megarl.sif"
    sif.write_bytes(b"")
    done, args = run_script(tmp_path, MEGARL_APPTAINER=str(sif))
    assert done.returncode == 0, done.stderr
    start = args.index("apptainer")
    assert args[start:start + 3] == ["apptainer", "exec", "--nv"] and str(sif) in args
    assert args.index(str(sif)) < args.index("python")


@pytest.mark.parametrize("env,needle", [
    (dict(MEGARL_IMAGE="a", MEGARL_APPTAINER="b.sif"), "not both"),
    (dict(MEGARL_APPTAINER="/nonexistent/megarl.sif"), "no such image file"),
    (dict(MEGARL_LAUNCH="mpirun"), "MEGARL_LAUNCH must be srun or torchrun"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, env, needle):
    done, args = run_script(tmp_path, **env)
    assert done.returncode == 2 and args is None
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
