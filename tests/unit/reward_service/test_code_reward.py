"""examples/rewards/code_tests.py through the reward service's function-worker path (no vLLM):
the response's program runs against the label's tests in common.sandbox; reward = pass fraction."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from reward_service.func_reward import FunctionReward

ROOT = Path(__file__).resolve().parents[3]
CODE = str(ROOT / "examples/rewards/code_tests.py")
PROMPT = "Write a program that reads two integers and prints their sum.\n"
ADD_TESTS = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}], "timeout_s": 1.5}


def fenced(code: str, lang: str = "python") -> str:
    return f"Here it is:\n```{lang}\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def code_reward():
    fr = FunctionReward(CODE, timeout_s=60, env={"RAYLESS_SANDBOX_WORKERS": "2"})
    yield fr
    fr.close()


def test_extract_code_takes_the_last_python_block():
    sys.path.insert(0, str(ROOT / "examples/rewards"))
    try:
        import code_tests as ct
    finally:
        sys.path.pop(0)
    assert ct.extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert ct.extract_code("```\nc = 3\n```") == "c = 3\n"  # a bare fence
    assert ct.extract_code("```python\nd = 4\n```\n```\nnot code\n```") == "d = 4\n"  # a tagged block wins
    assert ct.extract_code("no code here") is None
    assert ct.same_output("3  \n\n", "3") and not ct.same_output("3\n4", "3")


def test_pass_fraction_through_a_function_worker(code_reward):
    asserts = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]})
    cases = [  # (response, label, expected reward)
        (fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD_TESTS, 1.0),
        (fenced("a, b = map(int, input().split())\nprint(3)"), ADD_TESTS, 0.5),  # right on the first test only
        ("The sum is a + b.", ADD_TESTS, 0.0),  # no code
        (fenced("while True:\n    pass"), ADD_TESTS, 0.0),  # killed at the test's limit
        (fenced("import os\nwhile True:\n    os.fork()"), ADD_TESTS, 0.0),  # a fork bomb
        (fenced("import socket\nsocket.create_connection(('127.0.0.1', 22))"), ADD_TESTS, 0.0),
        (fenced("def add(a, b):\n    return a + b", "py"), asserts, 2 / 3),  # MBPP-style, label as JSON text
        (fenced("print(int(input()) * 2)"), {"inputs": ["4\n"], "outputs": ["8\n"]}, 1.0),  # APPS-style
    ]
    res = code_reward([PROMPT + r for r, _, _ in cases], [PROMPT] * len(cases), [lab for _, lab, _ in cases])
    assert res.failed == [None] * len(cases)
    assert res.rewards == pytest.approx([want for _, _, want in cases])
    assert res.extra_logs["code/has_code"][2] == 0.0 and res.extra_logs["code/timeouts"][3] == 1.0
    assert res.extra_logs["code/all_passed"][:2] == [1.0, 0.0]


def test_a_malformed_label_fails_its_call_naming_the_sample(code_reward):
    labels = [ADD_TESTS, {"tests": [{"input": "1"}]}]
    res = code_reward([PROMPT + fenced("print(3)")] * 2, [PROMPT] * 2, labels)
    assert all(math.isnan(r) for r in res.rewards)
    assert "label of sample 1: tests[0] must be {'input': str, 'output': str}" in res.failed[0]
