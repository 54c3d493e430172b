"""Rollout servers end to end: real ``python -m rollout_service`` processes on the tiny model, a
real controller side (ServicePool + RolloutClient + WeightPublisher), weights over gloo.

Engines are expensive to start on a busy 2-core box (30-140 s each), so one module-scoped set of
three servers serves every test, in file order: ``ra`` and ``rb`` join at once; ``rc`` is started
alongside them but pointed at an address the controller only binds late in the run, so it joins
*after* weight updates, holding the initial checkpoint, as a server started mid-run does. A
fourth, ``rd``, never finds a controller: it is there to be stopped while it waits for one (no
server that joins can be, and SIGTERM to a waiting server once went unheeded), a fourth engine
start; the last test ends ``rc`` by killing its engine while it waits for a controller gone.

``rb`` runs as a user's server does without ``VLLM_CPU_KVCACHE_SPACE``: its default memory share
is checked by vLLM-CPU at start-up (and sizes its KV cache), and it starts while a ballast process
holds enough of the node's free memory that vLLM's GPU-style 0.85 could not (common/vllm_memory.py).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from common import protocol as P
from common.tiny import ENDOFTEXT_ID, IM_END_ID
from common.transport import RemoteError, free_port
from common.vllm_memory import GIB, KV_SPACE_ENV, node_memory, refusal
from helpers.paths import HELPERS
from helpers.rollout_harness import ENV, REPO, Controller, Server, hf_greedy, hf_logprobs, perturb, samples_of

pytestmark = pytest.mark.slow

STOP = {IM_END_ID, ENDOFTEXT_ID}  # generation_config.eos_token_id: vLLM stops on these too
GREEDY = P.SamplingParams(temperature=0.0, max_new_tokens=16)
# Prompts of 150+ tokens sharing a 140-token prefix: longer than a KV block, so the prefix
# cache holds full blocks that a later request (and a later *version*) could hit.
PREFIX = [1] + [(7 * i) % 700 + 3 for i in range(139)]
AGENT_FILE = HELPERS / "agent_three_turns.py"  # ra runs it (for the prompts that ask for episodes)
# rc runs this one in 2 environment worker processes: the label picks a fault (or none)
FAULTS_FILE = HELPERS / "agent_env_faults.py"
RC_ENV_WORKERS = ["--agent_func_path", str(FAULTS_FILE), "--agent_env_workers", "2"]
RC_ENV_WORKERS += ["--agent_env_worker_memory_mb", "1500", "--agent_episode_timeout_s", "120"]
PROMPTS = [PREFIX + [10 + k, 20 + k, 30 + k, 40 + k, 50 + k, 60 + k, 70 + k, 80 + k, 90 + k, 100 + k] for k in range(4)]


def test_help_answers_fast_without_importing_torch():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "rollout_service", "--help"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "--weight_transfer_backend" in out.stdout
    assert time.monotonic() - t0 < 2.0  # ~0.1 s idle; generous for a loaded box
    probe = (
        "import sys; from common.config import build_parser; from rollout_service.config import RolloutConfig; "
        "build_parser(RolloutConfig); import rollout_service.__main__; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_share_vllm_would_refuse_fails_at_once_in_one_line(tiny_model_dir):
    """A share of 1 without VLLM_CPU_KVCACHE_SPACE asks for the whole node to be free, never
    true on a running host: the server exits 2 before any vLLM process starts, with one error
    line naming the flag (and a share that would start, or what to free) -- no retries, no
    traceback. (Before the servers start: a test that runs this long while the stack is up
    would leave the controller unread past its peer timeout.)"""
    out = subprocess.run(
        [sys.executable, "-m", "rollout_service", "--model", str(tiny_model_dir), "--controller", "tcp://127.0.0.1:1"]
        + ["--name", "r-full", "--gpu_memory_utilization", "1.0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in {**os.environ, **ENV}.items() if k != KV_SPACE_ENV},
    )
    log = out.stdout + out.stderr
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert out.returncode == 2, log[-3000:]
    assert len(errors) == 1, log[-3000:]
    assert "r-full: vLLM-CPU will not start: --gpu_memory_utilization 1 asks for" in errors[0]
    assert "free memory on node" in errors[0]
    assert "Traceback" not in log and "retrying" not in log and "(EngineCore" not in log


GPU_SHARE = 0.85  # the rollout server's GPU default, the share every CPU server was started with before
BALLAST_MARGIN = 1 * GIB  # the ballast leaves this much less free than 0.85 asks for
BALLAST_MAX = 8 * GIB  # more than this would crowd a shared host: the pressure test is skipped instead
BALLAST = (
    "import sys\n"
    "held = b'\\x01' * int(sys.argv[1])  # every page written: memory the node must really provide\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()  # until the test closes this pipe (or dies)\n"
)


def hold_memory() -> tuple[subprocess.Popen | None, dict | None]:
    """A ballast process holding enough of the node's free memory (vLLM's own reading) that
    vLLM-CPU would refuse a share of 0.85, with the reading under it; (None, None) when that
    would take more than BALLAST_MAX. Nothing is held when the node is already that full."""
    mem = node_memory()
    hold = max(0, mem.available - (math.ceil(GPU_SHARE * mem.total) - BALLAST_MARGIN))
    if hold > BALLAST_MAX:
        return None, None
    proc = None
    if hold:
        proc = subprocess.Popen(
            [sys.executable, "-c", BALLAST, str(hold)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "held", "the ballast process failed"
    under = node_memory()
    return proc, {
        "held": hold,
        "mem": under,
        "refused": refusal(GPU_SHARE, under, flag="--gpu_memory_utilization", who="rb"),
    }


def release(ballast: subprocess.Popen | None) -> None:
    if ballast is not None:
        ballast.stdin.close()
        ballast.wait(30)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # Small buckets and relay pieces: several of each per push, so the fleet group's relay
    # (the learner sends once, the first server relays to the second) really pipelines.
    ctrl = Controller(model, peer_timeout_s=6.0, weight_timeout_s=60.0, bucket_bytes=256 * 1024)
    ctrl.publisher.sender.relay_chunk_bytes = 64 * 1024
    logs = tmp_path_factory.mktemp("rollout-logs")
    ballast = None
    try:
        ctrl.late_port = free_port()
        ballast, ctrl.pressure = hold_memory()
        ctrl.start("ra", logs, "--idle_spin_s", "0.05", "--agent_func_path", str(AGENT_FILE))
        ctrl.start("rb", logs, env={KV_SPACE_ENV: None})  # unset: vLLM checks the share
        ctrl.wait_joined(["ra", "rb"], timeout=600)
        release(ballast)  # rb's engine passed vLLM's check: the pressure has done its part
        # rc serves LoRA adapters too (the last test pushes one to it): --lora_sync adapter's server half.
        # Started once rb has passed its memory check: rc's engine and environment workers (~1 GiB
        # with its own) starting beside that check took the memory rb's share was sized for.
        ctrl.rc_lora_dir = logs / "rc-adapters"
        lora = ["--enable_lora", "--max_lora_rank", "8", "--lora_dir", str(ctrl.rc_lora_dir)]
        rc_flags = ["--connect_timeout_s", "1200", *lora, *RC_ENV_WORKERS]
        ctrl.servers.append(Server("rc", tiny_model_dir, f"tcp://127.0.0.1:{ctrl.late_port}", logs, *rc_flags))
        # rd waits for a controller nobody runs, to be stopped there (its own test, late in the
        # file: its engine starts while the first tests run).
        ctrl.servers.append(
            Server("rd", tiny_model_dir, f"tcp://127.0.0.1:{free_port()}", logs, "--connect_timeout_s", "1200")
        )
        yield ctrl
    finally:
        release(ballast)
        ctrl.close()


def test_the_default_share_starts_where_vllms_gpu_default_would_be_refused(stack):
    """rb started (and serves every test below) while vLLM's own reading of the node refused 0.85
    -- the share every CPU server asked for before, which made a second server or a page cache
    from earlier runs fatal; rb asked for what its engine needs instead, and announced it."""
    if stack.pressure is None:
        pytest.skip(f"the node has so much free memory that refusing 0.85 takes over {BALLAST_MAX // GIB} GiB")
    mem = stack.pressure["mem"]
    assert stack.pressure["refused"] is not None, mem  # the precondition, on vLLM's numbers
    share = stack.client.peer("rb").capabilities.gpu_memory_utilization
    assert 0 < share < GPU_SHARE and refusal(share, mem, flag="--gpu_memory_utilization", who="rb") is None
    assert "rb: vLLM-CPU will not start" not in stack.servers[1].log_tail(10**6)


def _run(stack, prompts, sampling, first_id, version, to=None, timeout=180, seeds=()):
    """Prompts through the controller (or straight to one server); {prompt id: samples}."""
    ids = list(range(first_id, first_id + len(prompts)))
    if to is None:
        assert not stack.client.submit(ids, prompts, sampling, policy_version=version, seeds=seeds or None)
    else:
        batch = P.PromptBatch(prompt_ids=ids, token_ids=prompts, sampling=sampling, policy_version=version, seeds=seeds)
        stack.ep.send(batch, to=to.encode())
    stack.wait_results(ids, timeout=timeout)
    return {pid: samples_of(stack.results[pid], pid) for pid in ids}


def _assert_parity(model, prompts, got, version):
    for prompt, samples in zip(prompts, got.values(), strict=True):
        (s,) = samples
        want_toks, want_lps = hf_greedy(model, prompt, GREEDY.max_new_tokens, STOP)
        assert s["tokens"] == want_toks, f"v{version}: greedy tokens differ from transformers"
        assert s["version"] == version
        assert s["finish"] == ("stop" if want_toks[-1] in STOP else "length")
        # The sampling log-probs vLLM reports = the learner's log-probs of the same tokens.
        lp = torch.tensor(s["logprobs"])
        assert torch.allclose(lp, torch.tensor(want_lps), atol=1e-4), (lp, want_lps)
        assert torch.allclose(lp, torch.tensor(hf_logprobs(model, prompt, s["tokens"])), atol=1e-4)


def test_parity_with_transformers_after_two_successive_updates(stack):
    """vLLM-CPU generates what transformers generates: on the weights loaded from disk (v0:
    the model as the engine loaded it, fp32), then with the weights perturbed and pushed twice;
    each time the service's greedy tokens and log-probs equal transformers' for those weights.
    The same prompts (and their cached prefix) are served under v0, v1 and v2: stale KV from an
    earlier version would show up as a mismatch. Each push goes through one fleet group to both
    engines (one transfer from the learner), and the two then hold the same weights to the bit:
    asked the same prompts one engine at a time, they answer identical tokens and log-probs."""
    for version in (0, 1, 2):
        if version:
            perturb(stack.model, seed=version)
            report = stack.fleet.push(version)
            assert sorted(report.updated) == ["ra", "rb"] and not report.failed, report
            # The fleet is in join order, which is whichever engine came up first.
            assert sorted(report.fleet) == ["ra", "rb"] and not report.retried, report
            assert stack.publisher.fleet_builds == 1  # the same two servers: the group is kept
        got = _run(stack, PROMPTS, GREEDY, first_id=version * 100 + 1000, version=version)
        each = {s: _run(stack, PROMPTS, GREEDY, first_id=version * 100 + 1010 + 5 * i, version=version, to=s)
                for i, s in enumerate(("ra", "rb"))}  # fmt: skip
        assert [x[0]["tokens"] for x in each["ra"].values()] == [x[0]["tokens"] for x in each["rb"].values()]
        assert [x[0]["logprobs"] for x in each["ra"].values()] == [x[0]["logprobs"] for x in each["rb"].values()]
        _assert_parity(stack.model, PROMPTS, got, version)
        # Twice under the same version: now from the prefix cache, still the same answer.
        again = _run(stack, PROMPTS, GREEDY, first_id=version * 100 + 1050, version=version)
        assert [s[0]["tokens"] for s in again.values()] == [s[0]["tokens"] for s in got.values()]
    for name in ("ra", "rb"):
        health = stack.client.call(name, P.GetHealth())
        assert health.policy_version == 2 and health.state == "serving"
        # ra's worker made its queues with the idle spin asked for (--idle_spin_s), rb's with vLLM's own
        assert stack.client.peer(name).capabilities.idle_spin_s == {"ra": 0.05, "rb": 1.0}[name]


def test_a_seed_is_per_prompt_and_reproducible_on_any_server(stack):
    """A batch's seed S samples prompt P with S + n*P (its samples S + n*P + 0..n-1): two
    prompts of one batch do not share a random stream, and a prompt sampled again (another id,
    another server) with the seed that makes S + n*P equal gives the very same tokens; so does
    the prompt's own seed (PromptBatch.seeds, what --seed_sampling sends), whatever S says."""
    v = stack.pool.policy_version
    prompt = [1, 90, 91, 92]
    first = _run(
        stack,
        [prompt, prompt],
        P.SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=0),
        first_id=900,
        version=v,
    )
    assert [s["tokens"] for s in first[900]] != [s["tokens"] for s in first[901]]
    assert first[900][0]["tokens"] != first[900][1]["tokens"], "the n samples of a seeded prompt are copies"
    # prompt 875 with seed 50 is sampled as prompt 900 with seed 0 (seed 1800); so is prompt 7
    # with its own seed 1800 under a batch seed that would say otherwise
    for server, pid, seed, seeds in (("ra", 875, 50, ()), ("rb", 7, 4, [1800])):
        again = _run(
            stack,
            [prompt],
            P.SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=seed),
            first_id=pid,
            version=v,
            to=server,
            seeds=seeds,
        )
        assert [s["tokens"] for s in again[pid]] == [s["tokens"] for s in first[900]], server
        stack.results.pop(pid)


def test_agent_episodes_on_the_real_engine_are_token_exact(stack):
    """ra runs an agent (tests/helpers/agent_three_turns.py: three actions, " ok" after the first
    two). Each episode's sequence is its prompt, then actions as vLLM sampled them and the
    feedback's tokens as the tokenizer encodes them (the server checks every turn's input is a
    prefix of it); the mask is 1 exactly on the actions; the learner's log-probs of the action
    tokens, computed by transformers over the whole sequence, equal vLLM's (fp32); the agent's
    rewards are summed; and the later turns find the earlier ones in vLLM's prefix cache (the
    prompts are longer than one 128-token KV block, the CPU backend's)."""
    from transformers import AutoTokenizer

    v = stack.pool.policy_version
    tok = AutoTokenizer.from_pretrained(stack.model.name_or_path)
    feedback = tok(" ok", add_special_tokens=False)["input_ids"]
    agent = P.AgentParams(agent=stack.client.peer("ra").capabilities.agent, max_len=240, max_turns=3)
    sampling = P.SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5, logprobs=True)
    ids = [700, 701]
    prompts = [PREFIX + [200, 201], PREFIX + [202, 203]]
    before = stack.client.call("ra", P.GetHealth()).stats
    batch = P.PromptBatch(
        prompt_ids=ids, token_ids=prompts, sampling=sampling, policy_version=v, agent=agent, labels=["a", "b"]
    )
    stack.ep.send(batch, to=b"ra")
    stack.wait_results(ids, timeout=300)
    worst = 0.0
    for pid, prompt in zip(ids, prompts, strict=True):
        b = stack.results[pid]
        rows = [i for i, p in enumerate(b.prompt_ids) if p == pid]
        assert len(rows) == 2
        responses, lps = b.split_responses(), b.split_logprobs()
        ep = b.episodes
        masks = torch.as_tensor(ep.action_mask).split(b.response_lengths)
        for i in rows:
            assert b.prompt_token_ids[i] == prompt and ep.turns[i] == 3 and ep.rewards[i] == 3.0
            assert b.policy_versions[i] == v and ep.logs[i] == {"turn": 3.0}
            resp, lp, mask = responses[i].tolist(), lps[i], masks[i].bool()
            # actions (each up to 12 tokens, a stop token kept where it stopped) and " ok" twice
            segments, k = [], 0
            while k < len(resp):
                j = k
                while j < len(resp) and bool(mask[j]) == bool(mask[k]):
                    j += 1
                segments.append((bool(mask[k]), resp[k:j]))
                k = j
            assert [m for m, _ in segments] == [True, False, True, False, True], segments
            assert segments[1][1] == feedback and segments[3][1] == feedback
            for _, action in segments[0::2]:
                assert len(action) == 12 or action[-1] in STOP, action
            want = torch.tensor(hf_logprobs(stack.model, prompt, resp))
            diff = (lp[mask] - want[mask]).abs().max().item()
            worst = max(worst, diff)
            assert (lp[~mask] == 0).all()
    print(f"agent episodes: learner vs vLLM log-probs of the action tokens, max |diff| {worst:.2e}")
    assert worst < 1e-4
    after = stack.client.call("ra", P.GetHealth()).stats
    later = after["agent_later_turn_tokens"] - before["agent_later_turn_tokens"]
    cached = after["agent_later_turn_cached"] - before["agent_later_turn_cached"]
    print(f"agent episodes: later turns' prefix-cache hit {cached / later:.2f} of {later:.0f} tokens")
    assert cached / later > 0.5


def test_in_flight_samples_keep_running_and_say_which_version_started_them(stack):
    """An update lands while samples are being generated: they are kept (not aborted), finish on
    the new weights (vLLM's per-token versions show both), and carry the version that sampled
    their first token."""
    v = stack.pool.policy_version
    sampling = P.SamplingParams(temperature=1.0, max_new_tokens=240, seed=3)
    ids = list(range(300, 308))
    prompts = [[1, 40 + i, 41, 42] for i in range(len(ids))]

    def in_flight() -> float:
        return sum(stack.client.call(n, P.GetHealth()).stats["in_flight"] for n in ("ra", "rb"))

    across_before = sum(stack.client.call(n, P.GetHealth()).stats["samples_across_updates"] for n in ("ra", "rb"))
    # The pause must find samples still generating. On a host busy with other tests, this
    # process can get the CPU back only after every sample has finished (seen under two test
    # workers): then the samples are collected and the batch is sent again, under new ids.
    for _ in range(3):
        assert not stack.client.submit(ids, prompts, sampling, policy_version=v)
        stack.wait_until(lambda: in_flight() > 0, "prompts in flight")
        t = time.monotonic() + 0.05
        while time.monotonic() < t:  # their first tokens: one engine step (a whole sample: ~0.6 s here)
            stack.pump(0.01)
        # Paused (vLLM's "keep"), the samples stop where they are: the update lands mid-sample on a
        # host of any speed (a fixed wait raced the 240 tokens on a fast one), and resumes them.
        for name in ("ra", "rb"):
            stack.client.call(name, P.Pause())
        if in_flight() > 0:
            break
        for name in ("ra", "rb"):
            stack.client.call(name, P.Resume())
        stack.wait_results(ids, timeout=300)
        ids = [pid + 10_000 for pid in ids]  # ids no other test of this module uses
    else:
        raise AssertionError("every sample finished before the pause, 3 times: lengthen them for this machine")
    try:
        perturb(stack.model, seed=v + 1)
        stack.fleet.push(v + 1)
    finally:  # a failed push leaves the servers serving for the tests after this one
        for name in ("ra", "rb"):
            stack.client.call(name, P.Resume())
    stack.wait_results(ids, timeout=300)
    versions = {}
    for pid in ids:
        (s,) = samples_of(stack.results[pid], pid)
        assert s["finish"] in ("stop", "length"), "kept across the update, not aborted"
        versions[pid] = s["version"]
    assert set(versions.values()) <= {v, v + 1} and v in versions.values()
    across = sum(stack.client.call(n, P.GetHealth()).stats["samples_across_updates"] for n in ("ra", "rb"))
    assert across > across_before, "no sample was generating when the update landed"
    (s,) = _run(stack, [[1, 40, 41, 42]], sampling, first_id=320, version=v + 1)[320]
    assert s["version"] == v + 1


def test_bad_requests_get_an_error_and_the_server_keeps_serving(stack):
    stack.errors.clear()
    ra = b"ra"
    stack.ep.sock.send_multipart([ra, b"\x99", b"junk"], copy=True)  # not a message at all
    vocab = stack.model.config.vocab_size
    stack.ep.send(P.PromptBatch(prompt_ids=[9001, 9002], token_ids=[[1, vocab + 5], [1, 2, 3]], sampling=GREEDY), to=ra)
    stack.ep.send(P.PromptBatch(prompt_ids=[9003], token_ids=[[5] * 256], sampling=GREEDY), to=ra)  # = max_model_len
    stack.wait_until(lambda: {9001, 9003} <= {p for e in stack.errors for p in e.prompt_ids}, "errors for bad prompts")
    assert any(e.code == "bad_request" and not e.prompt_ids for e in stack.errors), "garbage frames answered"
    for e in stack.errors:
        if e.prompt_ids:
            assert e.code == "bad_request" and ("vocabulary" in e.message or "max_model_len" in e.message)
    stack.wait_results([9002])  # the good prompt of the same batch was served
    for msg, code in (
        (P.Hello(role="rollout", name="x"), "bad_request"),
        (P.WeightUpdate(names=["a"], dtype_names=["float32"], shapes=[[1]]), "bad_request"),
        (P.WeightSyncInit(backend="nccl"), "bad_request"),
    ):
        with pytest.raises(RemoteError) as err:
            stack.client.call("ra", msg, timeout=30)
        assert err.value.error.code == code, err.value
    got = _run(stack, PROMPTS[:1], GREEDY, first_id=9100, version=stack.pool.policy_version, to="ra")
    _assert_parity(stack.model, PROMPTS[:1], got, stack.pool.policy_version)
    assert stack.client.call("ra", P.GetHealth()).state == "serving"


def test_pause_resume_health_and_sleep_not_supported_on_cpu(stack):
    stack.client.call("ra", P.Pause())
    assert stack.client.call("ra", P.GetHealth()).state == "paused"
    stack.ep.send(P.PromptBatch(prompt_ids=[9200], token_ids=[[1, 2, 3]], sampling=GREEDY), to=b"ra")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        stack.pump(0.1)
    assert 9200 not in stack.results
    assert stack.client.call("ra", P.GetHealth()).stats["waiting"] == 1
    stack.client.call("ra", P.Resume())
    stack.wait_results([9200])
    with pytest.raises(RemoteError, match="not supported") as err:
        stack.client.call("ra", P.Sleep(level=1))
    assert err.value.error.code == "not_supported"


def test_work_spreads_and_a_killed_server_loses_exactly_its_prompts(stack):
    v = stack.pool.policy_version
    sampling = P.SamplingParams(temperature=1.0, max_new_tokens=150, seed=7)
    ids = list(range(400, 412))
    prompts = [[1, 60 + i, 61, 62] for i in range(len(ids))]
    assert not stack.client.submit(ids, prompts, sampling, policy_version=v)
    held = {n: set(stack.client.peer(n).in_flight) for n in ("ra", "rb")}
    assert held["ra"] and held["rb"], f"work not spread: {held}"
    rb = next(s for s in stack.servers if s.name == "rb")
    rb.kill()  # SIGKILL: no goodbye; the pool notices by heartbeat silence
    t0 = time.monotonic()
    lost = []
    while not lost:
        assert time.monotonic() - t0 < 60, "the controller never declared rb dead"
        stack.pump(0.1, allow_dead=("rb",))
        lost = [lw for lw in stack.client.reap() if lw.peer.name == "rb"]
    keys = set(lost[0].keys)
    returned_by_rb = {pid for pid in held["rb"] if pid in stack.results and stack.results[pid].server == "rb"}
    assert keys == held["rb"] - returned_by_rb and keys, (keys, held, returned_by_rb)
    assert stack.client.servers() == ["ra"]
    # ra kept serving its share, and takes rb's lost prompts when they are re-issued.
    retry = sorted(keys)
    assert not stack.client.submit(retry, [prompts[ids.index(p)] for p in retry], sampling, policy_version=v)
    stack.wait_results(ids, allow_dead=("rb",), timeout=300)
    assert all(stack.results[p].server == "ra" for p in retry)
    assert all(stack.results[p].server == "ra" for p in held["ra"])


def _group_gone(server: Server, timeout: float) -> bool:
    """True once no process of ``server``'s process group (its engine's included) is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(server.proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


ENGINE_KILLED = ("force killing", "leaked shared_memory")  # vLLM's and the resource tracker's words


def test_a_server_waiting_for_a_controller_stops_on_sigterm_with_its_engine(stack):
    """rd has said Hello, for minutes, to an address where no controller listens. SIGTERM to its
    process group (what launch.local and Slurm send) ends it at once: the stop is logged as a
    requested one, its engine stops cleanly (its processes exit on their own, vLLM kills
    nothing), and the exit code is 143. (Before, the signal was noted and never acted on: the
    engine died of it and the server said Hello until SIGKILLed.)"""
    rd = next(s for s in stack.servers if s.name == "rd")
    stack.wait_until(lambda: "engine ready" in rd.log_tail(10**6), "rd's engine start", timeout=600)
    t0 = time.monotonic()
    rd.kill(signal.SIGTERM)
    while "rd stopping on SIGTERM" not in rd.log_tail(10**6):
        assert time.monotonic() - t0 < 10, rd.log_tail()
        time.sleep(0.1)
    assert rd.proc.wait(120) == 143
    assert _group_gone(rd, 60), "rd's engine processes outlived it"
    log = rd.log_tail(10**7)
    assert "rd stopping on SIGTERM (no controller had welcomed it)" in log, log[-4000:]
    for fault in (" ERROR ", "Traceback", "EngineDeadError", *ENGINE_KILLED):
        assert fault not in log, log[-4000:]


def test_a_server_joining_after_updates_gets_the_current_weights_before_work(stack):
    v = stack.pool.policy_version
    assert v >= 1
    stack.ep.sock.bind(f"tcp://127.0.0.1:{stack.late_port}")  # rc can reach the controller now
    stack.wait_joined(["rc"], timeout=600)
    health = stack.client.call("rc", P.GetHealth())
    assert health.policy_version == v and health.stats["prompts"] == 0  # synced, and nothing served before
    got = _run(stack, PROMPTS, GREEDY, first_id=500, version=v, to="rc")
    _assert_parity(stack.model, PROMPTS, got, v)  # the current weights, not the checkpoint it loaded


def _agent_round(stack, labels, first_id, agent, sampling):
    """``labels``' episodes on rc in one batch; (seconds until every "ok" one came back, the
    errors of the others by prompt id)."""
    ids = list(range(first_id, first_id + len(labels)))
    prompts = [PREFIX[:30] + [300 + i % 50] for i in range(len(labels))]
    batch = P.PromptBatch(
        prompt_ids=ids,
        token_ids=prompts,
        sampling=sampling,
        policy_version=stack.pool.policy_version,
        agent=agent,
        labels=list(labels),
    )
    t0 = time.monotonic()
    stack.ep.send(batch, to=b"rc")
    healthy = [i for i, lab in zip(ids, labels, strict=True) if lab == "ok"]
    try:
        stack.wait_results(healthy, timeout=300)
    except TimeoutError as e:  # say what rc said about them
        rc = next(s for s in stack.servers if s.name == "rc")
        said = [line for line in rc.log_tail(200_000).splitlines() if "env" in line or "prompt" in line]
        errors = [e.message for e in stack.errors if e.prompt_ids and e.prompt_ids[0] in ids]
        raise AssertionError(f"{e}; errors {errors}; rc's log:\n" + "\n".join(said[-40:])) from None
    took = time.monotonic() - t0
    faulty = {i for i, lab in zip(ids, labels, strict=True) if lab != "ok"}

    def errors() -> dict[int, str]:
        return {e.prompt_ids[0]: e.message for e in stack.errors if e.prompt_ids and e.prompt_ids[0] in faulty}

    stack.wait_until(lambda: set(errors()) == faulty, "the faulty episodes' errors", timeout=120)
    return took, errors()


def test_environment_faults_in_worker_processes_fail_only_their_episodes(stack):
    """rc runs tests/helpers/agent_env_faults.py in 2 environment worker processes
    (--agent_env_workers 2, 1500 MiB each): episodes whose step hangs, segfaults its worker,
    allocates without bound or calls sys.exit run beside healthy ones on the real engine. Each
    faulty prompt is answered with an agent_failed error naming why; every healthy one completes,
    and their time is measured against a batch without faults; rc's heartbeat counts the dead
    workers and, once they are replaced, its full capacity again."""
    if "rc" not in stack.client.servers(ready_only=True):  # run alone (-k): rc joins here
        stack.ep.sock.bind(f"tcp://127.0.0.1:{stack.late_port}")
        stack.wait_joined(["rc"], timeout=600)
    agent = P.AgentParams(agent=stack.client.peer("rc").capabilities.agent, max_len=120, step_timeout_s=3.0)
    sampling = P.SamplingParams(n=1, temperature=1.0, max_new_tokens=16, seed=3, logprobs=True)
    healthy = 48
    first = 20_000  # ids no other test of this module uses
    _agent_round(stack, ["ok"] * healthy, first, agent, sampling)  # warm-up: the first episodes' costs out
    before = stack.client.call("rc", P.GetHealth()).stats
    clean, _ = _agent_round(stack, ["ok"] * healthy, first + 100, agent, sampling)
    faults = ["hang", "segv", "leak", "exit"]
    labels = ["ok"] * healthy + faults
    with_faults, errors = _agent_round(stack, labels, first + 200, agent, sampling)
    print(
        f"environment faults: {healthy} healthy episodes in {clean:.2f} s alone, {with_faults:.2f} s beside a hang, a "
        f"segfault, a leak and an exit ({clean / with_faults:.2f} of the throughput)"
    )
    why = {lab: errors[first + 200 + healthy + k] for k, lab in enumerate(faults)}
    said = " ".join(why.values())
    # A worker that dies with two episodes in their environment code (the hang awaits forever in
    # its step; the exit may be in the segfault's worker) cannot tell which killed it: both are
    # re-run, and the one there at the second death fails with that death's reason. (sys.exit's
    # own reason, alone in its worker, is test_env_pool's.)
    assert "sys.exit(3)" in why["exit"] or "died under this episode" in why["exit"], said
    assert "--agent_step_timeout_s" in why["hang"] or "died under this episode" in why["hang"], said
    # Each fails with a reason; on a loaded host (a CI run) a step of the segfault's or the leak's
    # worker outlasted the 3 s step timeout first, and the step timeout was their reason.
    reasons = ("SIGSEGV", "--agent_env_worker_memory_mb 1500", "--agent_step_timeout_s", "died under this episode")
    assert all(any(r in why[f] for r in reasons) for f in ("segv", "leak")), said
    for i in range(first + 200, first + 200 + healthy):  # every healthy one: two actions, reward 2
        b = stack.results[i]
        row = b.prompt_ids.index(i)
        assert b.episodes.turns[row] == 2 and b.episodes.rewards[row] == 2.0

    def stats() -> dict:
        return stack.client.call("rc", P.GetHealth()).stats

    stack.wait_until(lambda: stats()["env_workers_live"] == 2, "rc's environment workers replaced", timeout=120)
    after = stats()
    assert after["env_worker_deaths"] - before["env_worker_deaths"] >= 2  # the segfault and the leak
    assert after["failed_episodes"] - before["failed_episodes"] == 4
    assert after["capacity"] == stack.client.peer("rc").capabilities.capacity  # its Hello's: every worker up


def test_a_lora_adapter_is_served_by_vllm_and_pushes_after_the_first_send_it_alone(stack):
    """--lora_sync adapter on the real engine: rc (started with --enable_lora) gets a LoRA
    learner's base weights and adapter in its first push, the adapter alone in the next; each
    time its greedy tokens and log-probs equal the fp32 PeftModel's, samples carry the version
    of their adapter, and the replaced adapter is gone from the engine and from disk. ra,
    started without --enable_lora, answers an adapter push with an error naming the flag and
    serves on. (A publisher of its own: rc leaves the stack's weight group for this one's.)"""
    import copy

    from peft import LoraConfig, get_peft_model

    from common.weights.publisher import WeightPublisher

    v = stack.pool.policy_version
    target = ["q_proj", "v_proj", "down_proj"]
    peft_model = get_peft_model(copy.deepcopy(stack.model), LoraConfig(r=8, lora_alpha=16, target_modules=target))
    gen = torch.Generator().manual_seed(5)

    def train_adapter():  # B nonzero (peft starts it at 0): the adapter moves the answers
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if ".lora_B." in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)

    caps = stack.client.peer("rc").capabilities
    assert caps.max_lora_rank == 8 and stack.client.peer("ra").capabilities.max_lora_rank == 0
    pub = WeightPublisher(peft_model, control=stack.client, backend="gloo", timeout_s=60.0, lora_sync="adapter")
    pub.connect("rc", workers=caps.workers, dtype=caps.dtype)
    try:
        base_answers = [hf_greedy(stack.model, p, GREEDY.max_new_tokens, STOP)[0] for p in PROMPTS]
        moved = False
        for version, first_id in ((v + 1, 600), (v + 2, 620)):
            train_adapter()
            report = pub.push(version)
            assert report.updated == ["rc"] and not report.failed
            whole = version == v + 1
            assert (report.bytes_per_server > 10 * pub.adapter.nbytes()) == whole, report
            got = _run(stack, PROMPTS, GREEDY, first_id=first_id, version=version, to="rc")
            _assert_parity(peft_model.eval(), PROMPTS, got, version)
            moved |= [g[0]["tokens"] for g in got.values()] != base_answers
        assert moved, "the adapter changed no greedy answer: the parity above would not tell it was served"
        health = stack.client.call("rc", P.GetHealth())
        assert health.stats["adapters"] == 2 and health.state == "serving"
        assert [f.name for f in stack.rc_lora_dir.iterdir()] == ["adapter-2"]  # adapter-1: removed
    finally:
        pub.close()
    with pytest.raises(RemoteError, match="started without --enable_lora") as err:
        stack.client.call("ra", P.WeightUpdateStart(policy_version=v + 9, adapter_only=True), timeout=30)
    assert err.value.error.code == "bad_request"
    assert stack.client.call("ra", P.GetHealth()).state == "serving"


def test_a_delta_push_lands_in_the_real_engine_bit_for_bit(stack):
    """--weight_sync delta on the real engine: a publisher of its own gives rc a full push, then
    a delta of a few values of two weights; the worker extension decodes it into its copy,
    checks the digests and loads every tensor through vLLM's layerwise reload, and rc's greedy
    tokens and log-probs equal transformers' for the changed model (which answers differently
    from before). (rc leaves the stack's weight group for this one's, as in the LoRA test.)"""
    import copy

    from common.weights.publisher import WeightPublisher

    if "rc" not in stack.client.servers(ready_only=True):  # run alone (-k): rc joins here
        stack.ep.sock.bind(f"tcp://127.0.0.1:{stack.late_port}")
        stack.wait_joined(["rc"], timeout=600)
    v = stack.pool.policy_version
    model = copy.deepcopy(stack.model)
    caps = stack.client.peer("rc").capabilities
    pub = WeightPublisher(model, control=stack.client, backend="gloo", timeout_s=60.0, sync="delta")
    pub.connect("rc", workers=caps.workers, dtype=caps.dtype)
    try:
        assert pub.push(v + 1).sync.encoding == "full"
        before = [hf_greedy(model, p, GREEDY.max_new_tokens, STOP)[0] for p in PROMPTS]
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[:, :4] += torch.randn(
                model.model.layers[0].mlp.down_proj.weight[:, :4].shape, generator=gen
            )
            model.model.norm.weight[:16] *= 3.0
        report = pub.push(v + 2)
        assert report.updated == ["rc"] and report.sync.encoding == "delta" and report.sync.sparse == 2, report
        assert report.bytes_per_server < pub.source.nbytes() / 20
        got = _run(stack, PROMPTS, GREEDY, first_id=740, version=v + 2, to="rc")
        _assert_parity(model.eval(), PROMPTS, got, v + 2)
        assert [g[0]["tokens"] for g in got.values()] != before, "the change moved no answer: parity would not show it"
    finally:
        pub.close()


def test_a_server_shut_down_by_the_controller_leaves_no_fault_in_its_log(stack):
    """What a user reads after a normal run: ra, which took weight pushes and served prompts, is
    told to shut down and exits 0, and its log has neither vLLM's rotary-embedding reload warning
    (once per layer per push before) nor an EngineDeadError traceback from the engine's output
    handler at the stop (common/vllm_quiet.py). Last: ra serves nothing after it."""
    if stack.pool.policy_version == 0:  # run alone: one push, for the reload warning to have its chance
        perturb(stack.model, seed=9)
        stack.fleet.push(1)
    _run(stack, PROMPTS[:1], GREEDY, first_id=700, version=stack.pool.policy_version, to="ra")  # the handler runs
    ra = next(s for s in stack.servers if s.name == "ra")
    ra.killed = True  # it is meant to exit: the harness's liveness checks leave it be
    assert isinstance(stack.client.call("ra", P.Shutdown(reason="the run is over")), P.Ack)
    assert ra.proc.wait(120) == 0
    log = ra.log_tail(10**7)
    assert "shutdown requested by the controller" in log, log[-4000:]
    assert re.search(r"served \d+ prompt\(s\), \d+ sample\(s\), [1-9]\d* weight update\(s\)", log), log[-4000:]
    assert _group_gone(ra, 60), "ra's engine processes outlived it"
    log = ra.log_tail(10**7)  # again: the resource tracker speaks last
    # nor a fault at the stop: vLLM killed no process of an engine still exiting (common/vllm_quiet.py)
    for fault in ("Failed to load weights", "EngineDeadError", "output_handler failed", *ENGINE_KILLED):
        assert fault not in log, log[-4000:]


def test_a_server_whose_engine_dies_while_the_controller_is_gone_exits_1(stack):
    """The controller goes away (its socket closes, as a killed learner's does): rc, which served
    until then, waits for it to come back. Its EngineCore is killed meanwhile: rc ends within
    seconds, exit 1, saying so in one error line -- it does not wait --reconnect_timeout_s
    (1800 s) for a controller to hand work to an engine that is gone. Last: it ends the stack."""
    import psutil

    rc = next(s for s in stack.servers if s.name == "rc")
    stack.ep.close(0)  # the controller is gone; the fixture's close closes it again, harmlessly
    t0 = time.monotonic()
    while "rc: the controller at" not in rc.log_tail(10**6):  # "... is gone (...); reconnecting"
        assert time.monotonic() - t0 < 60 and rc.proc.poll() is None, rc.log_tail()
        time.sleep(0.2)
    (engine,) = [p for p in psutil.Process(rc.proc.pid).children() if "EngineCore" in p.name()]
    rc.killed = True
    engine.kill()
    assert rc.proc.wait(60) == 1
    log = rc.log_tail(10**7)
    assert "ERROR common.service: announcing fatal: rc: vLLM engine died (see its log above)" in log, log[-4000:]
    assert "still waiting for the controller" not in log
