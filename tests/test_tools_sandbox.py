"""Adversarial runs of the python sandbox: each ends within seconds and leaves nothing behind.

"Nothing behind" = no live process carrying the run's MEGARL_SANDBOX marker, no
descendant of this test process, the temp dir gone, and no file outside it.
Limits are small so that each case ends fast. Not covered: the non-root paths
(this machine runs tests as root), hostile native code (see the module docstring).
"""
import os
import socket
import sys
import tempfile
import time
import uuid

import psutil
import pytest

from megarl.tools import sandbox
from megarl.tools.sandbox import SandboxLimits, SandboxResult, python_tool, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, max_processes=16,
                       max_file_bytes=1 << 20, max_output_bytes=4096)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sandbox_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "MEGARL_SANDBOX" in p.environ():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _live_children() -> list[psutil.Process]:
    live = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                live.append(c)
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return live


def _run(code: str, limits: SandboxLimits = LIMITS, max_s: float = 6.0) -> SandboxResult:
    """run_python + the leave-nothing-behind checks."""
    before = set(os.listdir(tempfile.gettempdir()))
    others = {c.pid for c in _live_children()}  # what earlier tests of the session left running
    start = time.monotonic()
    result = run_python(code, limits)
    assert time.monotonic() - start < max_s
    assert _sandbox_processes() == []
    assert [c for c in _live_children() if c.pid not in others] == []
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("megarl-sandbox-")]
    return result


def test_normal_code_prints_and_exits_zero():
    r = _run("import math\nprint(sum(range(10)))\nprint(math.factorial(20))")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == ("45\n2432902008176640000\n", "", 0, False, False)
    assert r.text() == "45\n2432902008176640000"


def test_files_inside_the_work_dir_are_fine():
    r = _run("open('a.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
             "print(open('d/b.txt').read(), os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])")
    assert (r.stdout, r.exit_code) == ("hi True\n", 0)


def test_syntax_error_goes_to_stderr():
    r = _run("x = (")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines() == ['  File "main.py", line 1', "    x = (", "        ^",
                                     "SyntaxError: '(' was never closed"]
    assert r.text().endswith("[exit code 1]")


def test_exception_traceback_starts_at_user_code():
    r = _run("def f():\n    raise ValueError('boom')\nf()")
    assert r.stderr.splitlines()[1] == '  File "main.py", line 3, in <module>'
    assert r.stderr.splitlines()[-1] == "ValueError: boom"


def test_fork_bomb_is_bounded_and_cleaned_up():
    r = _run("import os\nwhile True: os.fork()")
    assert r.exit_code != 0 and "BlockingIOError" in r.stderr


def test_memory_bomb_fails_with_memory_error():
    r = _run("x = bytearray(10 * 2**30)")
    assert r.exit_code == 1 and r.stderr.splitlines()[-1] == "MemoryError"


def test_infinite_loop_hits_the_cpu_limit():
    r = _run("while True: pass", SandboxLimits(wall_s=5.0, cpu_s=1, memory_bytes=512 << 20))
    assert r.exit_code == -24 and not r.timed_out  # SIGXCPU
    assert r.text() == "[killed by SIGXCPU (cpu time limit)]"


def test_sleep_hits_the_wall_limit():
    limits = SandboxLimits(wall_s=0.5, cpu_s=2, memory_bytes=512 << 20)
    r = _run("import time\nprint('start', flush=True)\ntime.sleep(100)", limits, max_s=3.0)
    assert (r.stdout, r.exit_code, r.timed_out) == ("start\n", -9, True)
    assert r.text() == "start\n[killed: wall-clock time limit]"


@pytest.mark.parametrize("where", [tempfile.gettempdir(), REPO])
def test_writes_outside_the_work_dir_fail(where):
    target = os.path.join(where, f"megarl-escape-{uuid.uuid4().hex}")
    r = _run(f"open({target!r}, 'w').write('x')")
    assert r.exit_code == 1 and r.stderr.splitlines()[-1].startswith("PermissionError: sandbox: cannot write")
    assert not os.path.exists(target)
    r = _run(f"import os\nos.mkdir({target!r})")
    assert r.exit_code == 1 and "os.mkdir outside the current directory" in r.stderr
    assert not os.path.exists(target)


def test_escape_through_a_symlink_fails():
    target = os.path.join(tempfile.gettempdir(), f"megarl-escape-{uuid.uuid4().hex}")
    r = _run(f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')")
    assert r.exit_code == 1 and "PermissionError" in r.stderr
    assert not os.path.lexists(target)


def test_ctypes_is_refused():
    r = _run("import ctypes")
    assert r.stderr.splitlines()[-1] == "ImportError: sandbox: 'ctypes' is not allowed"


@pytest.mark.parametrize("namespaces", [True, False])
def test_network_is_cut(namespaces):
    """A listening socket on 127.0.0.1 of this process, and a DNS lookup, are both unreachable."""
    limits = SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, namespaces=namespaces)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import socket\nfor f in [lambda: socket.create_connection(('127.0.0.1', %d), timeout=1),\n"
                "          lambda: socket.getaddrinfo('example.com', 443), lambda: socket.gethostbyname('example.com')]:\n"
                "    try:\n        f()\n        print('reached')\n"
                "    except OSError as e:\n        print(type(e).__name__)\n") % port
        r = _run(code, limits)
    assert r.exit_code == 0 and "reached" not in r.stdout and len(r.stdout.splitlines()) == 3
    if not namespaces:
        assert (r.network, r.stdout) == ("audit-hook", "PermissionError\n" * 3)
    elif r.network != "namespace":
        pytest.skip("kernel refused unshare(CLONE_NEWNET); covered by the audit-hook case")


def test_huge_output_is_truncated_with_bounded_memory():
    rss = psutil.Process().memory_info().rss
    r = _run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)", max_s=10.0)
    assert r.exit_code == 0 and r.truncated
    assert r.stdout == "x" * 4096 + f"\n[... truncated {100_000_000 - 4096} bytes]"
    assert psutil.Process().memory_info().rss - rss < 50 << 20


def test_background_child_is_killed():
    r = _run("import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 100'])\nprint('left it')")
    assert (r.stdout, r.exit_code) == ("left it\n", 0)


def test_child_in_its_own_session_is_killed():
    """setsid() leaves the process group; as root the uid sweep still finds it."""
    if os.geteuid() != 0:
        pytest.skip("the uid sweep runs as root only")
    r = _run("import subprocess\nsubprocess.Popen(['setsid', 'sleep', '100'])\nprint('left it')")
    assert r.stdout == "left it\n"


def test_session_sweep_without_uid_switch(monkeypatch):
    """The non-root cleanup path (killpg + session sweep), forced here by skipping the uid switch."""
    monkeypatch.setattr(sandbox, "_run_as", lambda: None)
    r = _run("import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 100 & sleep 100'])\nprint('ok')")
    assert r.stdout == "ok\n"


def test_tool_passes_the_timeout_down():
    start = time.monotonic()
    text = python_tool.fn(code="import time\ntime.sleep(30)", timeout_s=0.5)
    assert text == "[killed: wall-clock time limit]" and time.monotonic() - start < 3.0
    assert python_tool.fn(code="print(6 * 7)") == "42"
    assert python_tool.timeout_kw == "timeout_s" and sys.executable
