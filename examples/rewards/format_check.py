"""Format reward: 1.0 if a response is well-formed, else 0.0 (labels are not used).

Use alone, or next to a correctness reward (``--reward_func`` this file and ``--remote_rm_url``
another .py: the service sums them). Standard library only.

Well-formed means all of:
- not cut off: ``finish_reason`` is not "length" (when the service passes finish reasons);
- reasoning tags, if any, are one ``<think>...</think>`` pair that comes first;
- exactly one final answer: one ``\\boxed{...}`` or one ``Answer:`` line, after the reasoning;
- some text besides the answer is allowed, but the response is not empty.
The failed check is logged per sample in ``extra_logs`` (``format/<check>`` = 1 when it passed).
"""

from __future__ import annotations

import re

_ANSWER_LINE = re.compile(r"^\s*answer\s*:", re.IGNORECASE | re.MULTILINE)


def checks(response: str, finish_reason: str | None) -> dict[str, bool]:
    opens, closes = response.count("<think>"), response.count("</think>")
    think_ok = (opens == closes == 0) or (
        opens == closes == 1
        and response.index("<think>") < response.index("</think>")
        and response[: response.index("<think>")].strip() == ""
    )
    thought, _, after = response.rpartition("</think>")
    n_answers = after.count("\\boxed{") + len(_ANSWER_LINE.findall(after))
    in_think = thought.count("\\boxed{") + len(_ANSWER_LINE.findall(thought))
    return {
        "complete": finish_reason != "length",
        "non_empty": bool(response.strip()),
        "think_tags": think_ok,
        "one_answer": n_answers == 1 and in_think == 0,
    }


def reward_func(queries, prompts, labels, responses=None, finish_reasons=None, **kw):
    if responses is None:  # OpenRLHF passes only queries (= prompt + response) and prompts
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    finish_reasons = finish_reasons or [None] * len(responses)
    rewards, logs = [], {}
    for resp, fr in zip(responses, finish_reasons, strict=True):
        c = checks(resp, fr)
        rewards.append(float(all(c.values())))
        for name, ok in c.items():
            logs.setdefault(f"format/{name}", []).append(float(ok))
    return {"rewards": rewards, "extra_logs": logs}
