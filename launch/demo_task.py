"""The demo's task: reverse a string of digits, with an exact-match reward.

Prompts look like ``"4721>"`` and the answer is the digits reversed (``"1274"``) followed by
the end token. Each digit is one token (Qwen2's pre-tokenizer splits numbers digit by digit),
so the task is a pure position-to-position copy that a 2-layer model can learn *as an
algorithm*: accuracy on held-out strings (never trained on) follows accuracy on training
strings, which is what lets the demo show generalisation, not recall. A short SFT warm start
teaches the format and part of the copy; GRPO has room to raise accuracy within minutes on 2
CPU cores.

``reward_func`` follows OpenRLHF's function-reward contract, so the reward service loads this
very file with ``--reward_func launch/demo_task.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

DIGITS = 4
N_TRAIN, N_EVAL = 1000, 200


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets of distinct digit strings."""
    rng = random.Random(seed)
    strings = rng.sample(range(10**DIGITS), N_TRAIN + N_EVAL)
    rows = [{"input": f"{s:0{DIGITS}d}>", "label": f"{s:0{DIGITS}d}"[::-1]} for s in strings]
    return rows[:N_TRAIN], rows[N_TRAIN:]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def score(response: str, label: str) -> float:
    return 1.0 if response.strip() == str(label) else 0.0


def reward_func(queries, prompts, labels, **kwargs):
    """1.0 when the response (query minus prompt) is exactly the reversed string, else 0.0."""
    rewards = [
        score(q[len(p) :] if q.startswith(p) else q, lab) for q, p, lab in zip(queries, prompts, labels, strict=True)
    ]
    t = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": t, "scores": t, "extra_logs": {"accuracy": t}}
