"""Function and remote HTTP rewards, in-process (Scorer) but through the real worker
processes and a real HTTP server: results, per-sample failures with reasons, deadlines."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.protocol import SampleBatch, ScoreRequest
from reward_service.config import parse_config
from reward_service.func_reward import FuncLoadError, FunctionReward
from reward_service.remote import RemoteReward
from reward_service.results import from_raw
from reward_service.scorer import Scorer, TextSource

ROOT = Path(__file__).resolve().parents[3]
MATH = str(ROOT / "examples/rewards/math_exact_match.py")
FORMAT = str(ROOT / "examples/rewards/format_check.py")
FAULTY = str(ROOT / "tests/helpers/reward_faulty.py")
HTTP_SERVER = str(ROOT / "tests/helpers/reward_http_server.py")


def request(prompts, responses, labels=None, finish_reasons=None):
    """A ScoreRequest carrying text only (prompt / response tokens are dummies)."""
    n = len(prompts)
    lengths = [1] * n
    sb = SampleBatch(
        prompt_ids=list(range(n)),
        sample_indices=[0] * n,
        response_lengths=lengths,
        response_ids=torch.ones(n, dtype=torch.int64),
        finish_reasons=finish_reasons or [],
    )
    return ScoreRequest(
        samples=sb,
        prompts=prompts,
        labels=labels or [],
        queries=[p + r for p, r in zip(prompts, responses, strict=True)],
    )


# --------------------------------------------------------------------------- contract checks


def test_from_raw_shapes_and_values():
    r = from_raw(
        {"rewards": [1, 0.5, math.inf], "scores": [1, 1, 1], "extra_logs": {"a": [1, 2, 3], "b": 7, "bad": [1]}}, 3, "f"
    )
    assert r.rewards[:2] == [1.0, 0.5] and math.isnan(r.rewards[2])
    assert r.failed == [None, None, "f returned a non-finite reward (inf)"]
    assert r.extra_logs == {"a": [1.0, 2.0, 3.0], "b": [7.0] * 3}  # the wrong-length log is dropped
    assert from_raw([[1.0], [2.0]], 2, "f").failed[0] == "f: rewards[0] is list, expected a number (is the result 2-D?)"
    assert from_raw([1.0], 2, "f").failed == ["f: rewards has 1 entries for 2 samples"] * 2
    assert "without 'rewards'" in from_raw({"score": [1]}, 1, "f").failed[0]
    assert from_raw(0.25, 1, "f").rewards == [0.25]  # a 0-d tensor's tolist() for a batch of one


def test_math_example_scores_a_hand_made_batch():
    sys.path.insert(0, str(ROOT / "examples/rewards"))
    try:
        import math_exact_match as m
    finally:
        sys.path.pop(0)
    cases = [  # (response, label, expected reward)
        ("2 + 3 = 5. Answer: 5", "5", 1.0),
        ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # boxed, nested braces
        ("Answer: 0.5", "1/2", 1.0),  # numbers compare by value
        ("The answer is 1,000.", 1000, 1.0),  # thousands separator, int label
        ("Answer: 6", "5", 0.0),  # wrong
        ("I think 3, no, 4", "4", 1.0),  # last number
        ("no idea", "4", 0.0),  # no answer at all
        ("Answer: 7", None, 0.0),  # no label
        ("Answer: B", ["b", "c"], 1.0),  # several accepted answers, case-insensitive
    ]
    prompt = "What is it? Answer: 42\n"  # the prompt's own "Answer:" must not count
    out = m.reward_func([prompt + r for r, _, _ in cases], [prompt] * len(cases), [lab for _, lab, _ in cases])
    assert out["rewards"] == [want for _, _, want in cases]
    assert out["extra_logs"]["math/has_answer"][6] == 0.0 and out["extra_logs"]["math/has_label"][7] == 0.0


# --------------------------------------------------------------------------- through worker processes


@pytest.fixture(scope="module")
def func_scorer():
    """Scorer with the math example + the faulty helper (their rewards add up)."""
    srcs = [TextSource(FunctionReward(MATH, timeout_s=1.5)), TextSource(FunctionReward(FAULTY, timeout_s=1.5))]
    scorer = Scorer(sources=srcs, name="t")
    yield scorer
    scorer.close()


def test_function_rewards_through_workers(func_scorer):
    out = func_scorer.score(
        request(["Q1 ", "Q2 ", "Q3 "], ["Answer: 5", "\\boxed{7}", "Answer: 1"], labels=["5", "7", "2"])
    )
    assert out.rewards.tolist() == [1.0, 1.0, 0.0] and out.failed == [None] * 3
    assert out.extra_logs["reward/func:math_exact_match.py"] == [1.0, 1.0, 0.0]
    assert out.extra_logs["math/has_answer"] == [1.0] * 3
    assert out.scores.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "marker,reason",
    [
        ("[raise]", "reward_func raised ZeroDivisionError: deliberate failure"),
        ("[short]", "rewards has 1 entries for 2 samples"),
        ("[sleep]", "reward_func timed out after 1.5 s"),
        ("[exit]", "reward_func worker died (exit code 3)"),
    ],
)
def test_faulty_function_fails_samples_with_reason_and_recovers(func_scorer, marker, reason):
    t0 = time.monotonic()
    out = func_scorer.score(request([f"{marker} a", "b"], ["Answer: 1", "Answer: 2"], labels=["1", "2"]))
    assert time.monotonic() - t0 < 10
    assert all(reason in f for f in out.failed), out.failed
    assert torch.isnan(out.rewards).all()
    # the next batch is scored normally (a killed worker was restarted)
    ok = func_scorer.score(request(["c"], ["Answer: 3"], labels=["3"]))
    assert ok.rewards.tolist() == [1.0] and ok.failed == [None]


def test_non_finite_reward_fails_only_that_sample(func_scorer):
    before = func_scorer.stats().get("samples_failed", 0)
    out = func_scorer.score(request(["[nan] a", "b"], ["Answer: 1", "Answer: 2"], labels=["1", "2"]))
    assert out.failed[0] == "func:reward_faulty.py returned a non-finite reward (nan)" and out.failed[1] is None
    assert math.isnan(out.rewards[0]) and out.rewards[1] == 1.0
    assert func_scorer.stats()["samples_failed"] == before + 1
    assert func_scorer.stats()["failed:func:reward_faulty.py"] >= 1


def test_format_example_and_extra_kwargs():
    fr = FunctionReward(FORMAT, timeout_s=10, workers=2)  # two workers: the batch is split
    try:
        res = fr(
            ["p"] * 4,
            ["p"] * 4,
            [None] * 4,
            responses=["<think>hm</think> Answer: 3", "Answer: 1\nAnswer: 2", "\\boxed{2}", "Answer: 4"],
            finish_reasons=["stop", "stop", "stop", "length"],
        )
        assert res.rewards == [1.0, 0.0, 1.0, 0.0] and res.failed == [None] * 4
        assert res.extra_logs["format/complete"] == [1.0, 1.0, 1.0, 0.0]
        assert res.extra_logs["format/one_answer"] == [1.0, 0.0, 1.0, 1.0]
    finally:
        fr.close()


def test_bad_reward_files_fail_at_start_naming_the_file(tmp_path):
    with pytest.raises(FuncLoadError, match=r"reward function file .*nope\.py does not exist"):
        FunctionReward(str(tmp_path / "nope.py"))
    (tmp_path / "empty.py").write_text("def other(q, p, l):\n    return [0.0] * len(q)\n")
    with pytest.raises(FuncLoadError, match=r"empty\.py defines no `reward_func`"):
        FunctionReward(str(tmp_path / "empty.py"))
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(FuncLoadError, match=r"importing .*broken\.py raised ModuleNotFoundError"):
        FunctionReward(str(tmp_path / "broken.py"))


# --------------------------------------------------------------------------- remote HTTP


def start_http(mode="ok"):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, HTTP_SERVER, "--mode", mode], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # the server prints its port first thing; dies -> EOF
    assert line.startswith("PORT "), f"HTTP helper did not start: {line!r}"
    return proc, f"http://127.0.0.1:{int(line.split()[1])}/get_reward"


@pytest.fixture
def no_proxy(monkeypatch):
    for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(k, raising=False)


def test_remote_http_rewards_then_server_killed(no_proxy):
    proc, url = start_http()
    try:
        cfg = parse_config(
            [
                "--controller",
                "tcp://127.0.0.1:1",
                "--remote_rm_url",
                url,
                "--timeout_s",
                "2",
                "--retries",
                "2",
                "--retry_backoff_s",
                "0.05",
            ]
        )
        scorer = Scorer.from_config(cfg)
        rr = scorer.sources[0].impl
        assert scorer.capabilities().sources == ["remote"]
        req = request(["ab", "abcd", "x"], ["cd", "", "yz"])
        out = scorer.score(req)
        assert out.rewards.tolist() == pytest.approx([0.04, 0.04, 0.03]) and out.failed == [None] * 3
        assert out.scores.tolist() == pytest.approx([0.08, 0.08, 0.06])
        proc.kill()
        proc.wait(5)
        t0 = time.monotonic()
        out = scorer.score(req)
        assert time.monotonic() - t0 < 5  # refused at once: 3 attempts + 0.05 + 0.1 s of backoff
        assert all(f.startswith("remote reward failed after 3 attempts; last: ") for f in out.failed), out.failed
        assert "ConnectionRefusedError" in out.failed[0]
        assert torch.isnan(out.rewards).all() and rr.attempts_failed == 3
        scorer.close()
    finally:
        proc.kill()


def test_remote_http_fails_over_to_a_live_url_and_times_out_a_hung_one(no_proxy):
    good, good_url = start_http()
    hung, hung_url = start_http("slow")
    bad, bad_url = start_http("error")
    try:
        # The hung server times out (0.5 s) and the retry goes to the next URL: nothing fails.
        rr = RemoteReward([hung_url, good_url], timeout_s=0.5, retries=1, backoff_s=0.0)
        res = rr(["aa", "bbbb"], ["", ""], [None, None])
        assert res.rewards == pytest.approx([0.02, 0.04]) and res.failed == [None, None]
        assert rr.attempts_failed == 1
        # Only a server answering 500: the samples fail with the HTTP status.
        rr = RemoteReward([bad_url], timeout_s=2, retries=1, backoff_s=0.0)
        res = rr(["aa"], [""], [None])
        assert res.failed[0].endswith("HTTP 500 deliberate failure") and math.isnan(res.rewards[0])
    finally:
        for p in (good, hung, bad):
            p.kill()
