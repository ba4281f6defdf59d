"""Monitoring: resource monitor, W&B (offline), progress lines, curves.png, python -m megarl.report.

Units use injected samplers and hand-written run directories with exact
expected values. One real 1-process tiny run (1 step, W&B offline, monitor every
0.2 s) checks the trainer's hooks end to end: the W&B history holds exactly the
finite scalars of metrics.jsonl at the same steps, the config is logged, the
step rows carry resources/*, events.jsonl / curves.png / the progress lines are
written and the report reads the run. Not covered: NVML on a real GPU (faked
here), W&B online mode, multi-node.
"""
import glob
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import types

import psutil
import pytest

from megarl.errors import ConfigError
from megarl.cli import load_config
from megarl.config import Config, WandbConfig
from megarl.config_checks import check_trainer
from megarl.monitor.curves import panels_present, plot_curves
from megarl.monitor.progress import StepProgress, stage
from megarl.monitor.resources import ResourceMonitor, gpu_reading, nvml_sampler, psutil_sampler, summarize
from megarl.monitor.run_files import RunDirError, read_jsonl, read_metrics
from megarl.report import load_run, summary_rows
from megarl.trainer.metrics import console_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- resource monitor ----------------------------------------------------------
def test_summarize_means_and_maxima():
    got = summarize([{"a": 1.0, "b": 4.0}, {"a": 3.0}, {"a": 8.0, "b": 2.0}])
    assert got == {"resources/a_mean": 4.0, "resources/a_max": 8.0, "resources/b_mean": 3.0, "resources/b_max": 4.0}


class CountingSampler:
    """Returns 1, 2, 3, ... and remembers what it returned."""

    def __init__(self):
        self.returned = []

    def __call__(self):
        self.returned.append(float(len(self.returned) + 1))
        return {"x": self.returned[-1]}


def test_monitor_thread_drains_what_it_sampled_and_stops():
    fake = CountingSampler()
    monitor = ResourceMonitor(0.02, [fake])
    assert monitor.drain() == {"resources/x_mean": 1.0, "resources/x_max": 1.0}  # unstarted: one fresh reading
    monitor.start()
    deadline = time.monotonic() + 20
    while len(fake.returned) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    got = monitor.drain()
    taken = fake.returned[1:]  # the thread's readings so far (a drain with samples takes no new one)
    assert len(taken) >= 3
    assert got == {"resources/x_mean": sum(taken) / len(taken), "resources/x_max": max(taken)}
    monitor.stop()
    assert not monitor._thread.is_alive()
    count = len(fake.returned)
    time.sleep(0.1)
    assert len(fake.returned) == count  # stopped: no reading after stop()
    monitor.stop()  # twice is fine


def test_real_psutil_sample_is_plausible():
    sample = psutil_sampler()
    time.sleep(0.1)
    got = sample()
    assert set(got) == {"cpu_percent", "process_cpu_percent", "process_rss_gb", "ram_used_gb", "ram_percent"}
    total_gb = psutil.virtual_memory().total / 2**30
    assert 0.0 <= got["cpu_percent"] <= 100.0 and 0.0 <= got["ram_percent"] <= 100.0
    assert 0.0 <= got["process_cpu_percent"] <= 100.0 * psutil.cpu_count()
    assert 0.01 < got["process_rss_gb"] < total_gb and 0.0 < got["ram_used_gb"] <= total_gb


class FakeNVMLError(Exception):
    pass


def fake_nvml(power_ok=(True, True)):
    """Two GPUs: 50 % and 70 % busy, 1 GiB and 3 GiB used, 100 W and 200 W (power may raise)."""
    gpus = [dict(util=50, used=2**30, mw=100_000), dict(util=70, used=3 * 2**30, mw=200_000)]

    def power(h):
        if not power_ok[h]:
            raise FakeNVMLError("not supported")
        return gpus[h]["mw"]

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=gpus[h]["util"]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=gpus[h]["used"]),
        nvmlDeviceGetPowerUsage=power)


def test_gpu_reading_from_fake_nvml():
    assert gpu_reading(fake_nvml(), [0, 1]) == {"gpu_util_percent": 60.0, "gpu_memory_gb": 3.0, "gpu_power_w": 300.0}
    assert gpu_reading(fake_nvml((False, True)), [0, 1])["gpu_power_w"] == 200.0  # the board without power left out
    assert "gpu_power_w" not in gpu_reading(fake_nvml((False, False)), [0, 1])


def test_nvml_absent_means_no_gpu_fields(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    sampler, why = nvml_sampler()
    assert sampler is None and "nvidia-ml-py" in why


# -- config ----------------------------------------------------------------------
def test_wandb_and_monitor_config_errors(monkeypatch):
    cfg = load_config(["trainer.wandb.enable=true", "trainer.wandb.mode=offline"], Config)
    assert cfg.trainer.wandb == WandbConfig(enable=True, mode="offline")
    with pytest.raises(ConfigError, match="not one of online, offline"):
        load_config(["trainer.wandb.mode=cloud"], Config)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"pip install megarl\[wandb\]"):
        check_trainer(cfg)
    with pytest.raises(ConfigError, match="monitor_interval_s=0.01"):
        check_trainer(load_config(["trainer.monitor_interval_s=0.01"], Config))
    check_trainer(load_config(["trainer.monitor_interval_s=0"], Config))  # 0: off, accepted


def test_wandb_that_does_not_start_is_a_config_error(tmp_path, monkeypatch):
    class FakeWandbError(Exception):
        pass

    def init(**kwargs):
        raise FakeWandbError("No API key configured.\n Use `wandb login`.")

    fake = types.SimpleNamespace(init=init, errors=types.SimpleNamespace(Error=FakeWandbError))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from megarl.monitor.wandb_logger import WandbLogger

    with pytest.raises(ConfigError, match=r"^trainer.wandb: W&B did not start \(No API key configured. Use "
                                          r"`wandb login`.\); run `wandb login`, or set trainer.wandb.mode=offline"):
        WandbLogger(WandbConfig(enable=True), str(tmp_path), {})


# -- progress ------------------------------------------------------------------------
def test_stage_lines():
    out = io.StringIO()
    with stage("exporting to D", stream=out) as line:
        line.detail = "3 tensors, 1.0 MB"
    assert re.fullmatch(r"exporting to D \.\.\. done \(3 tensors, 1\.0 MB, \d+\.\d s\)\n", out.getvalue())
    out = io.StringIO()
    with pytest.raises(KeyError), stage("loading", stream=out):
        raise KeyError("x")
    assert out.getvalue() == "loading ... failed\n"
    out = io.StringIO()
    with stage("quiet", enabled=False, stream=out):
        pass
    assert out.getvalue() == ""


def test_step_progress_is_one_plain_line_per_step_off_a_terminal():
    """A log file gets each step's line whole (no carriage return); a terminal gets the bar, whose
    description is the step's line; other ranks print nothing."""
    out = io.StringIO()
    progress = StepProgress(3, 1, stream=out)  # StringIO is no terminal
    for step in (2, 3):
        progress.update(console_line(step, 3, {"score/mean": 0.5, "agent/tool_calls_mean": 0.95,
                                                "agent/tool_errors_mean": 0.0}))
    progress.close()
    assert out.getvalue() == ("step 2/3  score 0.5  tools 0.95  tool_err 0\n"
                              "step 3/3  score 0.5  tools 0.95  tool_err 0\n")
    tty = io.StringIO()
    progress = StepProgress(3, 0, stream=tty, tty=True)
    progress.update("step 1/3  score 0.5")
    progress.close()
    assert "\r" in tty.getvalue() and "step 1/3  score 0.5" in tty.getvalue() and "1/3" in tty.getvalue()
    quiet = io.StringIO()
    StepProgress(3, 0, enabled=False, stream=quiet).update("step 1/3")
    assert quiet.getvalue() == ""


AGENT_ROWS = [
    {"step": 1, "score/mean": 0.1, "agent/tool_calls_mean": 0.3, "agent/turns_mean": 1.3,
     "agent/tool_errors_mean": 0.125, "agent/tool_truncations_mean": 0.0, "agent/max_turns_frac": 0.0},
    {"step": 2, "score/mean": 0.9, "agent/tool_calls_mean": 0.95, "agent/turns_mean": 1.95,
     "agent/tool_errors_mean": 0.0, "agent/tool_truncations_mean": 0.0625, "agent/max_turns_frac": 0.0},
]


def test_tool_use_in_report_and_curves(tmp_path):
    write_run(tmp_path, AGENT_ROWS)
    table = dict(summary_rows(load_run(str(tmp_path))))
    assert table["tool use per sample"] == ("calls 0.3 -> 0.95, turns 1.3 -> 1.95, errors 0.125 -> 0, "
                                            "truncated outputs 0 -> 0.0625, at the turn limit 0 -> 0")
    panels = dict(panels_present(read_metrics(str(tmp_path / "metrics.jsonl"))))
    assert panels["tool use (per sample)"] == ["agent/tool_calls_mean", "agent/turns_mean", "agent/tool_errors_mean",
                                               "agent/tool_truncations_mean", "agent/max_turns_frac"]
    assert plot_curves(str(tmp_path)) is not None
    write_run(tmp_path / "plain", ROWS)
    assert "tool use per sample" not in dict(summary_rows(load_run(str(tmp_path / "plain"))))


# -- run directory files, curves, report -----------------------------------------------
def write_run(run_dir, rows, events=(), checkpoints=()):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    for name in checkpoints:
        os.makedirs(os.path.join(run_dir, "checkpoints", name))


ROWS = [
    {"step": 0, "eval/accuracy": 0.1},
    {"step": 1, "score/mean": 0.2, "kl/mean": 0.01, "perf/step_seconds": 2.0, "perf/tokens_per_s_per_gpu": 100.0,
     "resources/process_rss_gb_max": 1.5},
    {"step": 2, "score/mean": 0.6, "kl/mean": 0.03, "perf/step_seconds": 4.0, "perf/tokens_per_s_per_gpu": 300.0,
     "resources/process_rss_gb_max": 2.5},
    {"step": 3, "score/mean": 0.4, "kl/mean": None, "perf/step_seconds": 3.0, "perf/tokens_per_s_per_gpu": 200.0},
    {"step": 3, "eval/accuracy": 0.5},
]
EVENTS = [
    {"event": "start", "time": 1000.0, "step": 0, "world_size": 2},
    {"event": "stopped", "time": 1030.0, "step": 1},
    {"event": "start", "time": 2000.0, "step": 1, "world_size": 2},
    {"event": "export", "time": 2089.0, "step": 3, "path": "/x/hf", "tensors": 50, "bytes": 3 * 2**20},
    {"event": "end", "time": 2090.0, "step": 3},
]


def test_report_table_values(tmp_path):
    run = tmp_path / "run"
    write_run(run, ROWS, EVENTS, ["step_000002", "step_000003"])
    table = dict(summary_rows(load_run(str(run))))
    assert table["steps"] == "3 (finished)"
    assert table["wall time"] == "2m 00s over 2 sessions"  # 30 s + 90 s
    assert table["step time"] == "9.0 s in steps, 3 s per step"
    assert table["reward (score/mean)"] == "first 0.2 (step 1)  last 0.4 (step 3)  best 0.6 (step 2)"
    assert table["accuracy (eval)"] == "first 0.1 (step 0)  last 0.5 (step 3)  best 0.5 (step 3)"
    assert table["eval rows"] == "step 0: 0.100, step 3: 0.500"
    assert table["KL (kl/mean)"] == "first 0.01 (step 1)  last 0.03 (step 2)  max 0.03 (step 2)"  # null left out
    assert table["throughput"] == "250 tokens/s per GPU (median), 500 tokens/s on 2 processes"  # step 1 left out
    assert table["peak memory"] == "rank-0 RSS 2.5 GB"
    assert table["checkpoints"].endswith("checkpoints/ step_000002, step_000003")
    assert table["export"] == "/x/hf (50 tensors, 3.0 MB, at step 3)"
    assert "entropy" not in table  # not logged: left out


def test_report_errors_are_one_line_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for arg in (tmp_path / "missing", empty):
        out = subprocess.run([sys.executable, "-m", "megarl.report", str(arg)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("run dir error: "), out.stderr


def test_torn_last_line_is_skipped_and_a_bad_middle_line_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    assert read_metrics(str(path)) == {1: {"a": 1.0}}
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not JSON"):
        read_jsonl(str(path))


def test_curves_leave_out_absent_metrics(tmp_path):
    write_run(tmp_path / "a", ROWS)
    assert [title for title, _ in panels_present(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))] == [
        "reward", "KL", "held-out accuracy"]
    png = plot_curves(str(tmp_path / "a"))
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 600 and im.size[1] > 300
    write_run(tmp_path / "b", [{"step": 0, "data/rows": 5.0}])
    assert plot_curves(str(tmp_path / "b")) is None and not os.path.exists(tmp_path / "b" / "curves.png")


# -- one real run ------------------------------------------------------------------------
def wandb_records(path):
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks of
    [crc32 u32, length u16, type u8] chunks; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("wandb")
    run_dir = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "launch/ppo.py", "yaml/tiny.yaml",
           f"trainer.run_dir={run_dir}", "trainer.steps=1", "data.batch_size=4", "rollout.n=2",
           "actor.mini_batch_size=8", "actor.micro_batch_size=8", "critic.micro_batch_size=8",
           "trainer.eval_samples=4", "trainer.save_last=false", "trainer.tensorboard=false",
           "trainer.monitor_interval_s=0.2", "trainer.wandb.enable=true", "trainer.wandb.mode=offline",
           "trainer.wandb.project=megarl-test"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline", WANDB_SILENT="true")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out.stdout


def test_run_writes_progress_events_resources_and_curves(tiny_run):
    run_dir, stdout = tiny_run
    assert re.search(r"^step 1/1  score \S+  .*s/step \S+$", stdout, re.M), stdout[-2000:]  # a plain line: no tty
    assert "\r" not in stdout
    saved = load_config([str(run_dir / "config.yaml")], Config)  # the resolved config, saved at start
    assert saved.trainer.run_dir == str(run_dir) and saved.data.batch_size == 4
    for line in ("loading the tokenizer and prompts ... done (", "loading the actor from ", "evaluating 4 held-out",
                 f"run directory {run_dir} (resolved config: {run_dir}/config.yaml)\n",
                 "held-out accuracy ", f"exporting the actor to {run_dir}/hf ... done (50 tensors, 3.8 MB, "):
        assert line in stdout, (line, stdout[-2000:])
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    step = rows[1]
    assert step["resources/process_rss_gb_max"] >= step["resources/process_rss_gb_mean"] > 0.05
    assert 0.0 <= step["resources/cpu_percent_mean"] <= step["resources/cpu_percent_max"] <= 100.0
    assert not any(k.startswith("resources/gpu") for k in step)  # no GPU here: not reported
    events = [e["event"] for e in read_jsonl(str(run_dir / "events.jsonl"))]
    assert events == ["start", "export", "end"]
    assert os.path.getsize(run_dir / "curves.png") > 10_000
    table = dict(summary_rows(load_run(str(run_dir))))
    assert table["steps"] == "1 (finished)" and table["export"].startswith(f"{run_dir}/hf (50 tensors, 3.8 MB")


def test_wandb_offline_history_equals_metrics_file(tiny_run):
    run_dir, _ = tiny_run
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = {}, None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            items = {k: v for k, v in items.items() if not k.startswith("_")}  # _step, _runtime, _timestamp
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
            run_id = record.run.run_id
    expected = {s: {k: v for k, v in r.items() if math.isfinite(v)} for s, r in
                read_metrics(str(run_dir / "metrics.jsonl")).items()}
    assert history == expected
    assert config["trainer"]["wandb"]["project"] == "megarl-test"
    assert config["rollout"]["n"] == 2
    assert open(run_dir / "wandb_run_id").read().strip() == run_id  # a resumed run continues this one


@pytest.mark.gpu
def test_nvml_reads_a_busy_gpu():
    """The real NVML sampler (not a fake) while bf16 matmuls keep GPU 0 busy for 3 s."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sampler, why = nvml_sampler()
    if sampler is None:
        pytest.skip(why)
    monitor = ResourceMonitor(0.05, [sampler]).start()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.time()
    while time.time() - start < 3:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    out = monitor.drain()
    monitor.stop()
    print(out)
    assert out["resources/gpu_util_percent_max"] > 50 and out["resources/gpu_memory_gb_max"] > 0.1
    assert out["resources/gpu_power_w_max"] > 50
