"""Finding tool calls in model text.

A tool-call parser is ``"hermes"`` or ``"pkg.module:function"`` naming a function
of this signature (:func:`resolve_parser`):

    parse(text: str) -> tuple[list[ToolCall], list[str]]

returning the calls in text order and one line per malformed call (the rollout
shows those to the model instead of running anything).

Hermes format (Qwen2.5/3, Hermes, many others), one block per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "1+2"}}
    </tool_call>

``arguments`` is a JSON object, or a string holding one (some templates encode it
twice); a missing ``arguments`` means no arguments. A ``<tool_call>`` with no
closing tag is reported as a problem: generation that stops on
:data:`TOOL_CALL_END` must keep the stop string in the text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from megarl.errors import ConfigError
from megarl.tools.registry import load_attr, one_line

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)

Parser = Callable[[str], "tuple[list[ToolCall], list[str]]"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str  # the tool's name as written by the model
    arguments: dict = field(default_factory=dict)  # decoded JSON object, not yet checked against a schema


def _decode_block(body: str) -> ToolCall | str:
    """The call in one block's body, or a one-line problem (without the block index)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(obj, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "missing 'name' (a non-empty string)"
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return f"'arguments' of '{name}' is a string but not JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"'arguments' of '{name}' must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """Every ``<tool_call>{json}</tool_call>`` block in ``text`` -> (calls, problems).

    Problems read ``"tool call {i}: ..."`` with ``i`` the 0-based block index.
    """
    calls: list[ToolCall] = []
    problems: list[str] = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        if not match.group(2):
            problems.append(f"tool call {i}: no closing {TOOL_CALL_END}")
            continue
        got = _decode_block(match.group(1).strip())
        if isinstance(got, ToolCall):
            calls.append(got)
        else:
            problems.append(f"tool call {i}: {one_line(got)}")
    return calls, problems


PARSERS: dict[str, Parser] = {"hermes": parse_hermes}


def resolve_parser(spec: str) -> Parser:
    """``"hermes"`` or ``"pkg.module:function"`` -> ``parse(text) -> (calls, problems)``."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise ConfigError(f"tool parser '{spec}' is not built in ({', '.join(PARSERS)}); "
                          "write 'pkg.module:function' for your own")
    fn = load_attr(spec, "tool parser")
    if not callable(fn):
        raise ConfigError(f"tool parser '{spec}' is a {type(fn).__name__}, expected a function "
                          "parse(text) -> (calls, problems)")
    return fn
