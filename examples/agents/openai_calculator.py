"""An agent written with the plain ``openai`` client and one tool, trained by rayless as it is.

The file defines ``async def agent_func(client, prompt, label, **kwargs)``; rayless hands each
episode an ``openai.AsyncOpenAI`` client bound to that episode's base URL and key on the rollout
server's OpenAI-compatible endpoint, records the exact tokens of every call and trains on them
with the reward this function returns (docs/agents.md). Nothing here is rayless's: the same
function runs against any OpenAI-compatible server (``python examples/agents/openai_calculator.py
URL MODEL`` tries it against one). Run it in training with::

    python -m learner.train_ppo ... --agent_func_path examples/agents/openai_calculator.py \\
        --tool_call_parser hermes          # the parser that reads your model's tool-call format

The task: the prompt is an arithmetic question, the label its answer. The model may call a
``calculator`` tool (an expression in, its value out) as often as it likes within four calls,
and is rewarded 1 when its final answer's last number equals the label. The calculator
evaluates numbers, + - * / ** and parentheses only (``ast``; never ``eval``): the expression is
model-written text.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import sys

import openai

MAX_CALLS = 4
SYSTEM = "Answer the question. Use the calculator tool for arithmetic. End with the final number."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of numbers, + - * / ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                "required": ["expression"],
            },
        },
    }
]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or a short error the model can read."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return found[-1] if found else None


async def agent_func(client: openai.AsyncOpenAI, prompt: str, label: str, model: str = "policy", **kwargs) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    tool_calls = 0
    answer = ""
    try:
        for _ in range(MAX_CALLS):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                tool_calls += 1
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except (ValueError, AttributeError):
                    expression = ""
                result = calculate(str(expression)) if call.function.name == "calculator" else "error: no such tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:
        pass  # the episode's length or turn limit: scored on what it has (nothing answered: 0)
    right = last_number(answer) == str(label).strip()
    return {"rewards": float(right), "extra_logs": {"tool_calls": tool_calls, "answered": bool(answer)}}


if __name__ == "__main__":  # try it against any OpenAI-compatible server: URL MODEL
    import asyncio

    url, name = sys.argv[1], sys.argv[2]
    out = asyncio.run(agent_func(openai.AsyncOpenAI(base_url=url, api_key="none"), "What is 17 * 23?", "391", name))
    print(out)
