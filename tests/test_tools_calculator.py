"""The calculator is exact, follows Python's arithmetic, refuses anything else, and bounds its work."""
import time

import pytest

from megarl.tools.calculator import MAX_DIGITS, calculate, calculator

TOO_LONG = f"error: integer would exceed {MAX_DIGITS} digits"


@pytest.mark.parametrize("expression, value", [
    ("1+2*3", "7"), ("(1+2)*3", "9"), ("2**100", "1267650600228229401496703205376"),
    ("7/2", "3.5"), ("1/3", "0.3333333333333333"), ("7//2", "3"), ("-7//2", "-4"), ("-7 % 3", "2"),
    ("-2**2", "-4"), ("2**-1", "0.5"), ("+-+3", "-3"), ("0.1+0.2", "0.30000000000000004"),
    ("1e3", "1000.0"), (" 10 - 2 - 3 ", "5"), ("2**3**2", "512"), ("10**999", "1" + "0" * 999), ("10**999*9", "9" + "0" * 999),
    ("(-1)**(10**50)", "1"), ("4.0//1.5", "2.0"), ("123456789*987654321", "121932631112635269"),
])
def test_values_are_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1/0", "error: division by zero"), ("5 % 0", "error: division by zero"), ("0**-1", "error: division by zero"),
    ("10**1000", TOO_LONG),
    ("9**9**9", TOO_LONG),
    ("(10**999)*(10**999)", TOO_LONG),
    ("1" * 1001, TOO_LONG), ("-(10**999)*10", TOO_LONG), ("10**999*9+10**999", TOO_LONG),
    ("2.0**5000", "error: result too large"), ("1e308*10", "error: result is not finite"),
    ("(-8)**0.5", "error: result is not a real number"),
    ("x+1", "error: unsupported element 'Name'; use numbers, + - * / // % ** and parentheses"),
    ("__import__('os')", "error: unsupported element 'Call'; use numbers, + - * / // % ** and parentheses"),
    ("1<<3", "error: unsupported element 'LShift'; use numbers, + - * / // % ** and parentheses"),
    ("True+1", "error: unsupported element 'Constant'; use numbers, + - * / // % ** and parentheses"),
    ("'a'*3", "error: unsupported element 'Constant'; use numbers, + - * / // % ** and parentheses"),
    ("1+", "error: invalid expression (invalid syntax)"),
    ("1" + "+1" * 1000, "error: expression longer than 2000 characters"),
])
def test_errors_are_strings(expression, error):
    assert calculate(expression) == error


def test_huge_work_is_refused_fast():
    start = time.monotonic()
    for expression in ["9**9**9**9", "(10**900)**(10**900)", "2**(10**100)", "(-3)**(2**64)"]:
        assert calculate(expression).startswith("error: ")
    assert time.monotonic() - start < 0.5


def test_tool_definition():
    assert calculator.fn(expression="6*7") == "42"
    assert calculator.schema()["function"]["parameters"]["required"] == ["expression"]
