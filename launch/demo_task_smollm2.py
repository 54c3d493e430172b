"""The SmolLM2 demo's task: two-number addition with a 3-shot prompt, first-integer reward.

SmolLM2-135M-Instruct knows some arithmetic but not the format of a tiny task: zero-shot it
restates the question and spends its tokens. A 3-shot prefix (``3+4=7\\n10+5=15\\n21+6=27\\n``)
puts it at about 60% greedy (measured, docs/smollm2.md), with most groups of 8 samples mixed
right and wrong — the regime where GRPO has signal. The reward reads the first integer of the
response, so text after the answer (the model goes on with the next shot) does not matter.

Held-out prompts are pairs never trained on, as in the tiny demo.
"""

from __future__ import annotations

import random
import re

import torch

SHOTS = "3+4=7\n10+5=15\n21+6=27\n"
_INT = re.compile(r"-?\d+")


def problems(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(30) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    rows = [{"input": f"{SHOTS}{a}+{b}=", "label": str(a + b)} for a, b in pairs]
    n_eval = int(len(rows) * eval_fraction)
    return rows[n_eval:], rows[:n_eval]


def first_int(text: str) -> str | None:
    m = _INT.search(text)
    return m.group(0) if m else None


def reward_func(queries, prompts, labels, **kwargs):
    """1.0 when the first integer of the response equals the label, else 0.0."""
    rewards = [
        1.0 if first_int(q[len(p) :] if q.startswith(p) else q) == str(lab) else 0.0
        for q, p, lab in zip(queries, prompts, labels, strict=True)
    ]
    t = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": t, "scores": t, "extra_logs": {"accuracy": t}}
