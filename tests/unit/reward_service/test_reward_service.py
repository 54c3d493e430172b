"""The reward service as a real process over ZMQ: handshake, scoring, faults, bad input,
shutdown and the fatal notice. The test is the controller (tests/helpers/reward_controller.py)."""

import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from common import protocol as P
from common.transport import RemoteError
from helpers.reward_controller import ENV, ROOT, FakeController
from helpers.reward_models import build_tiny_rm

MATH = "examples/rewards/math_exact_match.py"
FAULTY = "tests/helpers/reward_faulty.py"


@pytest.fixture(scope="module")
def ctrl(tmp_path_factory):
    c = FakeController(tmp_path_factory.mktemp("reward-logs"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def service(ctrl, tiny_model_dir):
    """math reward + the faulty helper (their rewards add), decoding with the tiny tokenizer."""
    proc, hello = ctrl.start(
        "rw-main",
        "--reward_func",
        MATH,
        "--remote_rm_url",
        FAULTY,
        "--tokenizer",
        str(tiny_model_dir),
        "--timeout_s",
        "2",
        "--heartbeat_s",
        "0.5",
    )
    return proc, hello


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_request(tok, prompts, responses, labels, texts=False):
    """A ScoreRequest as the controller sends it: token ids (+ optionally the prompt text)."""
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    sb = P.SampleBatch(
        prompt_ids=list(range(len(prompts))),
        sample_indices=[0] * len(prompts),
        response_lengths=[len(r) for r in r_ids],
        response_ids=torch.tensor([t for r in r_ids for t in r], dtype=torch.int32),
        prompt_token_ids=p_ids,
    )
    return P.ScoreRequest(samples=sb, labels=labels, prompts=prompts if texts else [])


def call(ctrl, name, msg, timeout=30.0):
    return ctrl.ep.call(msg, to=name.encode(), timeout=timeout)


def test_help_answers_without_importing_torch():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "reward_service", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**ENV, "PATH": ""},
    )
    assert out.returncode == 0 and "--remote_rm_url" in out.stdout and "--normalize_reward" in out.stdout
    assert time.monotonic() - t0 < 2.0  # < 0.2 s idle; headroom for a loaded CI box
    probe = (
        "import sys; from reward_service.config import parse_config; "
        "parse_config(['--controller', 'tcp://x:1', '--reward_func', 'f.py']); "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import before serving'"
    )
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, timeout=30).returncode == 0


def test_handshake_announces_sources(service):
    _, hello = service
    assert hello.role == "reward"
    assert hello.capabilities.sources == ["func:math_exact_match.py", "func:reward_faulty.py"]


def test_scores_token_batches_over_zmq(ctrl, service, tok):
    req = token_request(
        tok,
        ["Q: 2+3?\n", "Q: 7*8?\n", "Q: 1+1?\n"],
        ["Answer: 5", "The answer is 56.", "Answer: 3"],
        labels=["5", "56", "2"],
    )
    out = call(ctrl, "rw-main", req)
    assert isinstance(out, P.ScoredBatch) and out.call_id == req.call_id and out.server == "rw-main"
    assert out.prompt_ids == [0, 1, 2] and out.rewards.tolist() == [1.0, 1.0, 0.0]
    assert out.failed == [None, None, None] and out.ref_logprobs is None


@pytest.mark.parametrize(
    "marker,reason",
    [
        ("[raise]", "reward_func raised ZeroDivisionError"),
        ("[sleep]", "reward_func timed out after 2 s"),
        ("[short]", "rewards has 1 entries for 2 samples"),
    ],
)
def test_faulty_reward_fails_samples_and_service_keeps_answering(ctrl, service, tok, marker, reason):
    req = token_request(tok, [f"{marker} Q: 2+3?\n", "Q: 1+1?\n"], ["Answer: 5", "Answer: 2"], ["5", "2"], texts=True)
    out = call(ctrl, "rw-main", req)
    assert all(f and reason in f for f in out.failed), out.failed
    assert torch.isnan(out.rewards).all()
    ok = call(ctrl, "rw-main", token_request(tok, ["Q: 1+1?\n"], ["Answer: 2"], ["2"]))
    assert ok.rewards.tolist() == [1.0] and ok.failed == [None]


def test_heartbeats_report_failures(ctrl, service):
    # Heartbeats sent while an earlier call was still queued may wait in the stash: take the
    # first one that has seen all 7 requests (3 faulty + 3 ok + 1) answered.
    hb = ctrl.recv_until(
        lambda m: isinstance(m, P.Heartbeat) and m.stats.get("requests", 0) >= 7 and m.stats.get("in_flight") == 0,
        timeout=10,
    )
    assert hb.name == "rw-main" and hb.stats["samples_failed"] >= 6 and hb.stats["failed:func:reward_faulty.py"] >= 6


def test_garbage_and_bad_requests_are_answered_and_service_keeps_serving(ctrl, service, tok):
    ident = b"rw-main"
    ctrl.ep.sock.send_multipart([ident, b"\x99", b"junk"])  # undecodable
    ctrl.ep.sock.send_multipart([ident, bytes([P.ScoreRequest.TAG]), b"\xc1\x00garbage"])  # bad header
    for _ in range(2):
        err = ctrl.recv_until(lambda m: isinstance(m, P.Error), timeout=10)
        assert err.code == "bad_request"
    bad = token_request(tok, ["a", "b"], ["c", "d"], labels=["only one label"])
    with pytest.raises(RemoteError, match=r"bad_request: ScoreRequest.labels has 1 entries for 2 samples"):
        call(ctrl, "rw-main", bad)
    with pytest.raises(RemoteError, match=r"bad_request: .* does not handle PromptBatch"):
        call(ctrl, "rw-main", P.PromptBatch(prompt_ids=[1], token_ids=[[5]]))
    ok = call(ctrl, "rw-main", token_request(tok, ["Q\n"], ["Answer: 4"], ["4"]))
    assert ok.rewards.tolist() == [1.0]
    # (an older heartbeat from before the calls may be stashed: wait for one that saw them all)
    ctrl.recv_until(
        lambda m: (
            isinstance(m, P.Heartbeat)
            and m.stats.get("rejected", 0) >= 2
            and m.stats.get("bad_requests", 0) >= 1
            and m.stats.get("unhandled_messages", 0) >= 1
        ),
        timeout=10,
    )


def test_ref_and_reward_model_through_the_process(ctrl, tiny_model_dir, tmp_path, tok):
    """--ref_pretrain + --reward_pretrain + a format bonus, as the controller would use them."""
    rm_dir = build_tiny_rm(tiny_model_dir, tmp_path / "rm")
    ctrl.start(
        "rw-models",
        "--ref_pretrain",
        str(tiny_model_dir),
        "--reward_pretrain",
        str(rm_dir),
        "--reward_func",
        "examples/rewards/format_check.py",
        "--micro_batch_size",
        "2",
    )
    prompts, responses = ["Q: 2+3?\n", "Reverse: abc\n", "Hi\n"], ["Answer: 5", "cba", "Answer: 1\nAnswer: 2"]
    req = token_request(tok, prompts, responses, labels=[None] * 3)
    out = call(ctrl, "rw-models", req, timeout=60)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    want_lp, want_rm = [], []
    with torch.no_grad():
        for p, r in zip(req.samples.prompt_token_ids, req.samples.split_responses(), strict=True):
            ids = torch.tensor(p + r.tolist())[None]
            lp = policy(ids).logits[0].log_softmax(-1)
            want_lp.append(lp[len(p) - 1 : -1].gather(-1, r.long()[:, None])[:, 0])
            want_rm.append(rm(ids).logits[0, 0])
    assert (out.ref_logprobs - torch.cat(want_lp)).abs().max() < 1e-5
    fmt = torch.tensor([1.0, 0.0, 0.0])  # only the first has exactly one answer
    assert (out.rewards - (torch.stack(want_rm) + fmt)).abs().max() < 1e-5
    assert (torch.tensor(out.extra_logs["reward/rm"]) - torch.stack(want_rm)).abs().max() < 1e-5
    assert out.extra_logs["reward/func:format_check.py"] == fmt.tolist() and out.failed == [None] * 3


def test_shutdown_is_acknowledged_and_exits_0(ctrl):
    proc, _ = ctrl.start("rw-stop", "--reward_func", FAULTY)
    ack = call(ctrl, "rw-stop", P.Shutdown(reason="test done"), timeout=30)
    assert isinstance(ack, P.Ack)
    assert proc.wait(30) == 0


def test_sigterm_sends_fatal_notice_before_exiting(ctrl):
    proc, _ = ctrl.start("rw-term", "--reward_func", FAULTY)
    proc.send_signal(signal.SIGTERM)
    err = ctrl.recv_until(lambda m: isinstance(m, P.Error) and m.code == "fatal", timeout=20)
    assert "rw-term stopping on SIGTERM" in err.message
    assert proc.wait(30) == 143  # 128 + SIGTERM: stopped from outside the run (common/service.py)


@pytest.mark.parametrize(
    "content,expect",
    [
        (None, "does not exist"),
        ("x = 1\n", "defines no `reward_func`"),
    ],
)
def test_bad_reward_file_fails_start_up_naming_it(ctrl, tmp_path, content, expect):
    path = tmp_path / "my_reward.py"
    if content is not None:
        path.write_text(content)
    proc, log = ctrl.spawn("rw-bad", "--reward_func", str(path))
    assert proc.wait(60) == 2
    text = log.read_text()
    assert str(path) in text and expect in text, text


def test_model_errors_answer_internal_then_turn_fatal():
    """In-process server: a scorer whose forward keeps raising answers Error(internal) with
    the prompt ids, and after FATAL_AFTER in a row announces Error(fatal) and stops."""
    import threading

    from common.transport import Endpoint
    from reward_service.server import FATAL_AFTER, RewardServer

    class Broken:
        def score(self, req):
            raise RuntimeError("CUDA error: device-side assert")

        def capabilities(self):
            return P.RewardCapabilities(sources=["rm"])

        def stats(self):
            return {}

        def close(self):
            pass

    ep = Endpoint.bind("tcp://127.0.0.1:0")
    srv = RewardServer(Broken(), controller=ep.address, name="rw-broken", heartbeat_s=0.2)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t.start()
    try:
        ident, hello = ep.recv(timeout=10)
        ep.reply(hello, P.Welcome(peer_id="rw-broken"), to=ident)
        sb = P.SampleBatch(prompt_ids=[4], sample_indices=[0], response_lengths=[1], response_ids=torch.tensor([1]))
        for _ in range(FATAL_AFTER):
            with pytest.raises(RemoteError, match="internal: rw-broken: RuntimeError: CUDA error") as e:
                ep.call(P.ScoreRequest(samples=sb), to=ident, timeout=10)
            assert e.value.error.prompt_ids == [4]
        deadline = time.monotonic() + 10
        while True:
            got = ep.recv(timeout=max(0.0, deadline - time.monotonic()))
            assert got is not None, "no fatal notice"
            if isinstance(got[1], P.Error) and got[1].code == "fatal":
                break
        assert f"{FATAL_AFTER} scoring calls in a row failed" in got[1].message and got[1].call_id == 0
        t.join(10)
        assert result["rc"] == 1
    finally:
        t.join(10)
        ep.close(0)
