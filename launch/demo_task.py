"""The demo's task: small-number addition, with an exact-match reward.

Prompts look like ``"12+7="`` and the answer is the number (``"19"``) followed by the end
token. The problem set is split by *pair*, so held-out accuracy measures arithmetic the
model was never shown, not recall. A tiny model learns the format and some sums from a short
SFT warm start; GRPO then has room to raise accuracy within minutes on 2 CPU cores.

``reward_func`` follows OpenRLHF's function-reward contract, so the reward service loads this
very file with ``--reward_func launch/demo_task.py``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

MAX_A, MAX_B = 30, 10  # a in [0, 30), b in [0, 10): 300 problems


def problems(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(MAX_A) for b in range(MAX_B)]
    random.Random(seed).shuffle(pairs)
    n_eval = int(len(pairs) * eval_fraction)
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a, b in pairs]
    return rows[n_eval:], rows[:n_eval]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


_NUM = re.compile(r"-?\d+")


def answer_of(text: str) -> str | None:
    m = _NUM.match(text.strip())
    return m.group(0) if m else None


def reward_func(queries, prompts, labels, **kwargs):
    """1.0 when the response (query minus prompt) starts with the right number, else 0.0."""
    rewards = []
    for q, p, lab in zip(queries, prompts, labels):
        response = q[len(p):] if q.startswith(p) else q
        rewards.append(1.0 if answer_of(response) == str(lab) else 0.0)
    t = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": t, "scores": t, "extra_logs": {"accuracy": t}}
