"""The OpenAI-client agent demo's task (``make demo TASK=agent-openai``): arithmetic with a tool.

Each prompt is a question such as ``"What is 47 * 23?"`` (two 2-digit numbers whose product has
four digits), its label the value. The agent is ``examples/agents/openai_calculator.py`` as it is: written with
the plain ``openai`` client, it offers a ``calculator`` tool, runs the model's tool call and
sends the value back, and rewards 1 when the final answer's last number is the label. The tiny
model cannot multiply; what it can learn is to call the tool with the question's expression and
to answer with the value the tool returned. (Products of four digits: every question and every
value has the same length, which a model this small copies far more easily than text whose
length varies.)

``sft_rows`` is the warm start: whole conversations (system, question, the tool call in the
hermes format ``--tool_call_parser hermes`` reads, the tool's value, the answer) rendered by the
model's chat template, as the endpoint renders them (``learner.train_sft --apply_chat_template``
learns both assistant turns).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

from launch.demo_task import write_jsonl  # noqa: F401 - the demo writes the task's files with it

AGENT_FILE = Path(__file__).resolve().parents[1] / "examples" / "agents" / "openai_calculator.py"


def _agent_module():
    """The agent file (not a package) loaded by its path: its system prompt, tools and calculator."""
    spec = importlib.util.spec_from_file_location("rayless_demo_openai_calculator", AGENT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_AGENT = _agent_module()
SYSTEM, TOOLS, calculate = _AGENT.SYSTEM, _AGENT.TOOLS, _AGENT.calculate


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def problems(seed: int, n_train: int = 2000, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """Train and held-out questions (no pair in both), as ``{"input", "label"}`` rows."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a * b >= 1000]
    chosen = random.Random(seed).sample(pairs, n_train + n_eval)
    rows = [{"input": question(a, b), "label": calculate(f"{a} * {b}")} for a, b in chosen]
    return rows[:n_train], rows[n_train:]


def tool_call(expression: str) -> str:
    """The assistant's tool call as the hermes parser reads it (``<tool_call>{json}</tool_call>``)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def sft_rows(rows: list[dict]) -> list[dict]:
    """The warm start's conversations (``{"messages": [...]}``), one per question."""
    out = []
    for row in rows:
        expression = row["input"].removeprefix("What is ").removesuffix("?")
        out.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": row["input"]},
                    {"role": "assistant", "content": tool_call(expression)},
                    {"role": "tool", "content": row["label"]},
                    {"role": "assistant", "content": row["label"]},
                ]
            }
        )
    return out
