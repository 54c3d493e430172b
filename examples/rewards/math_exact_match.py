"""Exact-match reward for math answers: 1.0 if the response's final answer equals the label.

Use: ``python -m reward_service --controller ... --reward_func examples/rewards/math_exact_match.py``
(or OpenRLHF's ``--remote_rm_url examples/rewards/math_exact_match.py``; standard library only).

The final answer is, in this order of preference, taken from the response:
1. the last ``\\boxed{...}`` (nested braces allowed);
2. the text after the last ``Answer:`` / ``answer is`` (to the end of that line);
3. the last number in the response.
Both sides are normalised (spaces, ``$``, a trailing period, thousands separators dropped;
case ignored); numbers (``0.5``, ``1/2``, ``-3``) compare by value. A label may be a list of
accepted answers. A sample without a label scores 0 and is counted in ``extra_logs``.
"""

from __future__ import annotations

import re
from fractions import Fraction

_ANSWER_RE = re.compile(r"(?:answer\s*:|answer\s+is\s*:?)\s*(.*)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def extract_answer(response: str) -> str | None:
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_RE.finditer(response))
    if matches:
        return matches[-1].group(1).splitlines()[0] if matches[-1].group(1) else None
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


def normalize(ans) -> str:
    s = str(ans).strip().strip("$").strip()
    s = s.rstrip(".").replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.lower()


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def is_equal(answer: str, label) -> bool:
    labels = label if isinstance(label, (list, tuple)) else [label]
    a = normalize(answer)
    for lab in labels:
        b = normalize(lab)
        x, y = _as_number(a), _as_number(b)
        if x is not None and y is not None:
            if x == y:
                return True
        elif a == b:
            return True
    return False


def reward_func(queries, prompts, labels, responses=None, **kw):
    if responses is None:  # OpenRLHF passes only queries (= prompt + response) and prompts
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    rewards, has_answer, has_label = [], [], []
    for resp, label in zip(responses, labels, strict=True):
        answer = extract_answer(resp)
        has_answer.append(float(answer is not None))
        has_label.append(float(label is not None))
        rewards.append(float(answer is not None and label is not None and is_equal(answer, label)))
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {"math/has_answer": has_answer, "math/has_label": has_label},
    }
