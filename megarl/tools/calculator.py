"""The ``calculator`` tool: exact arithmetic on one expression, without eval.

Spec: ``{"expression": string}`` -> the value as a string; ints are exact
(``"2**100"`` -> ``"1267650600228229401496703205376"``), floats are ``repr``
(``"1/3"`` -> ``"0.3333333333333333"``). Python semantics: ``/`` is true division,
``//`` and ``%`` floor, ``-2**2 == -4``.

Grammar (an ``ast`` walk, nothing else is accepted): int and float literals,
``+ - * / // % **``, unary ``+ -``, parentheses.

Threat model: the expression is model text. Work is bounded before it is done:
at most ``MAX_CHARS`` characters, every integer (literal, operand and result) at
most ``MAX_DIGITS`` decimal digits, products and powers whose result would be
longer are refused before computing; floats must stay finite and real. Every
problem comes back as a string starting with ``"error: "``; nothing raises.
"""
from __future__ import annotations

import ast
import math
import operator

from megarl.tools.registry import Tool, one_line

MAX_DIGITS = 1000
MAX_CHARS = 2000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))  # an int of <= 1000 digits has <= 3322 bits
_LIMIT = 10**MAX_DIGITS  # the exact bound, checked on every int once computed
_TOO_LONG = f"integer would exceed {MAX_DIGITS} digits"
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """A problem with the expression; its message is shown to the model after 'error: '."""


def _too_big(bits: float) -> bool:
    return bits > _MAX_BITS + 1  # a cheap pre-check; _checked applies the exact bound


def _check_size(a, b, op) -> None:
    """Refuses int products and powers whose result would exceed MAX_DIGITS, before computing."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return
    if op is ast.Mult and _too_big(a.bit_length() + b.bit_length() - 1):
        raise CalcError(_TOO_LONG)
    if op is ast.Pow and b > 0 and abs(a) > 1 and _too_big(b * math.log2(abs(a))):
        raise CalcError(_TOO_LONG)


def _checked(value):
    if isinstance(value, complex):
        raise CalcError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not finite")
    if isinstance(value, int) and abs(value) >= _LIMIT:
        raise CalcError(_TOO_LONG)
    return value


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        _check_size(a, b, type(node.op))
        return _checked(_BINARY[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    shown = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalcError(f"unsupported element '{shown}'; use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; raises CalcError (or ZeroDivisionError/OverflowError)."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"invalid expression ({e.msg})") from e
    return _eval(tree)


def calculate(expression: str) -> str:
    """The calculator tool's fn: the value as a string, or ``"error: ..."``."""
    try:
        value = evaluate(expression)
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    except (CalcError, ValueError, RecursionError, MemoryError) as e:
        return f"error: {one_line(e) or type(e).__name__}"
    return repr(value) if isinstance(value, float) else str(value)


calculator = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2**10 / 7"}},
        "required": ["expression"],
    },
    fn=calculate,
)
