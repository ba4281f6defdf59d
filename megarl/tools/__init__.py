"""Tools for multi-turn agentic rollouts: definitions, built-ins, call parsing, execution.

    tools = resolve_tools(["calculator", "python"])        # name -> Tool
    calls, problems = resolve_parser("hermes")(model_text)  # ToolCall list + one-line problems
    with ToolExecutor(tools, timeout_s=10) as ex:
        outputs = ex.run(calls)                             # ToolOutput per call, in order
"""
from megarl.tools.executor import ToolExecutor, ToolOutput
from megarl.tools.parser import TOOL_CALL_END, TOOL_CALL_START, ToolCall, parse_hermes, resolve_parser
from megarl.tools.registry import BUILTIN_TOOLS, Tool, check_arguments, resolve_tool, resolve_tools

__all__ = [
    "BUILTIN_TOOLS", "TOOL_CALL_END", "TOOL_CALL_START", "Tool", "ToolCall", "ToolExecutor", "ToolOutput",
    "check_arguments", "parse_hermes", "resolve_parser", "resolve_tool", "resolve_tools",
]
