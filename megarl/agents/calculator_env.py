"""The tiny tool task as a gym-style environment (``rollout.server.environment``): the calculator runs
inside ``step``, and the episode ends with reward 1 when the last assistant turn states the product."""
from __future__ import annotations

from megarl.agents.calculator_http import run_tool
from megarl.rewards import math_answer_reward


class CalculatorEnv:
    def reset(self, sample: dict) -> list[dict]:
        self.answer = sample["answer"]
        return list(sample["messages"])

    def step(self, messages: list[dict]) -> tuple[list[dict], float, bool]:
        last = messages[-1]
        calls = last.get("tool_calls") or []
        if calls:
            return [{"role": "tool", "tool_call_id": c["id"],
                     "content": run_tool(c["function"]["name"], c["function"]["arguments"])} for c in calls], 0.0, False
        return [], math_answer_reward(last.get("content") or "", self.answer), True
