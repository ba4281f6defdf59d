"""ToolExecutor: outputs in input order, concurrency, every failure an exact ok=False line, exact truncation."""
import threading
import time

import pytest

from megarl.tools import Tool, ToolCall, ToolExecutor, resolve_tools

ANY = {"type": "object", "properties": {"x": {"type": "number"}}}
RELEASE = threading.Event()  # lets the hung tool's thread end when a test is done


def _sleep_echo(x):
    time.sleep(x)
    return f"slept {x}"


def _raise(x):
    raise KeyError("bad\nkey")


def _hang(x):
    RELEASE.wait(30)
    return "late"


TOOLS = {t.name: t for t in [
    Tool("sleep", "", ANY, _sleep_echo), Tool("boom", "", ANY, _raise), Tool("hang", "", ANY, _hang),
    Tool("long", "", ANY, lambda x: "y" * int(x)), Tool("number", "", ANY, lambda x: x),
]}


@pytest.fixture
def executor():
    RELEASE.clear()
    with ToolExecutor(TOOLS, max_workers=4, timeout_s=1.0, max_output_chars=100) as ex:
        yield ex
    RELEASE.set()


def test_outputs_keep_input_order_and_run_concurrently(executor):
    delays = [0.3, 0.2, 0.1, 0.0]
    start = time.monotonic()
    outputs = executor.run([ToolCall("sleep", {"x": d}) for d in delays])
    assert time.monotonic() - start < 0.55  # serial would take 0.6 s
    assert [(o.name, o.text, o.ok, o.truncated) for o in outputs] == [
        ("sleep", f"slept {d}", True, False) for d in delays]


def test_every_failure_is_one_ok_false_line(executor):
    outputs = executor.run([ToolCall("nope", {}), ToolCall("sleep", {"y": 1}), ToolCall("sleep", {"x": "1"}),
                            ToolCall("boom", {"x": 1}), ToolCall("number", {"x": 2}), ToolCall("sleep", {"x": 0})])
    assert [(o.text, o.ok) for o in outputs] == [
        ("error: unknown tool 'nope'; available: boom, hang, long, number, sleep", False),
        ("error: unknown argument 'y' for 'sleep'; expected: x", False),
        ("error: argument 'x' of 'sleep' must be number, got string", False),
        ("error: tool 'boom' raised KeyError: 'bad\\nkey'", False),
        ("error: tool 'number' returned int, not str", False),
        ("slept 0", True),
    ]


def test_long_outputs_are_cut_with_exact_count(executor):
    """max_output_chars=100: 250 chars keep 100 and drop 150; exactly 100 is kept whole."""
    cut, whole = executor.run([ToolCall("long", {"x": 250}), ToolCall("long", {"x": 100})])
    assert (cut.text, cut.ok, cut.truncated) == ("y" * 100 + "\n[... truncated 150 chars]", True, True)
    assert (whole.text, whole.ok, whole.truncated) == ("y" * 100, True, False)


def test_timeout_returns_an_error_without_waiting(executor):
    start = time.monotonic()
    hung, quick = executor.run([ToolCall("hang", {"x": 0}), ToolCall("sleep", {"x": 0})])
    assert time.monotonic() - start < 1.5
    assert (hung.text, hung.ok) == ("error: tool 'hang' timed out after 1s", False)
    assert (quick.text, quick.ok) == ("slept 0", True)


def test_calls_that_cannot_start_fail_as_not_started():
    RELEASE.clear()
    ex = ToolExecutor(TOOLS, max_workers=1, timeout_s=0.2)
    ex.slack_s = 0.1
    try:
        hung, queued = ex.run([ToolCall("hang", {"x": 0}), ToolCall("sleep", {"x": 0})])
        assert hung.text == "error: tool 'hang' timed out after 0.2s"
        assert (queued.text, queued.ok) == (
            "error: tool 'sleep' not started: all 1 workers are busy with calls that timed out", False)
    finally:
        RELEASE.set()
        ex.close()


def test_submit_overlaps_with_other_work(executor):
    future = executor.submit([ToolCall("sleep", {"x": 0.2})])
    assert not future.done()
    assert future.result()[0].text == "slept 0.2"


def test_python_tool_gets_the_timeout_as_its_wall_limit():
    tools = resolve_tools(["python", "calculator"])
    with ToolExecutor(tools, timeout_s=1.0) as ex:
        start = time.monotonic()
        slow, fast, calc = ex.run([ToolCall("python", {"code": "import time\ntime.sleep(30)"}),
                                   ToolCall("python", {"code": "print(2 + 2)"}),
                                   ToolCall("calculator", {"expression": "2**10"})])
    assert time.monotonic() - start < 4.0
    assert [(o.text, o.ok) for o in (slow, fast, calc)] == [
        ("[killed: wall-clock time limit]", True), ("4", True), ("1024", True)]
