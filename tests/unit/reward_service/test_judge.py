"""reward_service/judge.py: a judge model behind an OpenAI-compatible URL, here a tiny fake server.

The fake answers from the sample's text: a good answer "Score: 8", a vague one text without a
score, "boom" an HTTP 500 every time; it records each request and the most in flight at once.
Failures must be the sample's (reason in ``failed``), never the batch's or the service's.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reward_service.config import parse_config
from reward_service.judge import JudgeReward, parse_score, parse_yes_no
from reward_service.scorer import SOURCES

TEMPLATE = "Question: {prompt}\nReference: {label}\nAnswer: {response}\nKeep \\frac{1}{2} and {other}. Score it 0-10."


class FakeJudge(BaseHTTPRequestHandler):
    seen: list[dict] = []
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.seen.append(body)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        time.sleep(0.05)  # long enough for requests of one batch to overlap
        with cls.lock:
            cls.in_flight -= 1
        text = body["messages"][0]["content"]
        if self.path != "/v1/chat/completions" or "boom" in text:
            self.send_response(500)
            self.end_headers()
            return
        reply = "Score: 8" if "good" in text else "Hmm, hard to say." if "vague" in text else "Score: **3**/10"
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_scores_per_sample_and_fails_per_sample(judge_url):
    FakeJudge.seen.clear()
    judge = JudgeReward(judge_url, model="m", template=TEMPLATE, scale=10, retries=1, backoff_s=0.01, concurrency=8)
    try:
        responses = ["a good answer", "a poor answer", "a vague answer", "boom", "another good one"]
        prompts = [f"Q{i}?" for i in range(5)]
        res = judge([p + r for p, r in zip(prompts, responses, strict=True)], prompts, ["1/2", None, "x", "y", "z"])
    finally:
        judge.close()
    assert res.rewards[:2] == [0.8, 0.3] and res.rewards[4] == 0.8
    assert math.isnan(res.rewards[2]) and math.isnan(res.rewards[3])
    assert res.failed[:2] == [None, None] and res.failed[4] is None
    assert res.failed[2].startswith("judge: no score in the reply: 'Hmm")
    assert res.failed[3].startswith(f"judge {judge_url}/chat/completions failed after 2 attempts; last: HTTP 500")
    first = next(b for b in FakeJudge.seen if "Q0?" in b["messages"][0]["content"])
    assert first["model"] == "m" and first["temperature"] == 0.0
    assert first["messages"][0]["content"] == (
        "Question: Q0?\nReference: 1/2\nAnswer: a good answer\nKeep \\frac{1}{2} and {other}. Score it 0-10."
    )
    assert FakeJudge.most_in_flight > 1  # the batch's requests went out together


def test_parsers():
    assert parse_score("reasoning 1 2 3. Score: 7") == 7.0 and parse_score("I give it 4.5") == 4.5
    assert parse_score("Score = 6, not 9 as in step 9") == 6.0 and parse_score("none") is None
    assert parse_yes_no("Is it right? ... Yes.") == 1.0 and parse_yes_no("That is incorrect") == 0.0
    assert parse_yes_no("maybe") is None


def test_flags_build_the_source_and_bad_flags_name_themselves(judge_url, tmp_path, capsys):
    tpl = tmp_path / "judge.txt"
    tpl.write_text(TEMPLATE)
    argv = ["--controller", "-", "--judge_url", judge_url, "--judge_prompt", str(tpl), "--judge_parser", r"re:(\d+)"]
    (src,) = SOURCES["judge"](parse_config(argv))
    try:
        res = src.impl(["Q good"], ["Q"], [None])
        assert res.rewards == [8.0] and res.failed == [None]
    finally:
        src.close()
    bad = {
        "--judge_url needs --judge_prompt": ["--judge_url", judge_url],
        "has no {response} placeholder": ["--judge_url", judge_url, "--judge_prompt", str(tmp_path / "empty.txt")],
        "cannot read it": ["--judge_url", judge_url, "--judge_prompt", str(tmp_path / "missing.txt")],
        "--judge_parser 'stars' unknown": [
            "--judge_url",
            judge_url,
            "--judge_prompt",
            str(tpl),
            "--judge_parser",
            "stars",
        ],
    }
    (tmp_path / "empty.txt").write_text("no placeholder")
    for why, args in bad.items():
        with pytest.raises(SystemExit) as e:
            parse_config(["--controller", "-", *args])
        assert e.value.code == 2 and why in capsys.readouterr().err, why
