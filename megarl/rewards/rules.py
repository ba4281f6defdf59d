"""Rule-based format reward."""
from __future__ import annotations

import re
from typing import Sequence

# A final answer is present: \boxed{<something>} or '#### <number>'.
DEFAULT_FORMAT_PATTERN = r"\\boxed\{[^{}\s][^\n]*\}|####[ \t]*-?\$?\d[\d,]*(?:\.\d+)?"


def format_reward(response_text: str, pattern: str | Sequence[str] = DEFAULT_FORMAT_PATTERN) -> float:
    """Fraction of the regex `pattern`s found in the response (re.search, DOTALL).

    One pattern gives 0/1; a list gives partial credit, e.g.
    [r"<think>.*</think>", r"\\boxed\\{.+\\}"] scores 0.5 when only one is present.
    """
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    if not patterns:
        raise ValueError("format_reward needs at least one pattern")
    found = sum(re.search(p, response_text, flags=re.DOTALL) is not None for p in patterns)
    return found / len(patterns)
