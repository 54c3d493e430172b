"""EpisodeRunner alone: n episodes of a prompt through its ``EpisodeSource`` seam, each handed a
``TurnEngine`` whose calls are the core's turns, the episodes' counters, a failing episode
failing the prompt, and the requests it refuses. Turns are scripted (``helpers.agent_fakes``);
the runner inside the core, on the stand-in engine, is in ``test_agent.py``."""

from __future__ import annotations

import asyncio

import pytest

from common import protocol as P
from helpers.agent_fakes import CharTokenizer, ScriptedRequest, ids
from rollout_service.agent import Episode, EpisodeError, TurnEngine, build_episode
from rollout_service.episodes import EpisodeRunner
from rollout_service.errors import AgentFailed, BadRequest

AGENT = P.AgentParams(agent="env.py:0123456789ab", max_len=30, max_turns=2, step_timeout_s=5)


class OneAction:
    """An EpisodeSource that is not an AgentExecutor: one action, scored by its length."""

    identity = AGENT.agent

    def __init__(self, fail_on: str | None = None) -> None:
        self.seen: list[tuple] = []
        self.fail_on = fail_on

    async def run(self, prompt_text, label, sampling_params, engine: TurnEngine, step_timeout_s) -> Episode:
        self.seen.append((prompt_text, label, sampling_params, step_timeout_s))
        if label == self.fail_on:
            raise EpisodeError("the environment refused the label")
        out = await engine.generate(engine.prompt_token_ids, sampling_params)
        action = list(out.outputs[0].token_ids)
        return build_episode(
            {"observation_tokens": engine.prompt_token_ids + action, "reward": float(len(action)), "done": True}, engine
        )


def params(max_tokens: int):
    from types import SimpleNamespace

    return SimpleNamespace(max_tokens=max_tokens, seed=None)


def runner(source) -> EpisodeRunner:
    r = EpisodeRunner(source, CharTokenizer(), max_model_len=64)
    r.turn_params = lambda p: params(p.max_tokens)
    return r


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_each_episode_gets_its_own_first_params_and_engine_and_is_counted():
    source = OneAction()
    r = runner(source)
    turns = ScriptedRequest([ids("ab"), ids("cde")])
    firsts = {0: params(2), 1: params(3)}
    eps = run(r.run(7, ids("hi"), 2, AGENT, "L", first_params=firsts.__getitem__, turn=turns, vocab=1000))
    assert [e.response for e in eps] in ([ids("ab"), ids("cde")], [ids("cde"), ids("ab")])
    assert sorted(e.reward for e in eps) == [2.0, 3.0] and all(e.action_mask == [1] * len(e.response) for e in eps)
    assert [s[0] for s in source.seen] == ["hi", "hi"] and {s[3] for s in source.seen} == {5}
    assert r.counters == {
        "episodes": 2,
        "agent_turns": 2,
        "failed_episodes": 0,
        "agent_later_turn_tokens": 0,
        "agent_later_turn_cached": 0,
    }


def test_a_failed_episode_fails_the_prompt_and_is_counted():
    r = runner(OneAction(fail_on="bad"))
    with pytest.raises(AgentFailed, match="refused the label"):
        run(
            r.run(7, ids("hi"), 2, AGENT, "bad", first_params=lambda i: params(2), turn=ScriptedRequest([]), vocab=1000)
        )
    assert r.counters["failed_episodes"] == 1 and r.counters["episodes"] == 0


def test_token_ids_outside_the_vocabulary_never_reach_the_engine():
    class OutOfVocab(OneAction):
        async def run(self, prompt_text, label, sampling_params, engine, step_timeout_s):
            await engine.generate([1, 10**6], sampling_params)

    turns = ScriptedRequest([ids("a")])
    with pytest.raises(AgentFailed, match=r"outside the vocabulary \[0, 1000\)"):
        run(
            runner(OutOfVocab()).run(
                7, ids("hi"), 1, AGENT, "", first_params=lambda i: params(2), turn=turns, vocab=1000
            )
        )
    assert turns.calls == []


def test_requests_this_server_cannot_run_are_refused_naming_the_limit():
    r = runner(OneAction())
    with pytest.raises(BadRequest, match="the learner's agent is other.py:ffffffffffff; this server runs env.py"):
        r.check(ids("hi"), P.AgentParams(agent="other.py:ffffffffffff", max_len=30))
    with pytest.raises(BadRequest, match="agent.max_len 65 exceeds this server's --max_model_len 64"):
        r.check(ids("hi"), P.AgentParams(agent=AGENT.agent, max_len=65))
    with pytest.raises(BadRequest, match="prompt of 30 tokens leaves no room under agent.max_len 30"):
        r.check([1] * 30, AGENT)
