"""The controller's data path with in-process fake services: routing, groups, re-issue.

Real vLLM and reward processes are exercised in the end-to-end tests; here the services are
threads speaking the real protocol over real sockets, so the fault cases are quick and exact.
"""

import contextlib
import threading
import time

import pytest
import torch

from common import protocol as P
from common.transport import Endpoint, handshake
from learner.controller.controller import Controller, ServicesMissing
from learner.controller.ledger import LedgerError, PromptLedger
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.scoring import EpisodeScoring
from learner.controller.types import PromptItem


class FakeService(threading.Thread):
    """A rollout or reward service: answers work until stopped; `die()` = silent SIGKILL."""

    def __init__(
        self,
        address,
        name,
        role,
        capacity=4,
        hold=False,
        agent=False,
        fail_episodes=(),
        fail_always=False,
        unrewarded=(),
    ):
        super().__init__(daemon=True)
        self.agent = agent  # answer PromptBatches as agent episodes (see _episodes)
        self.unrewarded = set(unrewarded)  # sample indices whose episodes leave their reward to the service (None)
        self.fail_episodes = set(fail_episodes)  # prompt ids whose episodes fail, the first time each
        self.fail_always = fail_always  # ... or every time
        self.batches: list[P.PromptBatch] = []
        self.score_prompts: list[list[int]] = []  # prompt tokens of each sample a ScoreRequest carried
        self.score_logprobs: list = []  # each ScoreRequest's sampler log-probs (None: not sent)
        self.ep = Endpoint.connect(address, name=name)
        self.name, self.role, self.capacity = name, role, capacity
        self.hold = hold  # take work and never answer (a hung server)
        self.stop = threading.Event()
        self.seen: list[int] = []
        self.seeds: list[tuple[int, int | None]] = []  # (prompt id, PromptBatch.seeds entry or None)
        self.shutdown_reason: str | None = None

    def run(self):
        caps = P.RolloutCapabilities if self.role == "rollout" else P.RewardCapabilities
        handshake(self.ep, self.role, caps(capacity=self.capacity), timeout=5)
        last_hb = 0.0
        while not self.stop.is_set():
            if time.monotonic() - last_hb > 0.2 and not self.hold:
                self.ep.send(P.Heartbeat(name=self.name))
                last_hb = time.monotonic()
            got = self.ep.recv(timeout=0.05)
            if got is None:
                continue
            _, msg = got
            if isinstance(msg, P.PromptBatch):
                self.seen += msg.prompt_ids
                self.seeds += zip(msg.prompt_ids, msg.seeds or [None] * len(msg.prompt_ids), strict=True)
                self.batches.append(msg)
                if self.hold:
                    continue
                if self.agent:
                    for pid in [p for p in msg.prompt_ids if p in self.fail_episodes]:
                        if not self.fail_always:
                            self.fail_episodes.discard(pid)
                        err = P.Error(code="agent_failed", message=f"prompt {pid}: step() returned no 'done'")
                        self.ep.send(P.Error(code=err.code, message=err.message, prompt_ids=[pid]))
                        msg = _without(msg, pid)
                    if msg.prompt_ids:
                        self.ep.send(self._episodes(msg))
                    continue
                n = msg.sampling.n
                pids = [p for p in msg.prompt_ids for _ in range(n)]
                idx = [i for _ in msg.prompt_ids for i in range(n)]
                # response of sample i of prompt p: [p, i] ; logprob -0.5 each
                ids = torch.tensor([[p, i] for p, i in zip(pids, idx, strict=True)]).reshape(-1)
                self.ep.send(
                    P.SampleBatch(
                        prompt_ids=pids,
                        sample_indices=idx,
                        response_lengths=[2] * len(pids),
                        response_ids=ids,
                        logprobs=torch.full((ids.numel(),), -0.5),
                        finish_reasons=["stop"] * len(pids),
                        policy_versions=[0] * len(pids),
                        server=self.name,
                    )
                )
            elif isinstance(msg, P.ScoreRequest):
                s = msg.samples
                self.seen += s.prompt_ids
                self.score_prompts += [list(t) for t in s.prompt_token_ids or []]
                self.score_logprobs.append(s.logprobs)
                rewards = torch.tensor([float(i) for i in s.sample_indices])  # reward = sample index
                failed = [("bad label" if lab == "poison" else None) for lab in msg.labels]
                self.ep.reply(
                    msg,
                    P.ScoredBatch(
                        prompt_ids=s.prompt_ids,
                        sample_indices=s.sample_indices,
                        rewards=rewards,
                        # the ids halved: [1, 1] -> [0.5, 0.5] (a ScoreRequest carries no sampler log-probs)
                        ref_logprobs=torch.as_tensor(s.response_ids).float() / 2,
                        failed=failed,
                        server=self.name,
                        teacher_logprobs=-torch.as_tensor(s.response_ids).float(),  # the ids negated
                    ),
                )
            elif isinstance(msg, P.Shutdown):
                self.shutdown_reason = msg.reason
                if not self.hold:
                    self.ep.reply(msg, P.Ack())
                    break
        self.ep.close(0)

    def die(self):
        self.stop.set()

    def _episodes(self, msg: P.PromptBatch) -> P.SampleBatch:
        """Sample i of prompt p: the episode's prompt is the prompt + [55] (its environment
        rewrote the first observation); response [p, 900, 901, i]: an action, two environment
        tokens, an action (mask 1 0 0 1); log-probs -0.5 on actions, 0 on the environment;
        2 turns; reward i + 0.5 (None for an index in ``unrewarded``), score i, one extra log."""
        n = msg.sampling.n
        rows = [(p, toks, i) for p, toks in zip(msg.prompt_ids, msg.token_ids, strict=True) for i in range(n)]
        return P.SampleBatch(
            prompt_ids=[p for p, _, _ in rows],
            sample_indices=[i for _, _, i in rows],
            response_lengths=[4] * len(rows),
            response_ids=torch.tensor([[p, 900, 901, i] for p, _, i in rows]).reshape(-1),
            logprobs=torch.tensor([[-0.5, 0.0, 0.0, -0.5] for _ in rows]).reshape(-1),
            finish_reasons=["stop"] * len(rows),
            policy_versions=[0] * len(rows),
            prompt_token_ids=[[*toks, 55] for _, toks, _ in rows],
            server=self.name,
            episodes=P.EpisodeOutputs(
                action_mask=torch.tensor([[1, 0, 0, 1] for _ in rows], dtype=torch.uint8).reshape(-1),
                rewards=[None if i in self.unrewarded else i + 0.5 for _, _, i in rows],
                scores=[None if i in self.unrewarded else float(i) for _, _, i in rows],
                turns=[2] * len(rows),
                logs=[{"tries": 2.0}] * len(rows),
            ),
        )


def _without(msg: P.PromptBatch, pid: int) -> P.PromptBatch:
    keep = [i for i, p in enumerate(msg.prompt_ids) if p != pid]
    return P.PromptBatch(
        prompt_ids=[msg.prompt_ids[i] for i in keep],
        token_ids=[msg.token_ids[i] for i in keep],
        sampling=msg.sampling,
        agent=msg.agent,
        labels=[msg.labels[i] for i in keep] if msg.labels else [],
    )


@pytest.fixture
def ctrl():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=1.0, needs_preparation=())
    ledger = PromptLedger(generate_timeout_s=30, score_timeout_s=30)
    c = Controller(
        RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(n=2, max_new_tokens=4), max_prompts_per_request=2
    )
    services = []
    yield c, services
    for s in services:
        s.die()
    ep.close(0)


def start(c, services, name, role, **kw):
    s = FakeService(c.endpoint.address, name, role, **kw)
    s.start()
    services.append(s)
    return s


def items(n, label="x"):
    return [PromptItem(tokens=[100 + i, 7], text=f"p{i}", label=label) for i in range(n)]


def test_collect_builds_complete_groups_in_order(ctrl):
    c, services = ctrl
    start(c, services, "r0", "rollout")
    start(c, services, "rw0", "reward")
    c.wait_for_services(1, 1, timeout_s=10)
    res = c.collect(items(5), timeout_s=20)
    r = res.rollout
    assert len(r) == 10 and r.group_size == 2
    assert [(s.prompt_id, s.sample_index) for s in r.samples] == [(p, i) for p in range(5) for i in range(2)]
    s = r.samples[3]
    assert s.prompt == [101, 7] and s.response.tolist() == [1, 1] and s.reward == 1.0
    assert s.rollout_logprobs.tolist() == [-0.5, -0.5] and s.ref_logprobs.tolist() == [0.5, 0.5]
    rw = next(s for s in services if s.name == "rw0")
    assert rw.score_logprobs and all(lp is None for lp in rw.score_logprobs)  # tokens are what gets scored
    assert c.ledger.counters["trained"] == 5 and len(c.ledger) == 0


def test_killed_rollout_server_work_is_reissued_once(ctrl):
    c, services = ctrl
    hung = start(c, services, "r-hung", "rollout", capacity=100, hold=True)  # takes work, never answers
    start(c, services, "rw0", "reward")
    c.wait_for_services(1, 1, timeout_s=10)
    c.pump(0.1)
    good = start(c, services, "r-good", "rollout", capacity=2)
    res = c.collect(items(6), timeout_s=30)
    assert len(res.rollout) == 12
    assert hung.seen, "the hung server should have been handed prompts"
    lost = set(hung.seen)
    assert lost <= set(good.seen), "every prompt the dead server held was re-issued"
    assert c.ledger.counters["reissued"] >= len(lost)
    assert c.pool.counters["died"] == 1
    # each prompt trained once
    assert sorted({s.prompt_id for s in res.rollout.samples}) == list(range(6))


def test_a_prompt_keeps_its_seed_on_every_server_and_retry(ctrl):
    """PromptItem.seed travels as PromptBatch.seeds, the same on the server that re-takes a dead
    server's prompt; seeded and unseeded prompts of one collect go in separate batches."""
    c, services = ctrl
    hung = start(c, services, "r-hung", "rollout", capacity=100, hold=True)
    start(c, services, "rw0", "reward")
    c.wait_for_services(1, 1, timeout_s=10)
    c.pump(0.1)
    good = start(c, services, "r-good", "rollout", capacity=2)
    its = items(6)
    for i in (0, 2, 3, 5):
        its[i].seed = 1000 * i + 7
    res = c.collect(its, timeout_s=30)
    assert len(res.rollout) == 12 and set(hung.seen) and set(hung.seen) <= set(good.seen)
    want = {pid: (1000 * pid + 7 if pid in (0, 2, 3, 5) else None) for pid in range(6)}
    assert all(seed == want[pid] for pid, seed in hung.seeds + good.seeds), (hung.seeds, good.seeds)


def test_failed_scores_drop_the_group_and_are_counted(ctrl):
    c, services = ctrl
    start(c, services, "r0", "rollout")
    start(c, services, "rw0", "reward")
    c.wait_for_services(1, 1, timeout_s=10)
    its = items(3)
    its[1].label = "poison"
    res = c.collect(its, timeout_s=20)
    assert res.failed_groups == 1 and res.reasons == ["bad label"]
    assert sorted({s.prompt_id for s in res.rollout.samples}) == [0, 2]


def test_missing_services_error_is_clear(ctrl):
    c, _ = ctrl
    with pytest.raises(RuntimeError, match=r"only 0/1 rollout server\(s\) and 0/1 reward"):
        c.wait_for_services(1, 1, timeout_s=0.3)


def test_shutdown_waits_for_each_service_to_confirm_and_names_the_silent_one(ctrl):
    c, services = ctrl
    r = start(c, services, "r0", "rollout")
    w = start(c, services, "w0", "reward")
    hung = start(c, services, "r1", "rollout", hold=True)
    c.wait_for_services(2, 1, timeout_s=10)
    t0 = time.monotonic()
    assert c.shutdown_services("training finished", wait_s=1.0) == ["r1"]
    assert time.monotonic() - t0 < 5
    assert r.shutdown_reason == w.shutdown_reason == hung.shutdown_reason == "training finished"
    r.join(5)
    w.join(5)
    assert not r.is_alive() and not w.is_alive()  # they got it and exited


AGENT = P.AgentParams(agent="env.py:0123456789ab", max_len=64, max_turns=3, step_timeout_s=5.0)


def _agent_controller(
    scores_locally: bool, drop_failed: bool = False, max_attempts: int = 5, service_rewards: bool = False
):
    """``scores_locally``: KL off (no reference needed); ``service_rewards``: the run has a reward
    model or function (what build.sample_scoring reads from the flags)."""
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=1.0, needs_preparation=())
    c = Controller(
        RolloutClient(ep, pool),
        PromptLedger(generate_timeout_s=30, score_timeout_s=30, max_attempts=max_attempts),
        sampling=P.SamplingParams(n=2, max_new_tokens=4),
        max_prompts_per_request=2,
        agent=AGENT,
        scoring=EpisodeScoring(reference=not scores_locally, service_rewards=service_rewards),
        drop_failed_episodes=drop_failed,
    )
    return c, ep


def _check_episodes(samples, rollout_server):
    assert [(s.prompt_id, s.sample_index) for s in samples] == [(p, i) for p in range(3) for i in range(2)]
    s = samples[3]  # prompt 1, sample 1
    assert s.prompt == [101, 7, 55], "the episode's own prompt, not the dataset's"
    assert s.response.tolist() == [1, 900, 901, 1] and s.action_mask.tolist() == [True, False, False, True]
    assert s.reward == 1.5 and s.turns == 2  # the agent's reward, whatever a reward service says
    assert s.rollout_logprobs.tolist() == [-0.5, 0.0, 0.0, -0.5]
    batches = rollout_server.batches
    assert batches and all(b.agent == AGENT for b in batches)
    labels = {p: lab for b in batches for p, lab in zip(b.prompt_ids, b.labels, strict=True)}
    assert labels == {0: "x", 1: '{"answer": 1}', 2: ""}  # text as is, else JSON; none -> empty


def _agent_items():
    its = items(3)
    its[1].label = {"answer": 1}
    its[2].label = None
    return its


def test_agent_episodes_are_scored_by_their_agent_without_a_reward_service():
    """KL off: no reward service is asked; the agent's rewards, scores and logs are the episode's
    scores; each sample keeps its action mask and the prompt its environment started from."""
    c, ep = _agent_controller(scores_locally=True)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True)
    r.start()
    try:
        c.wait_for_services(1, 0, timeout_s=10)
        res = c.collect(_agent_items(), timeout_s=20)
        _check_episodes(res.rollout.samples, r)
        (e,) = [e for e in res.entries if e.prompt_id == 1]
        assert e.scores.scores.tolist() == [0.0, 1.0] and e.scores.extra_logs == {"tries": [2.0, 2.0]}
    finally:
        r.die()
        ep.close(0)


def test_agent_episodes_with_kl_go_to_the_reward_service_with_their_own_prompts():
    """KL on: the reward service scores the episodes (the reference's log-probs) on the prompt the
    episode started from; the reward stays the agent's."""
    c, ep = _agent_controller(scores_locally=False)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True)
    rw = FakeService(ep.address, "rw0", "reward")
    r.start()
    rw.start()
    try:
        c.wait_for_services(1, 1, timeout_s=10)
        res = c.collect(_agent_items(), timeout_s=20)
        _check_episodes(res.rollout.samples, r)
        assert sorted(map(tuple, rw.score_prompts)) == sorted((100 + p, 7, 55) for p in range(3) for _ in range(2))
        assert res.rollout.samples[3].ref_logprobs.tolist() == [0.5, 450.0, 450.5, 0.5]
        assert res.rollout.samples[3].teacher_logprobs.tolist() == [-1.0, -900.0, -901.0, -1.0]  # a teacher's too
    finally:
        r.die()
        rw.die()
        ep.close(0)


def test_an_episode_that_leaves_its_reward_to_the_reward_service_gets_the_services():
    """KL off, a reward model or function in the run: an episode returning reward None (sample 1
    of every prompt) is scored by the reward service (its reward: the sample index, 1.0); its
    sibling keeps its own (0.5) and so does the score it gave; prompts are sent with the
    episodes' own prompts."""
    c, ep = _agent_controller(scores_locally=True, service_rewards=True)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True, unrewarded={1})
    rw = FakeService(ep.address, "rw0", "reward")
    r.start()
    rw.start()
    try:
        c.wait_for_services(1, 1, timeout_s=10)
        res = c.collect(_agent_items(), timeout_s=20)
        assert [s.reward for s in res.rollout.samples] == [0.5, 1.0] * 3
        (e,) = [e for e in res.entries if e.prompt_id == 1]
        assert e.scores.scores.tolist() == [0.0, 1.0]  # the episode's own score, the service's reward
        assert sorted(map(tuple, rw.score_prompts)) == sorted((100 + p, 7, 55) for p in range(3) for _ in range(2))
    finally:
        r.die()
        rw.die()
        ep.close(0)


def test_an_episode_without_a_reward_in_a_run_without_a_reward_model_fails_its_group_naming_the_flags():
    c, ep = _agent_controller(scores_locally=True, service_rewards=False)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True, unrewarded={1})
    r.start()
    try:
        c.wait_for_services(1, 0, timeout_s=10)
        res = c.collect(_agent_items(), timeout_s=20)
        assert res.failed_groups == 3 and res.rollout.samples == []
        assert "1 episode(s) returned reward None" in res.reasons[0]
        assert "pass --reward_pretrain or --remote_rm_url" in res.reasons[0]
    finally:
        r.die()
        ep.close(0)


@pytest.mark.parametrize("drop", [False, True])
def test_a_failed_episode_is_issued_again_or_dropped_as_the_flag_says(drop):
    """--agent_failure retry: the prompt whose episode failed comes back from the queue and the
    batch is whole; drop: its group is left out and counted, with the server's message."""
    c, ep = _agent_controller(scores_locally=True, drop_failed=drop)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True, fail_episodes={1})
    r.start()
    try:
        c.wait_for_services(1, 0, timeout_s=10)
        res = c.collect(_agent_items(), timeout_s=20)
        assert c.counters["failed_episodes"] == 1
        if drop:
            assert [e.prompt_id for e in res.entries] == [0, 2] and res.failed_groups == 1
            assert "agent episode failed: prompt 1: step() returned no 'done'" in res.reasons[0]
            assert c.ledger.counters["reissued"] == 0
        else:
            _check_episodes(res.rollout.samples, r)
            assert c.ledger.counters["reissued"] == 1 and res.failed_groups == 0
            assert r.seen.count(1) == 2  # the failed prompt was handed out twice
    finally:
        r.die()
        ep.close(0)


def test_a_prompt_answered_with_an_error_each_time_is_given_up_on_quoting_the_error():
    """Every episode of prompt 1 fails (--agent_failure retry): after its attempts the run
    stops saying the prompt came back with an error each time, and which, not that it never
    came back."""
    c, ep = _agent_controller(scores_locally=True, max_attempts=2)
    r = FakeService(ep.address, "agent-r0", "rollout", agent=True, fail_episodes={1}, fail_always=True)
    r.start()
    try:
        c.wait_for_services(1, 0, timeout_s=10)
        with pytest.raises(LedgerError) as got:
            c.collect(_agent_items(), timeout_s=20)
        msg = str(got.value)
        assert msg.startswith(
            "prompt 1 was handed out 2 times and answered with an error each time (the last: "
            "agent-r0 answered agent_failed: prompt 1: step() returned no 'done'); giving up"
        ), msg
        assert "never came back" not in msg
    finally:
        r.die()
        ep.close(0)


def test_a_service_the_run_refuses_stops_the_wait_for_services_at_once_naming_why():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    refuse = P.Error(code="bad_request", message="r0 runs agent none; this run's --agent_func_path env.py is ...")
    pool = ServicePool(ep, peer_timeout_s=1.0, admit=lambda hello: refuse if hello.role == "rollout" else None)
    ledger = PromptLedger(generate_timeout_s=30, score_timeout_s=30)
    c = Controller(RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(max_new_tokens=4))
    svc = Endpoint.connect(ep.address, name="r0")

    def hello():
        with contextlib.suppress(Exception):  # refused: what the test checks is the learner's side
            handshake(svc, "rollout", P.RolloutCapabilities(capacity=1), timeout=5)

    t = threading.Thread(target=hello, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ServicesMissing, match="refused at the handshake: r0: r0 runs agent none"):
            c.wait_for_services(1, 0, timeout_s=120)
        assert time.monotonic() - t0 < 30 and pool.alive() == []
    finally:
        t.join(10)
        svc.close(0)
        ep.close(0)
