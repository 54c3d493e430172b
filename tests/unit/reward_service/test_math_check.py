"""``--reward_func math``: math-verify as the built-in checker (reward_service/builtin_rewards/math_check.py).

The hand-written cases of examples/rewards/math_exact_match.py's test, then the cases exact match
scores wrong (equal values in other forms), each checked against the exact-match file too, then the
same file through the reward service's path: the flag, the function worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from reward_service.config import BUILTIN_REWARDS, parse_config

ROOT = Path(__file__).resolve().parents[3]
PROMPT = "What is it? Answer: 42\n"  # the prompt's own "Answer:" must not count

# (response, label, expected reward): math_exact_match's hand-written cases
EXACT_CASES = [
    ("2 + 3 = 5. Answer: 5", "5", 1.0),
    ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("Answer: 0.5", "1/2", 1.0),
    ("The answer is 1,000.", 1000, 1.0),
    ("Answer: 6", "5", 0.0),
    ("I think 3, no, 4", "4", 1.0),
    ("no idea", "4", 0.0),
    ("Answer: 7", None, 0.0),
]
# equal values exact match cannot see: (response, label)
VALUE_CASES = [
    ("so x = \\boxed{\\frac{1}{2}}", "0.5"),
    ("the probability is \\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("The answer is $\\boxed{1{,}000}$.", "1000"),
    ("\\boxed{2^{10}}", "1024"),
]


def _import(path: Path, name: str):
    sys.path.insert(0, str(path.parent))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def math_check():
    return _import(Path(BUILTIN_REWARDS["math"]), "math_check")


def _rewards(module, cases):
    out = module.reward_func([PROMPT + c[0] for c in cases], [PROMPT] * len(cases), [c[1] for c in cases])
    return out["rewards"], out


def test_exact_match_cases(math_check):
    rewards, out = _rewards(math_check, EXACT_CASES)
    assert rewards == [want for _, _, want in EXACT_CASES]
    assert out["extra_logs"]["math/has_answer"][6] == 0.0 and out["extra_logs"]["math/has_label"][7] == 0.0


def test_values_exact_match_gets_wrong(math_check):
    exact = _import(ROOT / "examples/rewards/math_exact_match.py", "math_exact_match")
    assert _rewards(exact, VALUE_CASES)[0] == [0.0] * len(VALUE_CASES)  # what the built-in fixes
    assert _rewards(math_check, VALUE_CASES)[0] == [1.0] * len(VALUE_CASES)
    wrong = [("\\boxed{\\frac{1}{3}}", "0.5"), ("\\boxed{(x+1)^3}", "x^2+2x+1"), ("\\boxed{\\pi}", "3.14")]
    assert _rewards(math_check, wrong)[0] == [0.0] * 3
    assert _rewards(math_check, [("\\boxed{2}", ["3", "2"])])[0] == [1.0]  # a list of accepted answers


def test_through_the_flag_and_a_function_worker():
    from reward_service.func_reward import FunctionReward

    cfg = parse_config(["--controller", "-", "--reward_func", "math"])
    assert cfg.func_files() == [BUILTIN_REWARDS["math"]]
    fr = FunctionReward(cfg.func_files()[0], timeout_s=60)
    try:
        cases = EXACT_CASES[:3] + [(r, lab, 1.0) for r, lab in VALUE_CASES[:2]]
        res = fr([PROMPT + r for r, _, _ in cases], [PROMPT] * len(cases), [lab for _, lab, _ in cases])
    finally:
        fr.close()
    assert res.failed == [None] * len(cases) and res.rewards == [want for _, _, want in cases]


def test_an_unknown_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--controller", "-", "--reward_func", "maths"])
    assert e.value.code == 2 and "neither a .py file nor a built-in (math)" in capsys.readouterr().err
