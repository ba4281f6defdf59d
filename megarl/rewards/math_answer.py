"""Final-answer extraction and comparison for math problems.

Strategies for `extract_answer`:
    boxed        content of the last \\boxed{...} (nested braces allowed)
    hash         what follows the last '####' on its line (GSM8K)
    last_number  the last number in the text (1,234 / -3 / 2.5)
    auto         the first of boxed, hash, last_number that finds something
"""
from __future__ import annotations

import re

STRATEGIES = ("boxed", "hash", "last_number", "auto")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_LATEX_NOISE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\$", "$", r"^\circ", r"^{\circ}", r"\%", "%")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, matching nested braces; None if absent or unbalanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def extract_hash(text: str) -> str | None:
    """Rest of the line after the last '####', without a trailing period; None if absent/empty."""
    found = _HASH.findall(text)
    if not found:
        return None
    answer = found[-1].strip().rstrip(".").strip()
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last number in text, thousands commas kept (normalize removes them)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, strategy: str = "auto") -> str | None:
    """The final answer in text by `strategy` (see the module docstring), or None."""
    extractors = {"boxed": extract_boxed, "hash": extract_hash, "last_number": extract_last_number}
    if strategy == "auto":
        for fn in extractors.values():
            answer = fn(text)
            if answer is not None:
                return answer
        return None
    if strategy not in extractors:
        raise ValueError(f"unknown answer strategy {strategy!r}; available: {', '.join(STRATEGIES)}")
    return extractors[strategy](text)


def normalize_answer(answer: str) -> str:
    """Strip spaces, '$', LaTeX spacing/\\left/\\right, degree and percent signs,
    '\\text{...}' wrappers, thousands commas and a trailing period; dfrac/tfrac -> frac."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", answer)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return s.rstrip(".")


def _as_number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def answers_match(predicted: str, truth: str, rel_tol: float = 1e-9) -> bool:
    """Equal after normalize_answer; numerically when both parse as numbers ("5.0" == "5")."""
    p, t = normalize_answer(predicted), normalize_answer(truth)
    pn, tn = _as_number(p), _as_number(t)
    if pn is not None and tn is not None:
        return abs(pn - tn) <= rel_tol * max(1.0, abs(tn))
    return p == t


def ground_truth_answer(ground_truth: str) -> str:
    """The answer inside a ground truth given as a solution (\\boxed or ####), else itself."""
    for fn in (extract_boxed, extract_hash):
        answer = fn(ground_truth)
        if answer is not None:
            return answer
    return ground_truth


def math_answer_reward(response_text: str, ground_truth: str, strategy: str = "auto") -> float:
    """1.0 when the answer extracted from the response matches the ground truth, else 0.0."""
    predicted = extract_answer(response_text, strategy)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, ground_truth_answer(ground_truth)) else 0.0
