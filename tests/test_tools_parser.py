"""Hermes tool-call blocks parse to exact calls; every malformed block gives one exact problem line."""
import pytest

from megarl.errors import ConfigError
from megarl.tools import TOOL_CALL_END, ToolCall, parse_hermes, resolve_parser


def upper_parser(text):
    return [ToolCall(text.upper())], []


def test_calls_in_text_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
            'and <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    assert parse_hermes(text) == ([ToolCall("calculator", {"expression": "1+2"}),
                                   ToolCall("python", {"code": "print(1)"}), ToolCall("now", {})], [])


def test_no_calls():
    assert parse_hermes("The answer is 4.") == ([], [])


@pytest.mark.parametrize("body, problem", [
    ('{"name": "a", "arguments": {', "tool call 0: invalid JSON (Expecting property name enclosed in double quotes "
                                     "at line 1 column 29)"),
    ('[1, 2]', "tool call 0: expected a JSON object with 'name' and 'arguments', got list"),
    ('{"arguments": {}}', "tool call 0: missing 'name' (a non-empty string)"),
    ('{"name": "", "arguments": {}}', "tool call 0: missing 'name' (a non-empty string)"),
    ('{"name": 3}', "tool call 0: missing 'name' (a non-empty string)"),
    ('{"name": "a", "arguments": [1]}', "tool call 0: 'arguments' of 'a' must be a JSON object, got list"),
    ('{"name": "a", "arguments": "[1]"}', "tool call 0: 'arguments' of 'a' must be a JSON object, got list"),
    ('{"name": "a", "arguments": "{oops"}', "tool call 0: 'arguments' of 'a' is a string but not JSON "
                                            "(Expecting property name enclosed in double quotes)"),
])
def test_malformed_blocks(body, problem):
    assert parse_hermes(f"<tool_call>{body}</tool_call>") == ([], [problem])


def test_good_and_bad_blocks_mix_with_indices():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "c"')
    assert parse_hermes(text) == (
        [ToolCall("a"), ToolCall("b", {"x": 1})],
        ["tool call 1: invalid JSON (Expecting value at line 1 column 1)", f"tool call 3: no closing {TOOL_CALL_END}"])


def test_resolve_parser():
    assert resolve_parser("hermes") is parse_hermes
    assert resolve_parser("test_tools_parser:upper_parser")("hi") == ([ToolCall("HI")], [])
    assert TOOL_CALL_END == "</tool_call>"


@pytest.mark.parametrize("spec, message", [
    ("qwen", "tool parser 'qwen' is not built in (hermes); write 'pkg.module:function' for your own"),
    ("test_tools_parser:nope", "tool parser 'test_tools_parser:nope': module 'test_tools_parser' has no attribute "
                               "'nope'; check the name after ':'"),
    ("test_tools_parser:TOOL_CALL_END", "tool parser 'test_tools_parser:TOOL_CALL_END' is a str, expected a function "
                                        "parse(text) -> (calls, problems)"),
])
def test_resolve_parser_errors(spec, message):
    with pytest.raises(ConfigError) as e:
        resolve_parser(spec)
    assert str(e.value) == message
