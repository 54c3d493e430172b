"""Agent episodes in the rollout server, without vLLM: the episode loop, its checks, its failures.

A scripted engine (``helpers.agent_fakes``) answers each turn with known tokens and a character
tokenizer makes every environment text's tokens known by hand, so each test states the exact
sequence, mask and log-probs an episode must produce. The last tests run episodes through
``RolloutCore`` itself on the vLLM stand-in (``helpers.fake_llm``): the version gate, a weight
update in the middle of an episode, an abort. Real vLLM: ``test_rollout_service.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from common import protocol as P
from common.agent_file import agent_identity
from helpers.agent_fakes import CharTokenizer, ScriptedRequest, ids, same_params
from helpers.fake_llm import core_on_fake_llm
from rollout_service.agent import EpisodeError, TurnEngine, build_episode, load_agent, run_episode
from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor
from rollout_service.core import AgentFailed, BadRequest
from rollout_service.episodes import EpisodeRunner, InProcessAgent

EOS = CharTokenizer.eos_token_id


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class ThreeTurns(AgentInstanceBase):
    """Feedback "?1", "?2"; done after the third action; rewards 0.25, 0.5, 1.0 (as tensors for
    the last, as OpenRLHF's example returns them)."""

    seen: list[dict] = []

    async def reset(self, states, **kw):
        ThreeTurns.seen = [dict(states)]
        self.t = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kw):
        ThreeTurns.seen.append({k: v for k, v in states.items() if k != "sampling_params"})
        self.t += 1
        done = self.t == 3
        return {
            "rewards": torch.tensor([1.0]) if done else [0.25, 0.5][self.t - 1],
            "scores": 0.75 if done else None,
            "environment_feedback": "" if done else f"?{self.t}",
            "done": done,
            "sampling_params": None,
            "extra_logs": {"turn": torch.tensor(float(self.t)), "solved": done},
        }


def _episode(instance, actions, *, max_len=64, max_turns=0, cap=8, versions=None, timeout=5.0, prompt="ab"):
    req = ScriptedRequest(actions, versions)
    engine = TurnEngine(req, same_params, prompt_token_ids=ids(prompt), max_len=max_len, max_turns=max_turns)

    async def main():
        return await run_episode(
            MultiTurnAgentExecutor(instance),
            engine,
            prompt_text=prompt,
            label="L",
            sampling_params=SimpleNamespace(max_tokens=cap, logprobs=0),
            tokenizer=CharTokenizer(),
            step_timeout_s=timeout,
        )

    return run(main()), req


def test_three_turns_exact_tokens_mask_logprobs_and_summed_reward():
    # actions: "xy<eos>", "z<eos>", "w<eos>"; the stop token stays in the sequence
    acts = [[*ids("xy"), EOS], [*ids("z"), EOS], [*ids("w"), EOS]]
    ep, req = _episode(ThreeTurns, acts, versions=[4, 5, 5])
    want = [*acts[0], *ids("?1"), *acts[1], *ids("?2"), *acts[2]]
    assert ep.prompt == ids("ab") and ep.response == want
    assert ep.action_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    lp = [-0.1, -0.2, -0.3]  # vLLM's, per action; 0 on the environment's tokens
    assert ep.logprobs == pytest.approx([*lp, 0, 0, *lp[:2], 0, 0, *lp[:2]])
    # 0.25 + 0.5 + 1.0, summed as OpenRLHF does; the score is the last step's
    assert (ep.reward, ep.score, ep.turns, ep.finish_reason) == (1.75, 0.75, 3, "stop")
    assert ep.version == 4  # the first action's
    assert ep.extra_logs == {"turn": 3.0, "solved": 1.0}
    # each turn's input is the previous one plus the action plus the feedback
    assert [c[0] for c in req.calls] == [ids("ab"), [*ids("ab"), *want[:5]], [*ids("ab"), *want[:9]]]
    # what the environment saw: the prompt text and label at reset, each action's text
    assert ThreeTurns.seen[0] == {"observation": "ab", "label": "L"}
    assert [s["action_text"] for s in ThreeTurns.seen[1:]] == ["xy", "z", "w"]
    assert ThreeTurns.seen[2]["observation_text"] == "abxy?1"


def test_turn_limit_and_length_limit_cut_the_episode():
    acts = [[*ids("xy"), EOS], [*ids("z"), EOS], [*ids("w"), EOS]]
    ep, req = _episode(ThreeTurns, acts, max_turns=2)
    # two actions, the feedback after the last one dropped (nothing trained follows it)
    assert ep.turns == 2 and ep.finish_reason == "length"
    assert ep.response == [*acts[0], *ids("?1"), *acts[1]] and ep.reward == 0.75
    # --max_len 9: prompt 2 + "xy<eos>" 3 + "?1" 2 leaves 2 tokens: the second turn may generate 2
    # (not the per-turn cap of 8), then no room is left
    ep, req = _episode(ThreeTurns, [[*ids("xy"), EOS], [*ids("zzzz"), EOS]], max_len=9)
    assert [c[1] for c in req.calls] == [7, 2]
    assert ep.response == [*ids("xy"), EOS, *ids("?1"), *ids("zz")] and ep.finish_reason == "length"
    assert len(ep.prompt) + len(ep.response) == 9


def test_the_per_turn_cap_is_generate_max_len():
    ep, req = _episode(ThreeTurns, [[*ids("xyz"), EOS], [EOS], [EOS]], cap=2)
    assert [c[1] for c in req.calls] == [2, 2, 2]
    assert ep.response[:2] == ids("xy")


class Sync(AgentInstanceBase):
    """A blocking ``def step`` (the server runs it in a thread) that sleeps ``delay`` seconds."""

    delay = 0.0
    active = 0
    peak = 0
    lock = threading.Lock()

    async def reset(self, states, **kw):
        return states

    def step(self, states, **kw):  # plain def: run off the event loop
        with Sync.lock:
            Sync.active += 1
            Sync.peak = max(Sync.peak, Sync.active)
        time.sleep(Sync.delay)
        with Sync.lock:
            Sync.active -= 1
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


def test_blocking_steps_overlap_each_other_and_the_event_loop():
    Sync.delay, Sync.peak = 0.2, 0

    async def main():
        async def one():
            engine = TurnEngine(ScriptedRequest([[EOS]]), same_params, prompt_token_ids=[1], max_len=8)
            ex = MultiTurnAgentExecutor(Sync)
            sp = SimpleNamespace(max_tokens=2, logprobs=0)
            return await run_episode(
                ex, engine, prompt_text="x", label="", sampling_params=sp, tokenizer=CharTokenizer(), step_timeout_s=5
            )

        ticks = 0

        async def ticker():  # the loop keeps running while 16 steps block their threads
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.ensure_future(ticker())
        eps = await asyncio.gather(*(one() for _ in range(16)))
        t.cancel()
        return eps, ticks

    eps, ticks = run(main())
    assert all(e.reward == 1.0 for e in eps)
    assert Sync.peak == 16 and ticks > 5


class Raises(AgentInstanceBase):
    async def step(self, states, **kw):
        raise KeyError("the tool crashed")


class Hangs(AgentInstanceBase):
    async def step(self, states, **kw):
        await asyncio.sleep(3600)


def _garbage(result):
    class Garbage(AgentInstanceBase):
        async def step(self, states, **kw):
            return result

    return Garbage


@pytest.mark.parametrize(
    "instance, match",
    [
        (Raises, "the agent raised KeyError: 'the tool crashed'"),
        (Hangs, r"over 0.3 s in one step \(--agent_step_timeout_s\), after 1 action"),
        (_garbage("done"), "step\\(\\) must return a dict, got str"),
        (_garbage({"rewards": 1.0, "environment_feedback": ""}), "step\\(\\) returned no 'done'"),
        (_garbage({"rewards": "1", "environment_feedback": "", "done": True}), "'rewards' must be a number, got str"),
        (_garbage({"rewards": torch.ones(2), "environment_feedback": "", "done": 1}), "one number, got a tensor"),
        (_garbage({"rewards": float("nan"), "environment_feedback": "", "done": 1}), "must be finite"),
        (_garbage({"rewards": 1, "environment_feedback": 7, "done": 1}), "'environment_feedback' must be text"),
        (
            _garbage({"rewards": 1, "environment_feedback": "", "done": 1, "extra_logs": {"a": "x"}}),
            r"extra_logs\['a'\]",
        ),
    ],
)
def test_a_failing_environment_fails_its_episode_with_a_message_naming_what(instance, match):
    # Only the hanging one waits out its timeout; the others get room (a loaded CI host once took
    # over 0.3 s to reach the first action, failing a garbage case on the timeout instead).
    with pytest.raises(EpisodeError, match=match):
        _episode(instance, [[EOS]], timeout=0.3 if instance is Hangs else 30.0)


def test_a_blocking_step_past_its_timeout_fails_the_episode_and_the_loop_goes_on():
    Sync.delay = 2.0
    t0 = time.monotonic()
    with pytest.raises(EpisodeError, match="--agent_step_timeout_s"):
        _episode(Sync, [[EOS]], timeout=0.3)
    assert time.monotonic() - t0 < 1.5  # not waiting for the thread, which Python cannot kill


class ReEncodes(MultiTurnAgentExecutor):
    """A custom executor that puts a re-tokenized action in the sequence (a different token)."""

    def __init__(self):
        super().__init__(ThreeTurns)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        out = await llm_engine.generate(list(llm_engine.prompt_token_ids), sampling_params)
        action = list(out.outputs[0].token_ids)
        return {"observation_tokens": [*llm_engine.prompt_token_ids, *action[:-1], 99], "reward": 1.0}


class Custom(MultiTurnAgentExecutor):
    """A custom executor (OpenRLHF's ``execute`` signature): two generate calls, its own loop."""

    def __init__(self):
        super().__init__(ThreeTurns)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        toks = hf_tokenizer(prompt)["input_ids"]
        ranges = []
        for _ in range(2):
            out = await llm_engine.generate(toks, sampling_params)
            a = list(out.outputs[0].token_ids)
            ranges.append((len(toks), len(toks) + len(a)))
            toks = toks + a + hf_tokenizer("!")["input_ids"]
        return {"observation_tokens": toks, "action_ranges": ranges, "reward": torch.tensor(0.5), "extra_logs": {}}


def _custom(executor, actions, **kw):
    engine = TurnEngine(ScriptedRequest(actions), same_params, prompt_token_ids=ids("ab"), max_len=32, **kw)
    sp = SimpleNamespace(max_tokens=4, logprobs=0)

    async def main():
        return await run_episode(
            executor,
            engine,
            prompt_text="ab",
            label="",
            sampling_params=sp,
            tokenizer=CharTokenizer(),
            step_timeout_s=5,
        )

    return run(main())


def test_a_custom_executor_trains_and_a_re_encoded_action_is_refused():
    ep = _custom(Custom(), [[*ids("x"), EOS], [*ids("y"), EOS]])
    assert ep.response == [*ids("x"), EOS, *ids("!"), *ids("y"), EOS]  # the trailing "!" dropped
    assert ep.action_mask == [1, 1, 0, 1, 1] and ep.reward == 0.5 and ep.finish_reason == "stop"
    with pytest.raises(EpisodeError, match="token in, token out"):
        _custom(ReEncodes(), [[*ids("xy"), EOS]])
    with pytest.raises(EpisodeError, match="past --agent_max_turns 1"):
        _custom(Custom(), [[EOS], [EOS]], max_turns=1)


class OpenRLHF010Call(MultiTurnAgentExecutor):
    """A custom executor that calls the engine as OpenRLHF 0.10's executors do: ``images=None`` in
    its own signature, ``multi_modal_data`` on every generate call (None for text), and a reward
    it may leave to the reward model (None)."""

    def __init__(self, media=None, reward=0.5):
        super().__init__(ThreeTurns)
        self.media, self.reward = media, reward

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        toks = hf_tokenizer(prompt)["input_ids"]
        out = await llm_engine.generate(toks, sampling_params, multi_modal_data=self.media)
        a = list(out.outputs[0].token_ids)
        return {
            "observation_tokens": toks + a,
            "action_ranges": [(len(toks), len(toks) + len(a))],
            "reward": self.reward,
            "scores": None,
            "extra_logs": {},
        }


def test_openrlhf_010s_generate_keyword_is_taken_and_images_fail_the_episode_naming_issue_42():
    for text_only in (None, {}, {"image": []}, {"image": None}):
        ep = _custom(OpenRLHF010Call(media=text_only), [[*ids("x"), EOS]])
        assert ep.response == [*ids("x"), EOS] and ep.reward == 0.5
    for images in ({"image": [object()]}, {"image": object()}):
        with pytest.raises(EpisodeError, match=r"images to generate\(\).*vision is not yet supported.*issue 42"):
            _custom(OpenRLHF010Call(media=images), [[*ids("x"), EOS]])


def test_a_reward_left_to_the_reward_service_is_none_and_a_missing_one_is_refused():
    ep = _custom(OpenRLHF010Call(reward=None), [[*ids("x"), EOS]])
    assert ep.reward is None and ep.score is None  # the run's reward service scores it (docs/agents.md)

    class NoReward(OpenRLHF010Call):
        async def execute(self, *args, **kw):
            result = await super().execute(*args, **kw)
            del result["reward"]
            return result

    with pytest.raises(EpisodeError, match="returned no 'reward' .a number, or None"):
        _custom(NoReward(), [[*ids("x"), EOS]])


def test_build_episode_refuses_misplaced_action_ranges_and_an_episode_without_action():
    engine = TurnEngine(ScriptedRequest([[7, 8]]), same_params, prompt_token_ids=[1], max_len=8)
    run(engine.generate([1], SimpleNamespace(max_tokens=4)))
    with pytest.raises(EpisodeError, match="action_ranges"):
        build_episode({"observation_tokens": [1, 7, 8], "action_ranges": [(0, 2)], "reward": 1}, engine)
    assert build_episode({"observation_tokens": [1, 7, 8], "reward": 1}, engine).action_mask == [1, 1]
    empty = TurnEngine(ScriptedRequest([]), same_params, prompt_token_ids=[1], max_len=8)
    with pytest.raises(EpisodeError, match="no action"):
        build_episode({"observation_tokens": [1], "reward": 0}, empty)


# ---------------------------------------------------------------- loading a file

OPENRLHF_STYLE = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):  # as OpenRLHF's published example writes it
        self.steps = 0

    async def step(self, states, **kwargs):
        self.steps += 1
        return {"rewards": torch.tensor(float(self.steps)), "environment_feedback": "", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_an_openrlhf_file_loads_without_openrlhf_and_bad_files_are_named(tmp_path):
    f = tmp_path / "agent_func.py"
    f.write_text(OPENRLHF_STYLE)
    executor, identity = load_agent(str(f))
    assert isinstance(executor, MultiTurnAgentExecutor) and identity == agent_identity(f)
    assert identity.startswith("agent_func.py:") and len(identity.split(":")[1]) == 12
    # its `async def __init__` (OpenRLHF's published example has one) is awaited, not a TypeError
    ep, _ = _episode(executor.agent_instance_cls, [[*ids("x"), EOS]])
    assert ep.reward == 1.0 and ep.turns == 1 and ep.response == [*ids("x"), EOS]
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="none.py: defines no class AgentExecutor"):
        load_agent(str(tmp_path / "none.py"))
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ValueError, match="broken.py: importing it raised ModuleNotFoundError"):
        load_agent(str(tmp_path / "broken.py"))
    with pytest.raises(ValueError, match="missing.py: no such file"):
        load_agent(str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match="subclass of AgentInstanceBase"):
        MultiTurnAgentExecutor(dict)


# ---------------------------------------------------------------- through RolloutCore


class TwoTries(AgentInstanceBase):
    """Done when the action's text has an even digit, or after two actions; reward 1 if so."""

    async def reset(self, states, **kw):
        self.n = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kw):
        self.n += 1
        ok = any(c in "02468" for c in states["action_text"])
        done = ok or self.n == 2
        return {"rewards": float(ok), "environment_feedback": "" if done else "\x05\x06", "done": done}


class TwoTriesExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(TwoTries)


AGENT = P.AgentParams(agent="two.py:0123456789ab", max_len=40, max_turns=2, step_timeout_s=5)
SP = P.SamplingParams(temperature=1.0, max_new_tokens=3, n=2, logprobs=True)


def core_running(executor):
    """A core on the stand-in engine whose episodes run ``executor`` in-process (the file's
    identity: AGENT's)."""
    tok = CharTokenizer()
    return core_on_fake_llm(EpisodeRunner(InProcessAgent(executor, AGENT.agent, tok), tok, max_model_len=64))


@pytest.fixture
def core():
    return core_running(TwoTriesExecutor())


def test_episodes_through_the_core_carry_mask_logprobs_and_the_first_actions_version(core):
    # The stand-in's token t of a request is 3 + (prompt length + t) % 7: prompt [1, 2] gives
    # 5, 6, 7 ("567": an even digit), so each episode is done after one action.
    res = run(core.generate(1, [1, 2], SP, agent=AGENT, label="L"))
    assert len(res.samples) == 2
    for s in res.samples:
        assert s.token_ids == [5, 6, 7] and s.logprobs == [-1.5] * 3 and s.episode.action_mask == [1, 1, 1]
        assert s.episode.reward == 1.0 and s.episode.turns == 1 and s.policy_version == 0
    assert core.episodes.counters["episodes"] == 2 and core.episodes.counters["agent_turns"] == 2
    assert core.metrics()["episodes"] == 2.0


def test_an_episode_without_a_reward_leaves_the_server_as_none_in_its_batch():
    from rollout_service.server import sample_batch

    core = core_running(OpenRLHF010Call(reward=None))
    res = run(core.generate(1, [1, 2], SP, agent=AGENT, label="L"))
    b = P.Codec().decode(P.Codec().encode(sample_batch([res], "r0")))  # what the controller gets
    assert b.episodes.rewards == [None, None] and b.episodes.scores == [None, None]
    assert b.episodes.action_mask.tolist() == [1, 1, 1] * 2 and b.prompt_token_ids == [[1, 2], [1, 2]]


def test_a_weight_update_mid_episode_keeps_it_and_later_turns_use_the_new_weights():
    class Slow(AgentInstanceBase):
        async def step(self, states, **kw):
            self.n = getattr(self, "n", 0) + 1
            await asyncio.sleep(0.15)  # the update lands while the environment thinks
            return {"rewards": 1.0, "environment_feedback": "\x05", "done": self.n == 2}

    class SlowExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(Slow)

    core = core_running(SlowExecutor())

    async def push(version):
        await core.start_weight_update(version)
        await core.update_weights(["w"], ["float32"], [[1]])
        await core.finish_weight_update(version)

    async def scenario():
        ep = asyncio.ensure_future(core.generate(1, [1, 2], SP, agent=AGENT, label=""))
        await asyncio.sleep(0.1)  # first actions sampled on v0
        await push(1)
        res = await ep
        for s in res.samples:
            assert s.policy_version == 0 and s.episode.turns == 2
        salts = [p.get("cache_salt") for p in core.llm.prompts.values()]
        assert salts.count("rayless-v0") == 2 and salts.count("rayless-v1") == 2

    run(scenario())


def test_an_abort_mid_episode_stops_its_requests_and_a_failure_is_the_agents():
    class Forever(AgentInstanceBase):
        async def step(self, states, **kw):
            return {"rewards": 0.0, "environment_feedback": "\x05", "done": False}

    class ForeverExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(Forever)

    core = core_running(ForeverExecutor())
    unlimited = P.AgentParams(agent=AGENT.agent, max_len=64, max_turns=0, step_timeout_s=5)

    async def scenario():
        ep = asyncio.ensure_future(core.generate(1, [1, 2], SP, agent=unlimited, label=""))
        await asyncio.sleep(0.1)
        ep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ep
        await asyncio.sleep(0.05)
        assert "abort" in core.llm.calls and not core.llm.running

    run(scenario())
    core = core_running(MultiTurnAgentExecutor(Raises))
    with pytest.raises(AgentFailed, match="KeyError"):
        run(core.generate(2, [1, 2], SP, agent=AGENT, label=""))
    assert core.episodes.counters["failed_episodes"] == 1


def test_token_ids_outside_the_vocabulary_fail_the_episode_not_the_server():
    class OutOfVocab(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(TwoTries)

        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
            await llm_engine.generate([1, 10**6], sampling_params)

    core = core_running(OutOfVocab())
    with pytest.raises(AgentFailed, match="outside the vocabulary"):
        run(core.generate(1, [1, 2], SP, agent=AGENT, label=""))
    assert core.episodes.counters["failed_episodes"] == 1 and not core.llm.prompts


def test_the_core_refuses_agent_requests_it_cannot_serve(core):
    with pytest.raises(BadRequest, match="this server runs two.py"):
        run(core.generate(1, [1, 2], SP, agent=P.AgentParams(agent="other.py:ffffffffffff", max_len=40)))
    with pytest.raises(BadRequest, match="exceeds this server's --max_model_len 64"):
        run(core.generate(1, [1, 2], SP, agent=P.AgentParams(agent=AGENT.agent, max_len=65)))
    with pytest.raises(BadRequest, match="runs no agent"):
        run(core_on_fake_llm().generate(1, [1, 2], SP, agent=AGENT))
