"""The ``python`` tool: model-written code in a confined, throwaway subprocess.

Spec: ``run_python(code, limits) -> SandboxResult``; the ``python`` Tool takes
``{"code": string}`` and returns ``SandboxResult.text()``. The code runs as
``sys.executable -I -B -c _BOOTSTRAP`` with stdin at EOF, a minimal environment,
and a fresh ``tempfile.mkdtemp()`` as cwd, HOME and TMPDIR (deleted afterwards).
stdout/stderr are read incrementally and kept up to ``max_output_bytes`` each.

Threat model: the code is careless or hostile Python, not a kernel exploit. It
must not hang the rollout, exhaust the host, reach the network, or change files
outside its temp dir, and nothing it starts may outlive the call. Layers:

* Kernel limits, set by ``preexec_fn`` before exec: RLIMIT_CPU, AS, FSIZE,
  NOFILE, NPROC, CORE=0, and PR_SET_NO_NEW_PRIVS (setuid binaries gain nothing).
* Processes. Root ignores RLIMIT_NPROC, so as root the child switches to a
  random throwaway uid (one per run) keeping only CAP_DAC_READ_SEARCH, so that an
  interpreter in a root-only dir (/root/.pyenv) stays readable; reads are thus
  not confined. NPROC then bounds a fork bomb, and cleanup kills every process of
  that uid with kill(-1) run as that uid (atomic against fork, and it finds
  processes that left the session). As non-root, NPROC is the user's current
  task count + max_processes, and cleanup kills the process group and every
  process left in the session; one that calls setsid() escapes that sweep.
* Time: everything is killed at ``wall_s``, and as soon as the main process
  exits (background children do not outlive the call).
* Network: a new network namespace (only a down loopback) via unshare(2):
  CLONE_NEWNET as root, CLONE_NEWUSER|CLONE_NEWNET otherwise. Where the kernel
  refuses, an audit hook refuses socket connect/bind/send and name lookups.
  ``SandboxResult.network`` says which: "namespace" | "audit-hook".
* Files: an audit hook (sys.addaudithook) refuses write-mode ``open`` and os.*
  mutations (remove, rename, mkdir, chmod, link, ...) outside the temp dir, and
  the import of ctypes / cffi.

The audit hook is best-effort: it guards Python code in the sandbox's own
interpreter only. It does not see child processes (``sh -c 'echo > /tmp/x'``
writes wherever the uid may: /tmp is world-writable), native extensions,
os.mkfifo/os.mknod (no audit event), dir_fd-relative calls, or code that
patches os/posixpath to fool its path checks; with ctypes one bypasses it
entirely, hence that import is refused. In "audit-hook" network mode a child
process can reach the network. Run megarl in a container or VM when the code
may be truly hostile.
"""
from __future__ import annotations

import ctypes
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import psutil

from megarl.tools.registry import Tool

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.unshare.argtypes = [ctypes.c_int]
_LIBC.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 8, 38, 47, 2
CAP_DAC_READ_SEARCH, _CAP_VERSION_3 = 2, 0x20080522
_namespaces_work: bool | None = None  # learned on the first run that tries

# Runs in the child as `python -I -B -c BOOTSTRAP <work dir> <network mode>`: installs the audit
# hook, then runs <work dir>/main.py as __main__ with tracebacks that start at the user's code.
BOOTSTRAP = r"""
import os, sys, traceback, linecache
WORK, GUARD_NET = os.path.realpath(sys.argv[1]), sys.argv[2] == "audit-hook"
sys.argv = ["main.py"]

def _install(work=WORK, guard_net=GUARD_NET, realpath=os.path.realpath, fsdecode=os.fsdecode):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    paths = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
             "os.truncate": (0,), "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
             "os.chflags": (0,), "os.lchflags": (0,), "os.rename": (0, 1), "os.link": (0, 1),
             "os.symlink": (1,)}
    net = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
           "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    banned = {"ctypes", "_ctypes", "cffi", "_cffi_backend"}

    def inside(path):
        if isinstance(path, int):
            return True
        real = realpath(fsdecode(path))
        return real == work or real.startswith(work + "/") or real == "/dev/null"

    def hook(event, args):
        if event == "open" and isinstance(args[2], int) and args[2] & write_flags and not inside(args[0]):
            raise PermissionError(f"sandbox: cannot write {args[0]!r}: only the current directory is writable")
        if event in paths and not all(inside(args[i]) for i in paths[event]):
            raise PermissionError(f"sandbox: {event} outside the current directory is not allowed")
        if event == "import" and args[0].partition(".")[0] in banned or event.startswith("ctypes."):
            raise ImportError(f"sandbox: {args[0]!r} is not allowed")
        if guard_net and event in net:
            raise PermissionError("sandbox: network access is disabled")
    sys.addaudithook(hook)

def _main():
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as e:
        traceback.print_exception(type(e), e, None)
        sys.exit(1)
    _install()
    try:
        exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)

_main()
"""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds on one run."""

    wall_s: float = 10.0  # wall-clock seconds before everything is killed
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)
    memory_bytes: int = 1 << 30  # address space per process (RLIMIT_AS)
    max_processes: int = 32  # processes and threads the run may add (RLIMIT_NPROC)
    max_file_bytes: int = 16 << 20  # largest file it may write (RLIMIT_FSIZE)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 64 << 10  # stdout and stderr are each cut here
    namespaces: bool = True  # try a network namespace; False: the audit-hook guard only


@dataclass(frozen=True)
class SandboxResult:
    """What one run printed and how it ended."""

    stdout: str  # decoded UTF-8 (bad bytes replaced), ends with a truncation marker if cut
    stderr: str  # same
    exit_code: int  # negative: killed by that signal (-9 after a wall-clock kill)
    timed_out: bool  # killed at limits.wall_s
    truncated: bool  # stdout or stderr was cut at limits.max_output_bytes
    network: str  # "namespace" | "audit-hook": how network access was cut

    def text(self) -> str:
        """What the model sees: stdout, then stderr and how the run ended when notable."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.timed_out:
            parts.append("[killed: wall-clock time limit]")
        elif self.exit_code < 0:
            reason = " (cpu time limit)" if -self.exit_code == signal.SIGXCPU else ""
            parts.append(f"[killed by {signal.Signals(-self.exit_code).name}{reason}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(p.rstrip("\n") for p in parts) or "[no output]"


def _check(rc: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _become(uid: int) -> None:
    """Switches to ``uid`` keeping only CAP_DAC_READ_SEARCH, also across exec (ambient)."""
    _check(_LIBC.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    bit = 1 << CAP_DAC_READ_SEARCH
    data = (_CapData * 2)(_CapData(bit, bit, bit), _CapData(0, 0, 0))
    _check(_LIBC.capset(ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), data))
    _check(_LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0))


def _confine(limits: SandboxLimits, unshare_flags: int, uid: int | None):
    """The preexec_fn: it only makes syscalls through already-loaded functions (threads are about)."""
    nproc = limits.max_processes if uid is not None else _user_tasks() + limits.max_processes
    rlimits = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
               (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
               (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0),
               (resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes),
               (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files)]

    def preexec() -> None:
        if unshare_flags:
            _check(_LIBC.unshare(unshare_flags))
        _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))
        if uid is not None:
            _become(uid)
    return preexec


def _user_tasks() -> int:
    """Processes + threads of this real uid now (what RLIMIT_NPROC counts)."""
    me = os.getuid()
    return sum(p.info["num_threads"] or 1 for p in psutil.process_iter(["uids", "num_threads"])
               if p.info["uids"] and p.info["uids"].real == me)


def _run_as() -> int | None:
    """A throwaway uid when running as root (so RLIMIT_NPROC counts), else None."""
    return (1 << 30) + secrets.randbelow(1 << 28) if os.geteuid() == 0 else None


def _spawn(work: str, limits: SandboxLimits, uid: int | None) -> tuple[subprocess.Popen, str]:
    """Starts the bootstrap; tries the network namespace first, else falls back to the audit hook."""
    global _namespaces_work
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MEGARL_SANDBOX": os.path.basename(work)}  # marks the run's processes
    flags = CLONE_NEWNET | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
    modes = [("namespace", flags)] if limits.namespaces and _namespaces_work is not False else []
    for mode, unshare_flags in modes + [("audit-hook", 0)]:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", BOOTSTRAP, work, mode], cwd=work, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_confine(limits, unshare_flags, uid))
        except subprocess.SubprocessError:
            if mode == "audit-hook":
                raise
            _namespaces_work = False
            continue
        _namespaces_work = _namespaces_work or mode == "namespace"
        return proc, mode
    raise AssertionError("unreachable")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_uid(uid: int) -> None:
    """kill(-1, SIGKILL) as ``uid``: every process of that uid at once, whatever its session."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _leftovers(sid: int, uid: int | None) -> list[psutil.Process]:
    def ours(p: psutil.Process) -> bool:
        try:
            return p.uids().real == uid if uid is not None else os.getsid(p.pid) == sid
        except (psutil.Error, OSError):
            return False
    return [p for p in psutil.process_iter() if p.pid != os.getpid() and ours(p) and _alive(p)]


def _kill_all(sid: int, uid: int | None) -> None:
    """SIGKILLs the run's process group, then whatever is left of its uid (root) or session."""
    for _ in range(50):
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            _kill_uid(uid)
        left = _leftovers(sid, uid)
        if not left:
            return
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.01)


class _Capped:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.kept)
        self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        return f"{text}\n[... truncated {self.dropped} bytes]" if self.dropped else text


def _collect(proc: subprocess.Popen, limits: SandboxLimits, kill) -> tuple[_Capped, _Capped, bool]:
    """Reads both pipes until they close; calls ``kill()`` at the wall limit or once the main process exits."""
    out, err = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    deadline, killed_at, timed_out = time.monotonic() + limits.wall_s, None, False
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if killed_at is None and (proc.poll() is not None or now >= deadline):
                timed_out = proc.poll() is None
                kill()
                killed_at = now
            if killed_at is not None and (not sel.get_map() or now > killed_at + 1.0):
                return out, err, timed_out
            for key, _ in sel.select(timeout=0.05):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    sinks[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs ``code`` in the sandbox; returns once it and everything it started are gone."""
    work = tempfile.mkdtemp(prefix="megarl-sandbox-")
    uid = _run_as()
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(work, uid, uid)
        proc, network = _spawn(work, limits, uid)
        with proc:
            out, err, timed_out = _collect(proc, limits, lambda: _kill_all(proc.pid, uid))
            exit_code = proc.wait()
        _kill_all(proc.pid, uid)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return SandboxResult(out.text(), err.text(), exit_code, timed_out,
                         bool(out.dropped or err.dropped), network)


def _python_fn(code: str, timeout_s: float | None = None) -> str:
    limits = SandboxLimits() if timeout_s is None else replace(SandboxLimits(), wall_s=timeout_s)
    return run_python(code, limits).text()


python_tool = Tool(
    name="python",
    description=("Run Python 3 code in a sandbox and return what it prints (stdout, then stderr). "
                 "No network; files only in the current directory; state does not persist between calls."),
    parameters={"type": "object", "properties": {"code": {"type": "string", "description": "a Python program"}},
                "required": ["code"]},
    fn=_python_fn,
    timeout_kw="timeout_s",
)
