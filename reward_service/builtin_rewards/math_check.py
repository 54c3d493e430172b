"""``--reward_func math``: 1.0 when the response's final answer equals the label, by math-verify.

`math-verify <https://github.com/huggingface/Math-Verify>`_ parses both sides (LaTeX or plain
expressions) into sympy objects and compares them by value, so ``\\frac{1}{2}``, ``0.5`` and
``50\\%`` match, as do ``(x+1)^2`` and ``x^2+2x+1``, ``1{,}000`` and ``1000``, intervals, sets and
matrices; exact match (``examples/rewards/math_exact_match.py``) compares normalised strings and
plain numbers only. The answer is taken from the response as math-verify does: a ``\\boxed{}``
first, else the last LaTeX or plain expression (``Answer: 42`` too). A label may be a list of
accepted answers; a sample without a label scores 0. Parsing and comparing are each cut off after
``TIMEOUT_S`` (math-verify's own SIGALRM timer, in the worker's main thread): a pathological
expression scores 0 instead of hanging the worker.

``extra_logs``: ``math/has_answer`` (something was extracted), ``math/has_label``.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

TIMEOUT_S = 5


def _timeout() -> int | None:
    # math-verify's timer is signal.alarm, which only the main thread may set (the function
    # workers call reward_func there; an in-process caller on another thread gets no timer)
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_label(label) -> list:
    """The label's parsed forms: LaTeX read in math mode first (``\\frac{1}{2}``, ``x^2+1``), else as text."""
    t = _timeout() or 0
    text = str(label).strip()
    return parse(f"${text}$", parsing_timeout=t) or parse(text, parsing_timeout=t)


def is_correct(response: str, label) -> tuple[bool, bool]:
    """(answer found, answer equals one of the label's answers)."""
    t = _timeout()
    answer = parse(response, parsing_timeout=t or 0)
    if not answer:
        return False, False
    labels = label if isinstance(label, (list, tuple)) else [label]
    return True, any(verify(parse_label(lab), answer, timeout_seconds=t) for lab in labels if lab is not None)


def reward_func(queries, prompts, labels, responses=None, **kw):
    if responses is None:  # OpenRLHF passes only queries (= prompt + response) and prompts
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    rewards, has_answer, has_label = [], [], []
    for resp, label in zip(responses, labels, strict=True):
        found, ok = is_correct(resp, label) if label is not None else (bool(parse(resp)), False)
        has_answer.append(float(found))
        has_label.append(float(label is not None))
        rewards.append(float(ok))
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {"math/has_answer": has_answer, "math/has_label": has_label},
    }
