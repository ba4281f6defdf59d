"""Running a turn's tool calls concurrently, each with a time limit; nothing raises.

``ToolExecutor(tools).run(calls)`` returns one :class:`ToolOutput` per call, in
input order. Every failure becomes an output with ``ok=False`` and a one-line
``"error: ..."`` text the model can read: unknown tool, arguments that fail
:func:`megarl.tools.registry.check_arguments`, an exception in ``fn``, a non-str
return, a timeout. A tool that reports its own failure in its text (the
sandbox's "[killed: ...]") is still ``ok=True``. Texts longer than
``max_output_chars`` keep their first ``max_output_chars`` characters and end
with ``"\\n[... truncated N chars]"``.

Timeouts, per call, counted from when the call starts running:

* a tool with ``timeout_kw`` (the python sandbox) gets ``timeout_s`` through that
  keyword and stops itself; the executor waits ``slack_s`` longer as a backstop;
* any other fn is waited for ``timeout_s``; then its output is a timeout error but
  its thread keeps running (Python cannot kill a thread) and holds a worker.
  A call that cannot start within the time the calls ahead of it may take
  (``timeout_s + slack_s`` per round of ``max_workers``) fails as "not started".
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from megarl.tools.parser import ToolCall
from megarl.tools.registry import Tool, check_arguments, one_line


@dataclass(frozen=True)
class ToolOutput:
    """The result of one call, for the model and for metrics."""

    name: str  # the called tool's name as the model wrote it
    text: str  # what goes back to the model; "error: ..." when ok is False
    ok: bool  # False: unknown tool, bad arguments, exception, timeout
    truncated: bool = False  # text was cut at max_output_chars
    elapsed_s: float = 0.0  # wall time from start of the call to its output


@dataclass
class _Pending:
    """A call handed to a worker; the worker stamps ``start`` when it begins."""

    tool: Tool
    started: threading.Event = field(default_factory=threading.Event)
    start: float = 0.0  # time.monotonic() when a worker began the call
    queue_deadline: float = 0.0  # fail as "not started" if no worker began it by then
    future: Future | None = None


class ToolExecutor:
    """Runs tool calls on a thread pool; see the module docstring for timeouts and errors."""

    slack_s = 2.0  # extra wait for sandbox start/cleanup and bookkeeping

    def __init__(self, tools: dict[str, Tool], max_workers: int = 8, timeout_s: float = 10.0,
                 max_output_chars: int = 4000):
        if max_workers < 1 or timeout_s <= 0 or max_output_chars < 0:
            raise ValueError("ToolExecutor needs max_workers >= 1, timeout_s > 0, max_output_chars >= 0")
        self.tools, self.max_workers, self.timeout_s = dict(tools), max_workers, timeout_s
        self.max_output_chars = max_output_chars
        self._workers = ThreadPoolExecutor(max_workers, thread_name_prefix="megarl-tool")
        # a waiter per submitted batch, taken in submission order. When a batch is done, every earlier
        # batch has started all its calls (workers are FIFO too), so the earlier ones not yet done hold
        # at most max_workers waiters: with twice that, a done batch never waits behind slow ones (the
        # agent's overlapped schedule submits a batch per sample and polls each future)
        self._waiters = ThreadPoolExecutor(2 * max_workers, thread_name_prefix="megarl-tool-wait")
        self._lock, self._in_flight = threading.Lock(), 0  # calls handed to workers, not yet returned

    def run(self, calls: list[ToolCall]) -> list[ToolOutput]:
        """One output per call, in input order."""
        return self.submit(calls).result()

    def submit(self, calls: list[ToolCall]) -> Future[list[ToolOutput]]:
        """Starts the calls now; the future holds ``run(calls)``'s result (it never raises). Batches
        submitted at different times share the worker pool in submission order."""
        calls = list(calls)
        pending = [self._start(call) for call in calls]
        return self._waiters.submit(lambda: [self._finish(c, p) for c, p in zip(calls, pending)])

    def close(self) -> None:
        """Waits for pending batches; abandoned (timed-out) calls are not waited for."""
        self._waiters.shutdown(wait=True)
        self._workers.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, call: ToolCall) -> _Pending | ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return self._output(call, f"error: unknown tool '{call.name}'; available: {known}", False, 0.0)
        problem = check_arguments(tool, call.arguments)
        if problem:
            return self._output(call, f"error: {problem}", False, 0.0)
        pending = _Pending(tool)
        with self._lock:
            self._in_flight += 1
            rounds = math.ceil(self._in_flight / self.max_workers)
        pending.queue_deadline = time.monotonic() + rounds * (self.timeout_s + self.slack_s)
        pending.future = self._workers.submit(self._call, pending, call.arguments)
        return pending

    def _call(self, pending: _Pending, arguments: dict):
        pending.start = time.monotonic()
        pending.started.set()
        kwargs = dict(arguments)
        if pending.tool.timeout_kw:
            kwargs[pending.tool.timeout_kw] = self.timeout_s
        try:
            return pending.tool.fn(**kwargs)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _finish(self, call: ToolCall, pending: _Pending | ToolOutput) -> ToolOutput:
        if isinstance(pending, ToolOutput):
            return pending
        if not pending.started.wait(max(0.0, pending.queue_deadline - time.monotonic())):
            if pending.future.cancel():
                with self._lock:
                    self._in_flight -= 1
                return self._output(call, f"error: tool '{call.name}' not started: all {self.max_workers} "
                                          "workers are busy with calls that timed out", False, 0.0)
            pending.started.wait()
        limit = self.timeout_s + (self.slack_s if pending.tool.timeout_kw else 0.0)
        try:
            text = pending.future.result(timeout=max(0.0, pending.start + limit - time.monotonic()))
        except FutureTimeout:
            return self._output(call, f"error: tool '{call.name}' timed out after {self.timeout_s:g}s",
                                False, time.monotonic() - pending.start)
        except Exception as e:  # noqa: BLE001 - a tool's bug must not end the rollout
            return self._output(call, f"error: tool '{call.name}' raised {type(e).__name__}: {one_line(e)}",
                                False, time.monotonic() - pending.start)
        if not isinstance(text, str):
            return self._output(call, f"error: tool '{call.name}' returned {type(text).__name__}, not str",
                                False, time.monotonic() - pending.start)
        return self._output(call, text, True, time.monotonic() - pending.start)

    def _output(self, call: ToolCall, text: str, ok: bool, elapsed_s: float) -> ToolOutput:
        if len(text) <= self.max_output_chars:
            return ToolOutput(call.name, text, ok, False, elapsed_s)
        dropped = len(text) - self.max_output_chars
        cut = f"{text[:self.max_output_chars]}\n[... truncated {dropped} chars]"
        return ToolOutput(call.name, cut, ok, True, elapsed_s)
