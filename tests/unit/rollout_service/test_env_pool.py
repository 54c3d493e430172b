"""The environment worker pool (rollout_service/env_pool.py) on a fake engine: real worker
processes, the fault agent file (``helpers/agent_env_faults.py``, the label picks the fault),
a character tokenizer in the workers and a ``request`` that answers every turn with the same
two tokens. Healthy episodes run beside ones that hang, segfault, leak or exit: the healthy ones
complete with the exact sequence the in-process loop would give, every failure is its own
episode's with a reason, and dead workers are replaced. Real vLLM: test_rollout_service.py.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common import protocol as P
from common.agent_file import agent_identity
from helpers.agent_env_faults import FEEDBACK
from helpers.agent_fakes import CharTokenizer, ids, same_params, vllm_output
from helpers.fake_llm import FakeLLM
from helpers.paths import HELPERS
from rollout_service.agent import EpisodeError, TurnEngine
from rollout_service.config import RolloutConfig
from rollout_service.core import RolloutCore
from rollout_service.env_pool import EnvPool, PooledAgent
from rollout_service.episodes import EpisodeRunner
from rollout_service.errors import AgentFailed

FAULTS = str(HELPERS / "agent_env_faults.py")
EOS = CharTokenizer.eos_token_id
ACTION = [*ids("a"), EOS]


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    # the workers build helpers.agent_fakes.CharTokenizer: they need tests/ on their path
    monkeypatch.setenv("PYTHONPATH", str(HELPERS.parent))


class Request:
    """Every turn: ``ACTION`` after ``delay`` seconds (the engine's time, not the environment's)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.calls = delay, 0

    async def __call__(self, token_ids, params):
        self.calls += 1
        await asyncio.sleep(self.delay)
        return vllm_output(ACTION[: params.max_tokens]), 0


def make_pool(workers: int = 2, **kw) -> EnvPool:
    kw.setdefault("cancel_grace_s", 1.0)
    kw.setdefault("start_timeout_s", 60.0)
    return EnvPool(FAULTS, workers=workers, tokenizer_factory="helpers.agent_fakes:CharTokenizer", **kw)


async def episode(pool, label, *, request=None, pid=0, step_timeout_s=10.0, episode_timeout_s=0.0):
    engine = TurnEngine(request or Request(), same_params, prompt_token_ids=ids("ab"), max_len=32)
    return await pool.run_episode(
        engine,
        prompt_id=pid,
        prompt_text="ab",
        label=label,
        sampling_params=SimpleNamespace(max_tokens=4, logprobs=0, temperature=1.0),
        step_timeout_s=step_timeout_s,
        episode_timeout_s=episode_timeout_s,
    )


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def many(pool, labels, **kw):
    """Every label's episode at once; each one's Episode or its EpisodeError."""
    return await asyncio.gather(
        *(episode(pool, lab, pid=i, **kw) for i, lab in enumerate(labels)), return_exceptions=True
    )


def check_healthy(ep):
    # two actions with the feedback between them, exactly as the in-process loop builds them
    assert ep.prompt == ids("ab")
    assert ep.response == [*ACTION, *ids(FEEDBACK), *ACTION]
    assert ep.action_mask == [1, 1, 0, 0, 1, 1]
    assert ep.logprobs == pytest.approx([-0.1, -0.2, 0, 0, -0.1, -0.2])
    assert (ep.reward, ep.turns, ep.finish_reason) == (2.0, 2, "stop")


def test_healthy_episodes_match_the_in_process_loop():
    async def main():
        pool = make_pool(2)
        await pool.start()
        try:
            eps = await many(pool, ["ok"] * 12)
            return eps, pool.metrics()
        finally:
            await pool.close()

    eps, m = run(main())
    for ep in eps:
        check_healthy(ep)
    assert m["env_workers_live"] == 2 and m["env_worker_deaths"] == 0


def test_a_bad_agent_file_fails_the_start_naming_it(tmp_path):
    bad = tmp_path / "bad_env.py"
    bad.write_text("raise RuntimeError('no such tool')\n")

    async def main():
        pool = EnvPool(str(bad), workers=2, tokenizer_factory="helpers.agent_fakes:CharTokenizer")
        await pool.start()

    with pytest.raises(ValueError, match=r"bad_env.py: importing it raised RuntimeError: no such tool"):
        run(main())


@pytest.mark.parametrize("hang", ["hang", "hang_def", "hang_loop"])
def test_a_step_that_hangs_fails_its_episode_every_other_completes(hang):
    # every tenth prompt hangs; the others run beside them on the same two workers
    labels = [hang if i % 10 == 0 else "ok" for i in range(20)]

    async def main():
        pool = make_pool(2)
        await pool.start()
        try:
            out = await many(pool, labels, step_timeout_s=1.0)
            await asyncio.sleep(1.5)  # the cancels' answers (or their absence) are in
            return out, pool.metrics()
        finally:
            await pool.close()

    out, m = run(main())
    for lab, r in zip(labels, out, strict=True):
        if lab == "ok":
            check_healthy(r)
        elif hang == "hang_loop":  # the worker's whole loop stopped: killed, the others re-run
            assert isinstance(r, EpisodeError) and "its event loop was blocked" in str(r), r
        else:
            assert isinstance(r, EpisodeError)
            assert "over 1 s in one step (--agent_step_timeout_s), after 2 action(s)" in str(r)
    if hang == "hang_loop":
        assert m["env_worker_hung"] >= 1 and m["env_worker_deaths"] >= 1
    else:  # the worker cancels the episode and goes on
        assert m["env_episodes_timed_out"] == 2 and m["env_worker_deaths"] == 0
    assert m["env_workers_live"] == 2


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("segv", "was killed by SIGSEGV"),
        ("os_exit", "exited with code 7"),
        ("leak", "over --agent_env_worker_memory_mb 600"),
    ],
)
def test_a_worker_that_dies_fails_the_episode_that_killed_it_and_reruns_the_others(fault, reason):
    # The faulty episode reaches its fatal step (after two 0.2 s turns) while the others wait on
    # the engine (1 s a turn): it is the only one in environment code, so it is the culprit.
    async def main():
        pool = make_pool(1, memory_mb=600)
        await pool.start()
        try:
            bad = asyncio.ensure_future(episode(pool, fault, pid=99, request=Request(delay=0.2)))
            slow = Request(delay=1.0)
            healthy = [asyncio.ensure_future(episode(pool, "ok", pid=i, request=slow)) for i in range(6)]
            out = await asyncio.gather(bad, *healthy, return_exceptions=True)
            for _ in range(100):  # the replacement starting
                if pool.live() == 1:
                    break
                await asyncio.sleep(0.1)
            return out, pool.metrics()
        finally:
            await pool.close()

    (bad, *healthy), m = run(main())
    assert isinstance(bad, EpisodeError), bad
    # the culprit fails at the first death, or (a busy host let a healthy episode be in its
    # environment code at that moment too: two suspects, both re-run) at the second
    assert reason in str(bad)
    assert "while this episode's environment code ran" in str(bad) or "workers died under this episode" in str(bad)
    for ep in healthy:
        check_healthy(ep)
    assert m["env_worker_deaths"] in (1, 2) and m["env_episodes_lost"] == 1
    assert m["env_episodes_rerun"] >= 6  # every other episode of the worker, from its first turn
    assert m["env_workers_live"] == 1
    assert m["env_worker_over_memory" if fault == "leak" else "env_worker_crashes"] == m["env_worker_deaths"]


def test_a_worker_that_lost_threads_to_cancelled_steps_is_retired_and_replaced():
    # each cancelled plain-def step keeps its thread in the worker: after max_step_cancels the
    # worker takes no new episode, finishes its running ones and a fresh one replaces it
    async def main():
        pool = make_pool(1, max_step_cancels=2)
        await pool.start()
        first = next(iter(pool._workers)).pid
        try:
            hung = await many(pool, ["hang_def", "hang_def"], step_timeout_s=0.5)
            for _ in range(200):
                if pool.live() == 1 and next(iter(pool._workers)).pid != first:
                    break
                await asyncio.sleep(0.05)
            after = await many(pool, ["ok"] * 4)
            return hung, after, pool.metrics()
        finally:
            await pool.close()

    hung, after, m = run(main())
    assert all(isinstance(r, EpisodeError) for r in hung)
    for ep in after:
        check_healthy(ep)
    assert m["env_worker_retired"] == 1 and m["env_worker_deaths"] == 0 and m["env_workers_live"] == 1


def test_sys_exit_fails_its_episode_only_and_the_worker_goes_on():
    async def main():
        pool = make_pool(1)
        await pool.start()
        try:
            out = await many(pool, ["exit", *["ok"] * 5])
            return out, pool.metrics()
        finally:
            await pool.close()

    (bad, *healthy), m = run(main())
    assert isinstance(bad, EpisodeError) and "the agent called sys.exit(3)" in str(bad)
    for ep in healthy:
        check_healthy(ep)
    assert m["env_worker_deaths"] == 0 and m["env_episodes_rerun"] == 0


def test_the_episode_wall_limit_counts_engine_time_too():
    async def main():
        pool = make_pool(1)
        await pool.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(EpisodeError, match=r"over 0.5 s \(--agent_episode_timeout_s\)"):
                await episode(pool, "ok", request=Request(delay=0.4), episode_timeout_s=0.5)
            took = time.monotonic() - t0
            check_healthy(await episode(pool, "ok"))  # the worker is fine
            return took
        finally:
            await pool.close()

    assert run(main()) < 1.5


def test_a_worker_that_keeps_dying_fails_episodes_after_one_rerun_and_live_share_drops():
    # Two crashing episodes on one worker, both in environment code at once: neither is known to
    # be the culprit, so both are re-run; the second death fails them.
    async def main():
        pool = make_pool(1)
        await pool.start()
        try:
            out = await many(pool, ["segv", "segv"])
            share_after = pool.live_share()
            return out, pool.metrics(), share_after
        finally:
            await pool.close()

    out, m, _ = run(main())
    assert all(isinstance(r, EpisodeError) for r in out), out
    assert m["env_worker_deaths"] >= 2


KEEPS_FIRST_ENGINE = """
from rollout_service.agent_api import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    # keeps the first episode's llm_engine, as OpenRLHF's openai-server executor does
    engine = None

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        AgentExecutor.engine = AgentExecutor.engine or llm_engine
        toks = list(AgentExecutor.engine.prompt_token_ids)
        out = await AgentExecutor.engine.generate(toks, sampling_params)
        action = list(out.outputs[0].token_ids)
        return {"observation_tokens": toks + action, "action_ranges": [(len(toks), len(toks) + len(action))],
                "reward": 1.0}
"""


def test_an_executor_that_keeps_the_first_llm_engine_reaches_each_episodes_own(tmp_path):
    f = tmp_path / "keeps_engine.py"
    f.write_text(KEEPS_FIRST_ENGINE)

    async def main():
        pool = EnvPool(str(f), workers=1, tokenizer_factory="helpers.agent_fakes:CharTokenizer")
        await pool.start()
        try:
            return [await episode(pool, "", pid=i) for i in range(3)]
        finally:
            await pool.close()

    for ep in run(main()):
        assert ep.response == ACTION and ep.turns == 1 and ep.reward == 1.0


def test_workers_die_with_the_pool():
    async def main():
        pool = make_pool(2)
        await pool.start()
        procs = [w.proc for w in pool._workers]
        await pool.close()
        return procs

    procs = run(main())
    assert all(p.poll() is not None for p in procs)


def test_episodes_through_the_core_run_in_the_workers_and_a_crash_fails_only_its_prompt():
    # RolloutCore on the vLLM stand-in, its episodes in two workers: every turn through the
    # core's gate; the pool's counters join the heartbeat's stats
    identity = agent_identity(FAULTS)
    params = P.AgentParams(agent=identity, max_len=40, step_timeout_s=10)
    sp = P.SamplingParams(temperature=1.0, max_new_tokens=3, n=2, logprobs=True)

    async def main():
        pool = make_pool(2)
        await pool.start()
        runner = EpisodeRunner(PooledAgent(pool, identity), CharTokenizer(), max_model_len=64)
        cfg = RolloutConfig(model="m", controller="tcp://127.0.0.1:1", max_model_len=64, weight_transfer_backend="gloo")
        core = await RolloutCore.create(cfg, engine=FakeLLM(), episodes=runner)
        try:
            ok = await core.generate(1, [1, 2], sp, agent=params, label="ok")
            with pytest.raises(AgentFailed, match="was killed by SIGSEGV"):
                await core.generate(2, [1, 2], sp, agent=params, label="segv")
            again = await core.generate(3, [1, 2], sp, agent=params, label="ok")
            return ok, again, core.metrics()
        finally:
            await runner.close()

    ok, again, m = run(main())
    for res in (ok, again):
        for s in res.samples:
            ep = s.episode
            assert ep.turns == 2 and ep.reward == 2.0 and ep.action_mask == [1, 1, 1, 0, 0, 1, 1, 1]
            assert s.token_ids == ep.response and s.logprobs == [-1.5] * 3 + [0.0] * 2 + [-1.5] * 3
    assert m["episodes"] == 4 and m["failed_episodes"] == 1 and m["env_workers"] == 2
    assert m["env_worker_crashes"] >= 1 and m["env_workers_live"] >= 1
    # the heartbeat's capacity: --max_num_seqs (64) scaled by the share of workers up
    assert m["capacity"] == int(64 * m["env_workers_live"] / 2)
