"""launch/slurm/: the srun line ppo.sbatch builds (plain, pyxis, apptainer), its stop-and-requeue
near the time limit, and submit.sh's config check before sbatch.

Stand-ins for ``srun``, ``scancel``, ``scontrol`` and ``sbatch`` on PATH record their
arguments, so these run without SLURM (tests/test_ranks.py runs the script for real on a
one-node cluster where SLURM is installed). The stand-in srun plays the job step: it
exits 0 on SIGTERM, as every megarl rank does after saving its checkpoint. Not covered:
pyxis, enroot and apptainer themselves (not installable here), bash older than 4.4
(the array expansions are checked by reading the script instead).
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(ROOT, "launch", "slurm")
SCRIPT = os.path.join(SLURM_DIR, "ppo.sbatch")
ENTRY_ARGS = ["launch/ppo.py", "yaml/tiny.yaml", "trainer.steps=1"]

STAND_INS = {
    # the job step: records its arguments, then runs until SIGTERM (exit 0) or the end of $SRUN_SECONDS
    "srun": 'printf "%s\\n" "$@" > "$LOG/srun"; echo $$ > "$LOG/srun.pid"\n'
            'trap "exit 0" TERM; for _ in $(seq "${SRUN_SECONDS:-0}"); do sleep 0.1; done\n',
    "scancel": 'echo "$@" >> "$LOG/scancel"; kill -TERM "$(cat "$LOG/srun.pid")"\n',
    "scontrol": 'echo "$@" >> "$LOG/scontrol"\n',
    "sbatch": 'printf "%s\\n" "$@" > "$LOG/sbatch"\n',
}


def stand_ins(tmp_path) -> dict:
    """A bin/ folder of stand-ins first on PATH; returns the environment for a script."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    pythonpath = os.pathsep.join([ROOT, os.path.join(ROOT, "kernels"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PATH=path, PYTHONPATH=pythonpath, LOG=str(log), SLURM_SUBMIT_DIR=ROOT,
                SLURM_JOB_ID="4242")


def recorded(tmp_path, name):
    path = tmp_path / "log" / name
    return path.read_text().splitlines() if path.exists() else None


def run_script(tmp_path, **env):
    done = subprocess.run(["bash", SCRIPT, *ENTRY_ARGS[1:]], env=dict(stand_ins(tmp_path), **env),
                          capture_output=True, text=True, timeout=60)
    return done, recorded(tmp_path, "srun")


def test_plain_srun_runs_the_entry_with_the_overrides(tmp_path):
    done, args = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert args[-4:] == ["python", *ENTRY_ARGS]
    assert not any(a.startswith("--container") for a in args)
    assert recorded(tmp_path, "scontrol") is None  # no time-limit signal: no requeue


def test_pyxis_takes_a_local_image_file_and_the_images_entry_script(tmp_path):
    (tmp_path / "megarl.sqsh").write_bytes(b"")
    done, args = run_script(tmp_path, MEGARL_IMAGE=str(tmp_path / "megarl.sqsh"), MEGARL_MOUNTS="/models:/models")
    assert done.returncode == 0, done.stderr
    assert f"--container-image={tmp_path / 'megarl.sqsh'}" in args
    assert f"--container-workdir={ROOT}" in args
    assert f"--container-mounts={ROOT}:{ROOT},/models:/models" in args
    # the launcher of the image's megarl, not the submit directory's copy
    assert args[-4:] == ["python", "/opt/megarl/launch/ppo.py", *ENTRY_ARGS[1:]]


def test_apptainer_wraps_the_command(tmp_path):
    sif = tmp_path / "megarl.sif"
    sif.write_bytes(b"")
    done, args = run_script(tmp_path, MEGARL_APPTAINER=str(sif))
    assert done.returncode == 0, done.stderr
    start = args.index("apptainer")
    assert args[start:start + 3] == ["apptainer", "exec", "--nv"]
    assert args[args.index(str(sif)) + 1:] == ["python", "/opt/megarl/launch/ppo.py", *ENTRY_ARGS[1:]]


@pytest.mark.parametrize("env,needle", [
    (dict(MEGARL_IMAGE="a.sqsh", MEGARL_APPTAINER="b.sif"), "not both"),
    (dict(MEGARL_IMAGE="megarl:latest"), "MEGARL_IMAGE=megarl:latest: no such image file"),
    (dict(MEGARL_APPTAINER="/nonexistent/megarl.sif"), "no such image file"),
    (dict(MEGARL_APPTAINER=SCRIPT, MEGARL_VENV="/venv"), "MEGARL_VENV activates a host venv"),
    (dict(MEGARL_LAUNCH="mpirun"), "MEGARL_LAUNCH must be srun or torchrun"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, env, needle):
    done, args = run_script(tmp_path, **env)
    assert done.returncode == 2 and args is None
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def signal_during_step(tmp_path, **env):
    """Starts the script, sends USR1 once the step runs; (process, stdout, stderr)."""
    proc = subprocess.Popen(["bash", SCRIPT, *ENTRY_ARGS[1:]], env=dict(stand_ins(tmp_path), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while recorded(tmp_path, "srun.pid") is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    return proc, out, err


def test_time_limit_shorter_than_the_margin_runs_on_without_requeue(tmp_path):
    """--time=10 with a 900 s margin: SLURM signals at once; stopping and requeueing would loop."""
    proc, out, err = signal_during_step(tmp_path, SRUN_SECONDS="20")  # the step ends by itself after 2 s
    assert proc.returncode == 0, err
    assert recorded(tmp_path, "scancel") is None and recorded(tmp_path, "scontrol") is None
    assert "within the --signal margin; running on, no requeue" in out


def test_time_limit_signal_stops_the_step_and_requeues(tmp_path):
    """USR1 (what --signal=B:USR1@900 sends) -> scancel --signal=TERM to the job's steps -> the step
    exits 0 -> scontrol requeue; the script exits with the step's code."""
    proc, out, err = signal_during_step(tmp_path, MEGARL_MIN_RUN_S="0", SRUN_SECONDS="600")
    assert proc.returncode == 0, err
    assert recorded(tmp_path, "scancel") == ["--signal=TERM 4242"]
    assert recorded(tmp_path, "scontrol") == ["requeue 4242"]
    assert "time limit near" in out and "requeueing job 4242" in out


def test_sbatch_header_signals_with_a_margin_and_requeues():
    header = [line.split()[1] for line in open(SCRIPT) if line.startswith("#SBATCH ")]
    signal_opt = next(o for o in header if o.startswith("--signal="))
    assert re.fullmatch(r"--signal=B:USR1@(\d+)", signal_opt) and int(signal_opt.split("@")[1]) >= 300
    assert "--requeue" in header and "--open-mode=append" in header  # the requeued job appends to its log


@pytest.mark.parametrize("script", ["ppo.sbatch", "submit.sh"])
def test_array_expansions_are_safe_on_bash_before_4_4(script):
    """bash <= 4.3 with set -u calls an empty "${A[@]}" unbound: each must be ${A[@]+"${A[@]}"}."""
    text = "".join(line for line in open(os.path.join(SLURM_DIR, script)) if not line.lstrip().startswith("#"))
    assert "[@]" in text
    for match in re.finditer(r'"\$\{(\w+)\[@\]\}"', text):
        name = match.group(1)
        guarded = text[:match.start()].endswith(f"${{{name}[@]+")
        nonempty = re.search(rf"\b{name}=\(\S", text) and not re.search(rf"\b{name}=\(\)", text)  # never ()
        assert guarded or nonempty, f'{script}: "${{{name}[@]}}" is not guarded against an empty array'


# ---- check_config.py / submit.sh --------------------------------------------------------------

def check(tmp_path, *args, **env):
    return subprocess.run([sys.executable, os.path.join(SLURM_DIR, "check_config.py"), *args],
                          env=dict(stand_ins(tmp_path), **env), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("options,env,expected", [
    ([], {}, 16),                                       # the #SBATCH lines: 2 nodes x 8 tasks
    (["-N", "4"], {}, 32),
    (["-N1", "--ntasks-per-node=2"], {}, 2),
    (["--nodes", "3", "--ntasks-per-node", "4"], {}, 12),
    (["-N", "2", "--gpus-per-node=h100:4"], {"MEGARL_LAUNCH": "torchrun"}, 8),
    (["-N", "2"], {"MEGARL_LAUNCH": "torchrun", "GPUS_PER_NODE": "2"}, 4),
    (["-N", "5"], {"MEGARL_WORLD_SIZE": "3"}, 3),
])
def test_world_size_from_sbatch_options(options, env, expected):
    sys.path.insert(0, SLURM_DIR)
    try:
        from check_config import world_size
    finally:
        sys.path.remove(SLURM_DIR)
    assert world_size(options, env) == expected


def test_check_passes_a_good_config(tmp_path):
    done = check(tmp_path, "-N", "1", "--ntasks-per-node=2", "yaml/tiny.yaml", "trainer.steps=3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "config ok for ppo.py on 2 processes: yaml/tiny.yaml trainer.steps=3"


@pytest.mark.parametrize("args,needle", [
    (["-N", "1", "--ntasks-per-node=2", "yaml/tiny.yaml", "trainer.stepz=3"], "unknown key 'trainer.stepz'"),
    (["-N", "2-4", "yaml/tiny.yaml"], "--nodes=2-4: not a count"),
    (["-N", "1", "--ntasks-per-node=3", "yaml/tiny.yaml", "parallel.tp=2"], "parallel.tp"),
    (["-N", "1", "trainer.steps=3"], "no CONFIG.yaml"),
])
def test_check_rejects_with_one_line(tmp_path, args, needle):
    done = check(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def submit(tmp_path, *args, **env):
    return subprocess.run(["bash", os.path.join(SLURM_DIR, "submit.sh"), *args], env=dict(stand_ins(tmp_path), **env),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_submit_checks_then_passes_everything_to_sbatch(tmp_path):
    done = submit(tmp_path, "-N", "1", "--ntasks-per-node=2", "--time=1:00:00", "yaml/tiny.yaml", "trainer.steps=3")
    assert done.returncode == 0, done.stderr
    assert "config ok for ppo.py on 2 processes" in done.stdout
    assert recorded(tmp_path, "sbatch") == ["-N", "1", "--ntasks-per-node=2", "--time=1:00:00", SCRIPT,
                                            "yaml/tiny.yaml", "trainer.steps=3"]


def test_submit_does_not_submit_a_bad_config(tmp_path):
    done = submit(tmp_path, "-N", "1", "yaml/tiny.yaml", "rollout.temprature=1")
    assert done.returncode == 2 and recorded(tmp_path, "sbatch") is None
    assert "unknown key 'rollout.temprature'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_submit_without_megarl_to_check_with_says_how_to_go_on(tmp_path):
    no_megarl = tmp_path / "nomegarl"
    no_megarl.mkdir()
    (no_megarl / "python").write_text("#!/bin/bash\nexit 1\n")
    (no_megarl / "python").chmod(0o755)
    env = stand_ins(tmp_path)
    env["PATH"] = f"{no_megarl}:{env['PATH']}"
    done = subprocess.run(["bash", os.path.join(SLURM_DIR, "submit.sh"), "yaml/tiny.yaml"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "MEGARL_CHECK=0" in done.stderr and recorded(tmp_path, "sbatch") is None
    done = subprocess.run(["bash", os.path.join(SLURM_DIR, "submit.sh"), "yaml/tiny.yaml"],
                          env=dict(env, MEGARL_CHECK="0"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and recorded(tmp_path, "sbatch") == [SCRIPT, "yaml/tiny.yaml"]
