"""A small gym-style game for ``rollout.multi_turn.environment`` (or ``rollout.server.environment``):
guess a secret number, told "higher" or "lower" after each wrong guess.

    rollout.multi_turn.environment: megarl.agents.guess_env:GuessNumberEnv

The secret is the row's ``answer`` when it is an integer in range, else drawn from the sample's key.
A turn's guess is the last integer in the assistant's text; a turn without one is told to answer with
a number. Reward 1 and done on the right guess; done with reward 0 after ``max_guesses`` wrong ones.
"""
from __future__ import annotations

import random
import re

HIGH = 16  # secrets are in [1, HIGH]
MAX_GUESSES = 4


class GuessNumberEnv:
    def __init__(self, high: int = HIGH, max_guesses: int = MAX_GUESSES):
        self.high, self.max_guesses = high, max_guesses

    def reset(self, sample: dict) -> list[dict]:
        answer = str(sample.get("answer") or "").strip()
        in_range = answer.isdigit() and 1 <= int(answer) <= self.high
        self.secret = int(answer) if in_range else random.Random(sample["key"]).randint(1, self.high)
        self.guesses = 0
        return [{"role": "user", "content": f"guess a number from 1 to {self.high} answer with the number only"}]

    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        numbers = re.findall(r"\d+", messages[-1].get("content") or "")
        if not numbers:
            return [{"role": "user", "content": "answer with a number"}], 0.0, False
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            return [], 1.0, True
        if self.guesses >= self.max_guesses:
            return [], 0.0, True
        return [{"role": "user", "content": "higher" if guess < self.secret else "lower"}], 0.0, False
