"""The tiny tool task as a plain-Python agent: the official ``openai`` client, the calculator as an
OpenAI tool (``yaml/tiny_agent_http.yaml``).

    rollout.server.agent: megarl.agents.calculator_http:solve

The agent sends the dataset row's messages with the calculator's schema, runs each tool call the
model makes with :func:`megarl.tools.calculator.calculate` and sends the result back as a ``tool``
message, for at most ``MAX_TURNS`` model turns. It returns nothing: the run's reward terms score the
last assistant turn (``reward.terms: math``), as for the in-engine agent loop of
``yaml/tiny_tools.yaml``.
"""
from __future__ import annotations

import json

from openai import BadRequestError, OpenAI

from megarl.tools.calculator import calculate

MAX_TURNS = 2  # a call and the answer, as rollout.multi_turn.max_turns in yaml/tiny_tools.yaml
MODEL = "megarl-policy"  # rollout.server.model_name's default
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def run_tool(name: str, arguments: str) -> str:
    """The calculator's answer to one call, or a one-line error the model sees."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        return calculate(str(json.loads(arguments)["expression"]))
    except Exception as e:  # noqa: BLE001 - the model reads the error as the tool's output
        return f"error: {e}"


_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="local", max_retries=0, timeout=120)


def solve(sample: dict, base_url: str) -> None:
    client = _CLIENT.with_options(base_url=base_url)  # one connection pool for every sample
    messages = list(sample["messages"])
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        except BadRequestError as e:
            if e.code == "context_length_exceeded":  # the sample's token budget is spent: it ends here
                return None
            raise
        message = reply.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return None
