"""``python -m reward_service.serve_rm`` as a real process, scored through rayless's own
``--remote_rm_url`` client (``reward_service/remote.py``, through the ``Scorer``), against the same
reward model in-process; then every kind of bad request, the server still serving after them.
One server for the module (a tiny RM with mean/std, started with both spellings of the flags)."""

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from common import protocol as P
from common.net import free_port
from helpers.procs import ROOT, worker_env
from helpers.reward_models import build_tiny_rm
from reward_service.config import parse_config as reward_config
from reward_service.remote import RemoteReward
from reward_service.reward_model import RewardModelScorer
from reward_service.scorer import Scorer
from reward_service.serve_rm import ServeRMConfig, parse_config

MAX_LEN = 24  # the server cuts each query to this many tokens
MEAN, STD = 0.25, 2.0  # in the RM's config.json, applied with --normalize_reward


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """The tiny sequence-classification RM with the tokenizer beside it and mean/std in its config."""
    out = build_tiny_rm(tiny_model_dir, tmp_path_factory.mktemp("serve_rm") / "rm")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(mean=MEAN, std=[STD])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def server(rm_dir, tmp_path_factory):
    """(base URL, process, log path) of one serve_rm started with dotted and flat flags mixed."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve_rm_log") / "serve_rm.log"
    args = ["--reward_pretrain", str(rm_dir), "--reward.normalize_enable", "--data.max_len", str(MAX_LEN)]
    args += ["--batch_size", "3", "--port", str(port), "--packing_samples", "--max_body_mb", "0.01"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reward_service.serve_rm", *args],
            cwd=ROOT,
            env=worker_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"serve_rm exited {proc.returncode}:\n{log_path.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, f"serve_rm not up in 180 s:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.2)
    yield url, proc, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_request(tok, prompts, responses):
    """A ScoreRequest as the controller sends it: token ids only (the service decodes them)."""
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    sb = P.SampleBatch(
        prompt_ids=list(range(len(prompts))),
        sample_indices=[0] * len(prompts),
        response_lengths=[len(r) for r in r_ids],
        response_ids=torch.tensor([t for r in r_ids for t in r], dtype=torch.int32),
        prompt_token_ids=p_ids,
    )
    return P.ScoreRequest(samples=sb, labels=[None] * len(prompts))


def post(url, body: bytes, headers=None, path="/get_reward", method="POST"):
    """(status, JSON answer) of one raw request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_help_answers_without_importing_torch():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "reward_service.serve_rm", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 2.0  # < 0.3 s idle; headroom for a loaded CI box
    for both in ("--reward.model_name_or_path MODEL_NAME_OR_PATH, --reward_pretrain", "--ds.value_head_prefix"):
        assert both in out.stdout
    probe = (
        "import sys; from reward_service.serve_rm import parse_config; parse_config(['--reward_pretrain', 'x']); "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import before serving'"
    )
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, timeout=30).returncode == 0


def test_flags_take_both_spellings_and_say_what_cannot_act():
    flat = parse_config(["--reward_pretrain", "m", "--bf16", "--flash_attn", "--value_head_prefix", "value_head"])
    dotted = parse_config(
        ["--reward.model_name_or_path", "m", "--ds.param_dtype", "bf16"]
        + ["--ds.attn_implementation", "flash_attention_2", "--ds.value_head_prefix", "value_head"]
    )
    assert flat == dotted and flat.ds.param_dtype == "bf16" and flat.host == "127.0.0.1"
    cfg = parse_config(["--reward_pretrain", "m", "--load_in_4bit", "--ds.packing_samples", "--use_ms"])
    assert [n.split()[0] for n in cfg.notices] == ["--ds.load_in_4bit", "--ds.packing_samples", "--use_ms"]
    assert parse_config(["--reward_pretrain", "m", "--disable_fast_tokenizer"]).data.disable_fast_tokenizer
    assert isinstance(cfg, ServeRMConfig)


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "--reward.model_name_or_path"),
        (["--reward_pretrain", "m", "--max_len", "0"], "--data.max_len"),
        (["--reward_pretrain", "m", "--ds.max_len", "3"], "unrecognized"),
        (["--reward_pretrain", "m", "--max_len", "8", "--data.max_len", "9"], "different values"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_remote_rm_url_scores_equal_the_in_process_reward_model(server, rm_dir, tiny_model_dir, tok):
    url, _, log_path = server
    prompts = ["Q: 2+3?\n", "Q: name a colour.\n", "Q: 7*8?\n", "Hi", "Q: capital of France?\n"]
    responses = ["5", "blue, or maybe green", "", " 56, since 7*8 is 56.", "Paris"]
    req = token_request(tok, prompts, responses)
    common = ["--controller", "-", "--tokenizer", str(tiny_model_dir)]
    remote = Scorer.from_config(reward_config([*common, "--remote_rm_url", f"{url}/get_reward"]))
    local = Scorer.from_config(
        reward_config([*common, "--reward_pretrain", str(rm_dir), "--rm_from_text", "--normalize_reward"])
    )
    try:
        got, want = remote.score(req), local.score(req)
    finally:
        remote.close()
        local.close()
    assert got.failed == [None] * len(prompts), got.failed
    # the server's micro-batches of 3 pad differently from the in-process 8: fp32 rounding only
    assert torch.allclose(got.rewards, want.rewards, atol=1e-5), (got.rewards, want.rewards)
    assert torch.allclose(got.scores, got.rewards)
    assert want.rewards.std() > 0.01  # the comparison is not between constants
    log = log_path.read_text()
    assert "inert: --ds.packing_samples" in log and f"serving {rm_dir} on {url}/get_reward" in log


def test_queries_are_cut_to_max_len_tokens(server, rm_dir, tok):
    url, _, _ = server
    long = "one two three four five six seven eight nine ten " * 6
    queries = [long, long + "and a different ending", "short"]
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in queries]
    assert len(ids[0]) > MAX_LEN and ids[0][:MAX_LEN] == ids[1][:MAX_LEN]
    client = RemoteReward([f"{url}/get_reward"], timeout_s=30, retries=0)
    try:
        got = client(queries, ["p"] * 3, [None] * 3)
    finally:
        client.close()
    rm = RewardModelScorer.load(str(rm_dir), normalize=True)
    want = rm.rewards([torch.tensor(i[:MAX_LEN]) for i in ids]).tolist()
    assert got.failed == [None] * 3
    assert got.rewards == pytest.approx(want, abs=1e-5)
    assert got.rewards[0] == pytest.approx(got.rewards[1], abs=1e-6)  # the differing tail was cut


def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(server):
    url, proc, _ = server
    cases = [
        (b"{not json", 400, "body"),
        (b"\xff\xfe", 400, "body"),
        (b"[1, 2]", 400, "body"),
        (json.dumps({"prompts": ["a"], "labels": [None]}).encode(), 400, "query"),
        (json.dumps({"query": "one text, not a list"}).encode(), 400, "query"),
        (json.dumps({"query": ["fine", 3, "fine"]}).encode(), 400, "query[1]"),
        (json.dumps({"query": ["fine", None]}).encode(), 400, "query[1]"),
        (json.dumps({"query": ["fine", ""]}).encode(), 400, "query[1]"),
        (b"x" * 20000, 413, "body"),  # over --max_body_mb 0.01
    ]
    for body, status, field in cases:
        got_status, answer = post(url, body)
        assert (got_status, answer.get("field")) == (status, field), (body[:40], answer)
        assert answer["error"]
    assert post(url, b"{}", path="/other")[0] == 404
    assert post(url, b"", method="GET")[0] == 405
    assert post(url, b"{}", method="PUT")[0] == 405
    # no Content-Length, a lying one, and bytes that are not HTTP at all
    for raw, status in [
        (b"POST /get_reward HTTP/1.1\r\nHost: x\r\n\r\n", 411),
        (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", 400),
        (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}", 413),
        (b"\x16\x03\x01 garbage\r\n\r\n", 400),
    ]:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(raw)
            chunks = []  # to the end: an error closes the connection
            while chunk := s.recv(65536):
                chunks.append(chunk)
            head = b"".join(chunks).decode("latin-1")
        assert head.startswith("HTTP/1.") and f" {status} " in head.split("\r\n")[0], (raw, head)
        assert head.split("\r\n\r\n", 1)[1].startswith("{")
    assert proc.poll() is None
    status, answer = post(url, json.dumps({"query": ["still here"], "prompts": ["x"], "labels": [None]}).encode())
    assert status == 200 and len(answer["rewards"]) == 1 and answer["extra_logs"] == {}


def test_sigterm_stops_it_with_143(server):
    _, proc, log_path = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143, log_path.read_text()[-2000:]
    assert "stopped after" in log_path.read_text()
