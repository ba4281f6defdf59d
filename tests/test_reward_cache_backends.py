"""The reward cache backends (reward.cache: memory | sqlite | redis) and Redis dying mid-run.

Values must come back bitwise (-0.0, the smallest subnormal, 0.1 + 0.2); counting:
of one lookup's keys, each distinct absent key is a miss, every other key a hit.
The Redis tests start their own redis-server on a free port in a tmp dir and skip
when no binary is found (.ci/run installs Debian's redis-server when it can).

The run test: yaml/tiny.yaml for 3 steps with reward.cache=redis, where a reward
term of weight 0 (``kill_redis_after_step_1`` below) SIGKILLs the server once
metrics.jsonl holds step 1, so the kill lands inside step 2's scoring. Both DP
ranks must log the fallback, every metric except timing and the fallback count
must equal a reward.cache=memory run's (wall-clock and resource readings aside; hit counts included: no prompt repeats
in 3 steps, so the per-process LRU and the shared store see the same keys), and
the on-disk store must hold one row per miss of the run (each value computed
once, none lost after the kill). Not covered: Redis on another node, TP > 1,
a Redis that hangs instead of dying (the client's 5 s timeout takes that path).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXACT = [-0.0, 5e-324, 0.1 + 0.2, 1e308, -7.25, 1.0]  # bitwise round trips


def _bits(values):
    return [None if v is None else struct.pack("<d", v) for v in values]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def kill_redis_after_step_1(prompt, response, ground_truth, extra, pid=0, port=0, metrics=""):
    """A reward term (0.0) that SIGKILLs redis-server ``pid`` once ``metrics`` logs step 1."""
    if pid and os.path.exists(metrics) and _answers(port) and any(  # whole lines only: rank 0 may be writing
            line.endswith("\n") and json.loads(line)["step"] == 1 for line in open(metrics)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while _answers(port) and time.monotonic() < deadline:  # the kernel closes its socket on exit
            time.sleep(0.01)
    return 0.0


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server (no persistence) on a free port: yields (url, process)."""
    binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                              else None)
    if binary is None:
        pytest.skip("no redis-server binary (apt-get install redis-server); the Redis backend is untested")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not _answers(port):
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", proc
    proc.kill()
    proc.wait()


def _open(kind, tmp_path, url="redis://127.0.0.1:1/0", size=100):
    from megarl.rewards.cache import open_reward_cache

    return open_reward_cache(kind, size, str(tmp_path / "rc.sqlite"), url)


def _check_exact(cache):
    """put 6 values; lookup [k0, k1, k0, absent, absent] -> 1 distinct miss, 4 hits."""
    keys = [cache.key("t", "p", str(i), None) for i in range(len(EXACT))]
    cache.put_many(dict(zip(keys, EXACT)))
    absent = cache.key("t", "p", "absent", None)
    got = cache.get_many([keys[0], keys[1], keys[0], absent, absent])
    assert _bits(got) == _bits([EXACT[0], EXACT[1], EXACT[0], None, None])
    assert _bits(cache.get_many(keys)) == _bits(EXACT)
    assert math.copysign(1.0, cache.get(keys[0])) == -1.0
    m = cache.metrics()
    assert (m["hits"], m["misses"], m["size"], m["fallbacks"]) == (4.0 + 6 + 1, 1.0, 6.0, 0.0)
    assert m["hit_rate"] == 11 / 12


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_backend_round_trip_and_counts(kind, tmp_path):
    _check_exact(_open(kind, tmp_path, size=100 if kind == "memory" else 1))  # 1: lookups reach the store


def test_redis_round_trip(redis_server, tmp_path):
    """The redis backend: exact values, 8 bytes under megarl:reward:<sha256>, and every write on disk."""
    import redis

    url, _ = redis_server
    cache = _open("redis", tmp_path, url, size=1)
    _check_exact(cache)
    key = cache.key("t", "p", "2", None)
    assert redis.Redis.from_url(url).get("megarl:reward:" + key) == struct.pack("<d", EXACT[2])
    assert len(cache.backend.store.disk) == len(EXACT) and cache.name == "redis"


def test_sqlite_persists_across_processes(tmp_path):
    """A child process writes; this process reads bitwise the same values; the file is one table."""
    code = ("import sys; from megarl.rewards.cache import open_reward_cache as o; "
            "c = o('sqlite', 10, sys.argv[1], ''); "
            "c.put_many({c.key('t', 'p', str(i), None): v for i, v in enumerate(%r)})" % (EXACT,))
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "rc.sqlite")], check=True, cwd=ROOT)
    cache = _open("sqlite", tmp_path)
    keys = [cache.key("t", "p", str(i), None) for i in range(len(EXACT))]
    assert _bits(cache.get_many(keys)) == _bits(EXACT) and cache.misses == 0 and len(cache) == len(EXACT)
    rows = sqlite3.connect(tmp_path / "rc.sqlite").execute("SELECT COUNT(*) FROM rewards").fetchone()
    assert rows == (len(EXACT),)


def test_redis_dies_then_the_disk_serves(redis_server, tmp_path, caplog):
    """Kill the server: the values written before come from disk, new writes go there, one warning."""
    url, proc = redis_server
    cache = _open("redis", tmp_path, url, size=1)  # an LRU of 1: lookups reach the store
    keys = [cache.key("t", "p", str(i), None) for i in range(3)]
    cache.put_many({keys[0]: 1.5, keys[1]: -0.0})
    proc.kill()
    proc.wait()
    with caplog.at_level("WARNING"):
        assert _bits(cache.get_many(keys)) == _bits([1.5, -0.0, None])
        cache.put(keys[2], 2.5)
        assert cache.get_many(keys[1:]) == [-0.0, 2.5]
    warnings = [r.getMessage() for r in caplog.records if "stopped answering" in r.getMessage()]
    assert len(warnings) == 1 and url in warnings[0] and "rc.sqlite" in warnings[0]
    assert cache.fallbacks == 1 and cache.metrics()["fallbacks"] == 1.0 and len(cache) == 3


def test_cache_config_errors(tmp_path, monkeypatch):
    from megarl.errors import ConfigError
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import check_reward_cache

    def check(*overrides):
        check_reward_cache(load_config(["yaml/tiny.yaml", *overrides], Config).reward)

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="reward.cache: 'disk' is not one of memory, sqlite, redis"):
        check("reward.cache=disk")
    with pytest.raises(ConfigError, match=r"reward.redis_url=http://x: cannot be parsed .*redis://host:port/db"):
        check("reward.cache=redis", "reward.redis_url=http://x")
    with pytest.raises(ConfigError, match="database 'zero' is not a number"):
        check("reward.cache=redis", "reward.redis_url=redis://127.0.0.1:6379/zero")
    with pytest.raises(ConfigError, match="reward.cache_path is read by reward.cache=sqlite or redis only"):
        check(f"reward.cache_path={tmp_path}/x.sqlite")
    with pytest.raises(ConfigError, match="reward.redis_url is read by reward.cache=redis only"):
        check("reward.cache=sqlite", "reward.redis_url=redis://h:1/0")
    with pytest.raises(ConfigError, match="reward.cache_size=0 with reward.cache=sqlite"):
        check("reward.cache=sqlite", "reward.cache_size=0")
    check("reward.cache=sqlite", f"reward.cache_path={tmp_path}/x.sqlite")


def test_unreachable_redis_is_one_line_exit_2():
    url = f"redis://127.0.0.1:{_free_port()}/0"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "launch/ppo.py", "yaml/tiny.yaml", "reward.cache=redis",
                        f"reward.redis_url={url}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: reward.redis_url={url}: no Redis server answers")
    assert "redis-server --port 6379 --daemonize yes" in lines[0] and "Traceback" not in p.stderr


def _tiny_run(run_dir, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/ppo.py", "yaml/tiny.yaml",
           f"trainer.run_dir={run_dir}", "trainer.steps=3", "data.batch_size=8", "rollout.n=4",
           "actor.mini_batch_size=16", "actor.micro_batch_size=8", "critic.micro_batch_size=8",
           "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_last=false", "data.eval_path=null",
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT / "tests"))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    first_error = max(out.stderr.find("Traceback"), 0)  # a rank's own, not torchrun's summary
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[first_error: first_error + 4000]
    rows = {}
    for line in open(run_dir / "metrics.jsonl"):
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    return out, rows


def _terms(hook_kwargs) -> str:
    hook = {"name": "test_reward_cache_backends:kill_redis_after_step_1", "weight": 0.0, "kwargs": hook_kwargs}
    return "reward.terms=" + json.dumps([{"name": "math", "weight": 1.0}, hook])


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items()
            if not k.startswith(("timing/", "perf/", "resources/", "memory/")) and k != "reward/cache/fallbacks"}


def test_redis_killed_mid_run_changes_nothing(redis_server, tmp_path):
    url, proc = redis_server
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    _, memory = _tiny_run(tmp_path / "memory", _terms({}))
    run = tmp_path / "redis"
    hook = {"pid": proc.pid, "port": port, "metrics": str(run / "metrics.jsonl")}
    out, redis_rows = _tiny_run(run, "reward.cache=redis", f"reward.redis_url={url}", _terms(hook))
    assert proc.wait(timeout=10) == -signal.SIGKILL  # the hook killed it
    assert out.stderr.count("stopped answering") == 2, out.stderr[-3000:]  # one line per DP rank
    assert f"reward cache: redis ({url}, written through to {run}/reward_cache.sqlite)" in out.stdout
    assert sorted(memory) == sorted(redis_rows) == [0, 1, 2, 3]
    for step in range(1, 4):
        assert _comparable(memory[step]) == _comparable(redis_rows[step]), step
    assert [redis_rows[s]["reward/cache/fallbacks"] for s in (1, 3)] == [0.0, 2.0]  # rank 1: by step 3's lookup
    assert memory[3]["reward/cache/fallbacks"] == 0.0
    misses = sum(redis_rows[s]["reward/cache/misses"] for s in range(1, 4))
    hits = sum(redis_rows[s]["reward/cache/hits"] for s in range(1, 4))
    assert hits > 0 and misses > 0
    rows = sqlite3.connect(run / "reward_cache.sqlite").execute("SELECT COUNT(*) FROM rewards").fetchone()[0]
    assert rows == misses  # every computed value reached the disk, before and after the kill


def test_kwargs_are_part_of_the_key(tmp_path):
    """Two runs share one sqlite store; format with pattern 'a' scores 'a' 1.0, with pattern 'b' 0.0:
    the second must not be served the first's value."""
    from megarl.rewards import CompositeReward, RewardSample

    def score(pattern):
        reward = CompositeReward([("format", 1.0, {"pattern": pattern})], cache=_open("sqlite", tmp_path, size=1))
        out = reward([RewardSample("p", "a", None)])
        return out.total.tolist(), out.metrics["cache/misses"]

    assert score("a") == ([1.0], 1.0)
    assert score("b") == ([0.0], 1.0)
    assert score("a") == ([1.0], 0.0)  # kept across runs
