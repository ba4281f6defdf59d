"""Tool specs resolve to Tools or fail with one ConfigError line; argument checks are exact."""
import pytest

from megarl.errors import ConfigError
from megarl.tools import Tool, check_arguments, resolve_tool, resolve_tools
from megarl.tools.calculator import calculator
from megarl.tools.sandbox import python_tool

ECHO = Tool("echo", "Echo text.", {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]}, lambda text: text)
ALSO_CALCULATOR = Tool("calculator", "another", {"type": "object"}, lambda: "")
NOT_A_TOOL = 42


def make_echo():
    return ECHO


def make_int():
    return 3


def make_broken():
    raise RuntimeError("no\nconfig")


KINDS = Tool("kinds", "", {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "a": {"type": "array"}, "o": {"type": "object"}, "maybe": {"type": ["string", "null"]}, "any": {}}},
    lambda **kw: "")


def test_builtins_and_dotted_paths():
    assert resolve_tool("calculator") is calculator
    assert resolve_tool("python") is python_tool
    assert resolve_tool("test_tools_registry:ECHO") is ECHO
    assert resolve_tool("test_tools_registry:make_echo") is ECHO
    assert list(resolve_tools(["python", "test_tools_registry:make_echo"])) == ["python", "echo"]


def test_schema_is_the_openai_tool_entry():
    assert ECHO.schema() == {"type": "function", "function": {
        "name": "echo", "description": "Echo text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


@pytest.mark.parametrize("spec, message", [
    ("calc", "tool 'calc' is not a built-in (calculator, python); write 'pkg.module:function' for your own"),
    ("no_such_mod_xyz:t", "tool 'no_such_mod_xyz:t': cannot import module 'no_such_mod_xyz' "
                          "(ModuleNotFoundError: No module named 'no_such_mod_xyz'); check the module path and PYTHONPATH"),
    ("test_tools_registry:missing", "tool 'test_tools_registry:missing': module 'test_tools_registry' has no "
                                    "attribute 'missing'; check the name after ':'"),
    ("test_tools_registry:NOT_A_TOOL", "tool 'test_tools_registry:NOT_A_TOOL' is a int, expected a megarl.tools.Tool "
                                       "or a zero-argument function returning one"),
    ("test_tools_registry:make_int", "tool 'test_tools_registry:make_int' returned a int, expected a megarl.tools.Tool"),
    ("test_tools_registry:make_broken", "tool 'test_tools_registry:make_broken': calling it raised RuntimeError: "
                                        "no config; it must be a Tool or a zero-argument function returning one"),
    (":x", "tool ':x': expected 'pkg.module:function'"),
])
def test_bad_specs_are_one_line_config_errors(spec, message):
    with pytest.raises(ConfigError) as e:
        resolve_tool(spec)
    assert str(e.value) == message and "\n" not in str(e.value)


def test_duplicate_names_are_refused():
    with pytest.raises(ConfigError) as e:
        resolve_tools(["calculator", "test_tools_registry:ALSO_CALCULATOR"])
    assert str(e.value) == ("tools 'calculator' and 'test_tools_registry:ALSO_CALCULATOR' both define a tool "
                            "named 'calculator'; remove one of them")


def test_tool_definition_is_checked():
    with pytest.raises(ValueError, match="must match"):
        Tool("has space", "", {"type": "object"}, lambda: "")
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", "", {"type": "array"}, lambda: "")


def test_check_arguments_accepts_matching_types():
    args = {"s": "x", "i": 3, "n": 2.5, "b": True, "a": [1], "o": {}, "maybe": None, "any": object()}
    assert check_arguments(KINDS, args) is None
    assert check_arguments(KINDS, {"n": 2}) is None  # an integer is a number
    assert check_arguments(ECHO, {"text": "hi"}) is None


@pytest.mark.parametrize("args, problem", [
    ([1], "arguments of 'echo' must be a JSON object, got array"),
    ({}, "missing required argument 'text' for 'echo'"),
    ({"text": "a", "extra": 1}, "unknown argument 'extra' for 'echo'; expected: text"),
    ({"text": 5}, "argument 'text' of 'echo' must be string, got integer"),
])
def test_check_arguments_problems(args, problem):
    assert check_arguments(ECHO, args) == problem


@pytest.mark.parametrize("key, value, got", [
    ("i", 3.0, "number"), ("i", True, "boolean"), ("n", False, "boolean"), ("n", "1", "string"),
    ("b", 1, "integer"), ("a", {}, "object"), ("o", [], "array"), ("maybe", 1, "integer"), ("s", None, "null"),
])
def test_check_arguments_json_types(key, value, got):
    want = {"i": "integer", "n": "number", "b": "boolean", "a": "array", "o": "object",
            "maybe": "string or null", "s": "string"}[key]
    assert check_arguments(KINDS, {key: value}) == f"argument '{key}' of 'kinds' must be {want}, got {got}"
