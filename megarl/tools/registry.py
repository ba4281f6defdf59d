"""Tools a model may call during an agentic rollout, and how configs name them.

A tool is a :class:`Tool`: a name, a description, an OpenAI function-calling JSON
schema for its arguments, and ``fn(**arguments) -> str``. A tool's ``fn`` never
raises on bad input: it returns an ``"error: ..."`` string the model can read
(:class:`megarl.tools.executor.ToolExecutor` still catches anything that escapes).

Configs name tools by spec (:func:`resolve_tool`):

* a built-in name: ``"calculator"``, ``"python"``;
* ``"pkg.module:attr"`` where ``attr`` is a Tool, or a zero-argument function
  returning one.

Mistakes in a spec are :class:`megarl.errors.ConfigError` one-liners naming the spec
and the fix.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from megarl.errors import ConfigError

BUILTIN_TOOLS = {
    "calculator": "megarl.tools.calculator:calculator",
    "python": "megarl.tools.sandbox:python_tool",
}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_JSON_TYPES = {  # JSON schema type -> Python types a json.loads value may have
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """One callable tool; ``fn(**arguments) -> str``."""

    name: str  # what the model writes in a call; [A-Za-z0-9_-]{1,64}
    description: str  # shown to the model in the tool list
    parameters: dict  # {"type": "object", "properties": {...}, "required": [...]}
    fn: Callable[..., str]  # called with the call's arguments as keywords
    timeout_kw: str | None = None  # keyword through which fn takes its own time limit (s), if any

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object'")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn is not callable")

    def schema(self) -> dict:
        """The OpenAI tool entry: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


def one_line(text: Any) -> str:
    """``str(text)`` with runs of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(text).split())


def load_attr(spec: str, what: str) -> Any:
    """The object named by ``"pkg.module:attr"`` (``attr`` may be dotted); ConfigError otherwise.

    ``what`` names the kind of spec in messages ("tool", "tool parser").
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} '{spec}': expected 'pkg.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module
        raise ConfigError(f"{what} '{spec}': cannot import module '{module_name}' ({type(e).__name__}: "
                          f"{one_line(e)}); check the module path and PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} '{spec}': module '{module_name}' has no attribute '{attr}'; "
                              "check the name after ':'")
        obj = getattr(obj, part)
    return obj


def resolve_tool(spec: str) -> Tool:
    """A built-in tool name or ``"pkg.module:attr"`` (a Tool or a zero-arg factory of one) -> Tool."""
    if ":" not in spec and spec not in BUILTIN_TOOLS:
        raise ConfigError(f"tool '{spec}' is not a built-in ({', '.join(BUILTIN_TOOLS)}); "
                          "write 'pkg.module:function' for your own")
    obj = load_attr(BUILTIN_TOOLS.get(spec, spec), "tool")
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise ConfigError(f"tool '{spec}' is a {type(obj).__name__}, expected a megarl.tools.Tool "
                          "or a zero-argument function returning one")
    try:
        made = obj()
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"tool '{spec}': calling it raised {type(e).__name__}: {one_line(e)}; "
                          "it must be a Tool or a zero-argument function returning one") from e
    if not isinstance(made, Tool):
        raise ConfigError(f"tool '{spec}' returned a {type(made).__name__}, expected a megarl.tools.Tool")
    return made


def resolve_tools(specs: list[str]) -> dict[str, Tool]:
    """Specs -> {tool.name: Tool}, in spec order; two specs giving one name is a ConfigError."""
    tools: dict[str, Tool] = {}
    source: dict[str, str] = {}
    for spec in specs:
        tool = resolve_tool(spec)
        if tool.name in tools:
            raise ConfigError(f"tools '{source[tool.name]}' and '{spec}' both define a tool named "
                              f"'{tool.name}'; remove one of them")
        tools[tool.name], source[tool.name] = tool, spec
    return tools


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _matches(value, name):
            return name
    return type(value).__name__


def _matches(value: Any, json_type: str) -> bool:
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False  # bool is an int in Python, not in JSON
    return isinstance(value, _JSON_TYPES.get(json_type, object))


def check_arguments(tool: Tool, args: Any) -> str | None:
    """One line saying what is wrong with ``args`` for ``tool``, or None when they fit.

    Checks, in this order: args is an object; no key outside ``properties``; every
    ``required`` key present; each value has its property's JSON ``type`` (a type or
    a list of types; string, integer, number, boolean, array, object, null;
    3.0 is a number, not an integer). Other schema keywords (enum, ranges, nested
    schemas) are not checked.
    """
    if not isinstance(args, dict):
        return f"arguments of '{tool.name}' must be a JSON object, got {_json_type(args)}"
    props = tool.parameters.get("properties", {})
    for key in args:
        if key not in props:
            known = ", ".join(props) or "none"
            return f"unknown argument '{key}' for '{tool.name}'; expected: {known}"
    for key in tool.parameters.get("required", []):
        if key not in args:
            return f"missing required argument '{key}' for '{tool.name}'"
    for key, value in args.items():
        want = props[key].get("type")
        types = [want] if isinstance(want, str) else list(want or [])
        if types and not any(_matches(value, t) for t in types):
            return f"argument '{key}' of '{tool.name}' must be {' or '.join(types)}, got {_json_type(value)}"
    return None
