"""Answer extraction, normalization, math and format rewards."""
import pytest

from megarl.rewards.math_answer import extract_answer, math_answer_reward, normalize_answer
from megarl.rewards.rules import format_reward


@pytest.mark.parametrize(
    "text, strategy, expected",
    [
        (r"so \boxed{\frac{1}{2}} done", "boxed", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{1} then \boxed{ {2}+{3} }", "boxed", "{2}+{3}"),  # the last box, stripped
        (r"\boxed{3", "boxed", None),  # unbalanced
        (r"\boxed{3", "auto", "3"),  # falls back to the last number
        ("step 1\n#### 1,234\n", "hash", "1,234"),
        ("#### 42.", "hash", "42"),  # trailing period dropped
        ("We get 3, 4 and -12.5.", "last_number", "-12.5"),
        ("total 1,000,000 apples", "last_number", "1,000,000"),
        (r"#### 3 but \boxed{4}", "auto", "4"),  # boxed is tried first
        (r"\boxed{4} #### 3", "hash", "3"),
        ("I don't know", "auto", None),
    ],
)
def test_extract_answer(text, strategy, expected):
    assert extract_answer(text, strategy) == expected


def test_unknown_strategy():
    with pytest.raises(ValueError, match="available: boxed, hash, last_number, auto"):
        extract_answer("1", "first")


def test_normalize():
    assert normalize_answer(r"\$1,234.") == "1234"
    assert normalize_answer(r"\left( \dfrac{1}{2} \right)") == r"(\frac{1}{2})"
    assert normalize_answer(r"45^\circ") == "45"
    assert normalize_answer(r"\text{ 7 } ") == "7"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
        ("... #### 1,234", "1234", 1.0),  # commas
        ("#### -5", "-5", 1.0),  # negative
        (r"\boxed{-5.0}", "-5", 1.0),  # trailing .0, compared as numbers
        ("#### 5", "-5", 0.0),
        (r"\boxed{\$18}", "18", 1.0),
        ("costs $18.00 total", "18", 1.0),  # last number
        ("No idea.", "3", 0.0),  # no answer
        ("#### 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0),  # truth given as a solution
    ],
)
def test_math_answer_reward(response, truth, expected):
    assert math_answer_reward(response, truth) == expected


def test_strategy_restricts_extraction():
    assert math_answer_reward("#### 5", "5", strategy="boxed") == 0.0
    assert math_answer_reward("#### 5", "5", strategy="hash") == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [(r"\boxed{5}", 1.0), ("#### 42", 1.0), (r"\boxed{\frac{1}{2}}", 1.0), ("the answer is 5", 0.0), (r"\boxed{}", 0.0)],
)
def test_format_default(text, expected):
    assert format_reward(text) == expected


def test_format_partial_credit():
    """Two patterns, one present: 1/2."""
    patterns = [r"<think>.*</think>", r"\\boxed\{.+\}"]
    assert format_reward("<think>\nhmm\n</think> 5", patterns) == 0.5
    assert format_reward(r"<think>a</think> \boxed{5}", patterns) == 1.0
