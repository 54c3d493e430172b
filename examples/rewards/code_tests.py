"""Code reward: the response's Python program is run against the task's tests in the sandbox;
the reward is the fraction of tests it passes.

Use: ``python -m reward_service --controller ... --reward_func examples/rewards/code_tests.py
--sandbox_workers 8`` (or OpenRLHF's ``--remote_rm_url examples/rewards/code_tests.py``). The code
runs in ``common.sandbox`` (docs/environments.md): a fresh process per test, no network, its own
directory, CPU / memory / process / output limits, killed whole at its deadline; a hostile or broken
program scores 0 on the tests it breaks, never harms the service. Needs rayless installed (the
sandbox is ``common.sandbox``).

The program is the last fenced ```` ```python ```` block of the response (```` ```py ```` and a
bare ```` ``` ```` fence too); a response without one scores 0. The label holds the tests, as a
dict or its JSON text:

- stdin/stdout tests (APPS, CodeContests, TACO): ``{"tests": [{"input": "1 2\\n", "output": "3\\n"},
  ...]}``, or APPS's ``{"inputs": [...], "outputs": [...]}``; a test passes when the program exits
  0 and its stdout equals the output line by line, trailing spaces and blank lines ignored;
- assertion tests (MBPP, HumanEval): ``{"asserts": ["assert add(1, 2) == 3", ...], "setup":
  "import math"}``; each assertion runs after the program (and ``setup``), in a fresh sandbox; it
  passes when that exits 0;
- optional ``"timeout_s"``: the wall-time limit of one test (default ``TEST_TIMEOUT_S``).

A label that is none of these raises ``ValueError`` naming the sample and what is wrong (the
service fails that call's samples with the message). ``extra_logs``: ``code/has_code`` (a block
was found), ``code/all_passed``, ``code/timeouts`` (share of its tests that ran out of time).
"""

from __future__ import annotations

import json
import re

from common.sandbox import Sandbox, SandboxLimits

TEST_TIMEOUT_S = 6.0  # one test's wall time; a test's CPU time is capped at the same
MEMORY_MB = 1024

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_sandbox: Sandbox | None = None


def sandbox() -> Sandbox:
    """One sandbox per worker process, made at the first call (``--sandbox_workers`` warm workers)."""
    global _sandbox
    if _sandbox is None:
        _sandbox = Sandbox.from_env(
            limits=SandboxLimits(wall_s=TEST_TIMEOUT_S, cpu_s=TEST_TIMEOUT_S, memory_mb=MEMORY_MB)
        )
    return _sandbox


def extract_code(response: str) -> str | None:
    """The last fenced Python block (a bare fence counts); None when there is none."""
    blocks = [(lang, body) for lang, body in _FENCE.findall(response)]
    tagged = [body for lang, body in blocks if lang]
    if tagged:
        return tagged[-1]
    return blocks[-1][1] if blocks else None


def parse_tests(label, i: int) -> tuple[list[tuple[str, str, str | None]], float]:
    """``label`` -> ([(code suffix, stdin, expected stdout or None)], timeout); raises ValueError."""
    where = f"code_tests.py: label of sample {i}"
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is a string but not JSON ({e})") from None
    if isinstance(label, list):
        label = {"tests": label}
    if not isinstance(label, dict):
        raise ValueError(
            f"{where} must be a dict with 'tests', 'inputs'/'outputs' or 'asserts', got {type(label).__name__}"
        )
    timeout = label.get("timeout_s", TEST_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"{where}: 'timeout_s' must be a number > 0, got {timeout!r}")
    tests: list[tuple[str, str, str | None]] = []
    if "tests" in label:
        for j, t in enumerate(label["tests"]):
            if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
                raise ValueError(f"{where}: tests[{j}] must be {{'input': str, 'output': str}}, got {t!r:.80}")
            tests.append(("", t["input"], t["output"]))
    elif "inputs" in label or "outputs" in label:
        ins, outs = label.get("inputs"), label.get("outputs")
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists of the same length")
        for j, (a, b) in enumerate(zip(ins, outs, strict=True)):
            if not isinstance(a, str) or not isinstance(b, str):
                raise ValueError(f"{where}: inputs[{j}] / outputs[{j}] must be strings")
            tests.append(("", a, b))
    elif "asserts" in label:
        setup = label.get("setup", "")
        if not isinstance(setup, str) or not isinstance(label["asserts"], list):
            raise ValueError(f"{where}: 'asserts' must be a list of strings and 'setup' a string")
        for j, a in enumerate(label["asserts"]):
            if not isinstance(a, str):
                raise ValueError(f"{where}: asserts[{j}] must be a string, got {type(a).__name__}")
            tests.append((f"\n{setup}\n{a}\n", "", None))
    else:
        raise ValueError(f"{where} has none of 'tests', 'inputs'/'outputs', 'asserts' (keys: {sorted(label)})")
    if not tests:
        raise ValueError(f"{where} holds no tests")
    return tests, float(timeout)


def same_output(got: str, want: str) -> bool:
    def lines(s: str) -> list[str]:
        out = [line.rstrip() for line in s.strip("\n").splitlines()]
        return out

    return lines(got) == lines(want)


def reward_func(queries, prompts, labels, responses=None, **kw):
    if responses is None:  # OpenRLHF passes only queries (= prompt + response) and prompts
        responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    parsed = [parse_tests(label, i) for i, label in enumerate(labels)]  # every label checked first
    codes = [extract_code(r) for r in responses]
    jobs = []  # (sample, code, stdin, expected, timeout)
    for i, (code, (tests, timeout)) in enumerate(zip(codes, parsed, strict=True)):
        if code is not None:
            jobs += [(i, code + suffix, stdin, want, timeout) for suffix, stdin, want in tests]
    results = []
    if jobs:
        sb = sandbox()
        limits = {t: sb.limits.replace(wall_s=t, cpu_s=t) for t in {job[4] for job in jobs}}
        results = sb.run_many_sync([(code, stdin, limits[t]) for _, code, stdin, _, t in jobs])
    passed = [0] * len(responses)
    timeouts = [0] * len(responses)
    for (i, _, _, want, _), r in zip(jobs, results, strict=True):
        ok = r.ok and (want is None or same_output(r.stdout, want))
        passed[i] += ok
        timeouts[i] += r.reason in ("timeout", "cpu_time")
    n_tests = [len(tests) for tests, _ in parsed]
    rewards = [p / n for p, n in zip(passed, n_tests, strict=True)]
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {
            "code/has_code": [float(c is not None) for c in codes],
            "code/all_passed": [float(p == n) for p, n in zip(passed, n_tests, strict=True)],
            "code/timeouts": [t / n for t, n in zip(timeouts, n_tests, strict=True)],
        },
    }
