"""Resource monitor: a daemon thread samples CPU, RAM and (where NVML works) GPU use.

Every ``interval_s`` seconds each sampler returns a flat ``{name: value}``; the
trainer calls :meth:`ResourceMonitor.drain` once per step and logs the mean and
the max of every name over the samples since the previous drain as
``resources/<name>_mean`` and ``resources/<name>_max``. Rank 0 runs it and so
reports its own node (the GPUs NVML sees there, this process's RSS).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

Sampler = Callable[[], dict[str, float]]


class ResourceMonitor:
    """Samples every ``interval_s`` seconds on a daemon thread until :meth:`stop`."""

    def __init__(self, interval_s: float, samplers: list[Sampler]):
        self.interval_s = interval_s
        self.samplers = samplers
        self._samples: list[dict[str, float]] = []
        self._lock = threading.Lock()  # guards the samples and every sampler call
        self._last_sample = 0.0  # perf_counter of the newest reading, by the thread or a drain
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-resource-monitor", daemon=True)

    def start(self) -> "ResourceMonitor":
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        """One reading of every sampler, merged (call with the lock held)."""
        out: dict[str, float] = {}
        for sampler in self.samplers:
            out.update(sampler())
        self._last_sample = time.perf_counter()
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                # a drain's reading just now would make this one's CPU-% window too short to mean anything
                if time.perf_counter() - self._last_sample >= self.interval_s / 2:
                    self._samples.append(self.sample())

    def drain(self) -> dict[str, float]:
        """Mean and max since the last drain; a step shorter than the interval gets one fresh sample."""
        with self._lock:
            samples, self._samples = self._samples, []
            return summarize(samples or [self.sample()])

    def stop(self) -> None:
        """Ends the thread (it wakes from its wait at once); safe to call twice or unstarted."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    """``resources/<name>_mean`` and ``_max`` over the samples that have ``name``."""
    names = sorted({k for s in samples for k in s})
    out = {}
    for name in names:
        values = [s[name] for s in samples if name in s]
        out[f"resources/{name}_mean"] = sum(values) / len(values)
        out[f"resources/{name}_max"] = max(values)
    return out


def psutil_sampler() -> Sampler:
    """System CPU %, this process's CPU % (100 = one core) and RSS, the node's RAM in use."""
    import psutil

    proc = psutil.Process()
    psutil.cpu_percent(None)  # the first call of each only starts the interval
    proc.cpu_percent(None)

    def sample() -> dict[str, float]:
        vm = psutil.virtual_memory()
        return {"cpu_percent": psutil.cpu_percent(None), "process_cpu_percent": proc.cpu_percent(None),
                "process_rss_gb": proc.memory_info().rss / 2**30,
                "ram_used_gb": (vm.total - vm.available) / 2**30, "ram_percent": vm.percent}

    return sample


def nvml_sampler() -> tuple[Optional[Sampler], str]:
    """(sampler, "") for the node's GPUs, or (None, why not): no pynvml, no driver, no GPU."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as e:
        return None, f"NVML does not start: {e}"
    if not handles:
        return None, "NVML sees no GPU"
    return (lambda: gpu_reading(pynvml, handles)), ""


def gpu_reading(nvml, handles) -> dict[str, float]:
    """gpu_util_percent: mean over the GPUs; gpu_memory_gb: the fullest GPU; gpu_power_w: their sum.
    A quantity a GPU does not report (power on some boards, utilization under MIG) is left out."""
    util = _each(nvml, handles, lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
    memory = _each(nvml, handles, lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30)
    power = _each(nvml, handles, lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW -> W
    out = {}
    if util:
        out["gpu_util_percent"] = sum(util) / len(util)
    if memory:
        out["gpu_memory_gb"] = max(memory)
    if power:
        out["gpu_power_w"] = sum(power)
    return out


def _each(nvml, handles, query) -> list[float]:
    values = []
    for h in handles:
        try:
            values.append(float(query(h)))
        except nvml.NVMLError:
            pass
    return values


def start_monitor(interval_s: float, log: Callable[[str], None] = print) -> Optional[ResourceMonitor]:
    """The running monitor with psutil and (where it works) NVML; None when ``interval_s`` is 0."""
    if interval_s <= 0:
        return None
    samplers = [psutil_sampler()]
    gpu, why_not = nvml_sampler()
    if gpu is None:
        log(f"resource monitor: CPU and RAM only, no GPU metrics: {why_not}")
    else:
        samplers.append(gpu)
    return ResourceMonitor(interval_s, samplers).start()
