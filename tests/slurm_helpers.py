"""A throwaway one-node SLURM cluster for tests, started and stopped by a fixture.

Its own munged (own key and socket), slurmctld and slurmd, all configured in a
temporary directory on free ports, so nothing in /etc is touched and a system
SLURM (if any) is left alone. Needs root and Debian's ``slurm-wlm`` and
``munge``; ``slurm_cluster`` skips otherwise. Yields the environment
(``SLURM_CONF``) that ``srun`` needs to find the cluster.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None)


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to run slurmd"
    absent = [d for d in DAEMONS if _which(d) is None]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurm-wlm munge)"
    return None


def _slurm_conf(tmp: Path, munge_socket: Path) -> str:
    host = socket.gethostname().split(".")[0]
    return f"""\
ClusterName=megarltest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _wait(predicate, seconds: float, what: str, logs) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    text = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
    raise RuntimeError(f"{what} did not come up in {seconds:.0f} s\n{text}")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(f"SLURM test cluster: {reason}")
    tmp = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (tmp / sub).mkdir(mode=0o700)
    key, sock = tmp / "munge" / "munge.key", tmp / "munge" / "munge.sock"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = tmp / "slurm.conf"
    conf.write_text(_slurm_conf(tmp, sock))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    logs = [tmp / "munged.log", tmp / "slurmctld.log", tmp / "slurmd.log"]
    procs = []
    try:
        subprocess.run([_which("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
                        f"--pid-file={tmp / 'munge' / 'munged.pid'}", f"--log-file={logs[0]}",
                        f"--seed-file={tmp / 'munge' / 'seed'}"], check=True, timeout=30)
        _wait(sock.exists, 10, "munged", logs)
        procs.append(subprocess.Popen([_which("slurmctld"), "-D", "-i"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([_which("slurmd"), "-D"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

        def idle() -> bool:
            p = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return p.returncode == 0 and p.stdout.strip() in ("idle", "mix", "alloc")

        _wait(idle, 60, "slurmd (node idle)", logs)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        pid_file = tmp / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass
