"""GEM environments as agents (``--agent_func_path gem:ENV_ID``, rollout_service/hub_envs.py), without vLLM.

A scripted engine (``helpers.agent_fakes``) answers each turn with known tokens and a character
tokenizer with a chat template (``helpers.chat_fakes``) makes every rendered text's tokens known
by hand, so each test states the exact sequence, mask and reward of a GEM game: in-process, and
in real environment worker processes (``env_pool.py``), where an environment that raises fails
only its own episode. GEM's own ``game:GuessTheNumber-v0-easy`` (pure Python) and a tiny
environment in GEM's style (``helpers/gem_envs.py``) are played; OpenRLHF's GEM agent file (a
stand-in of its shape, ``helpers/gem_openrlhf_multiturn.py``) trains unchanged.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from helpers.agent_fakes import CharTokenizer, ScriptedRequest, ids, same_params
from helpers.chat_fakes import ChatCharTokenizer, render
from helpers.paths import HELPERS
from rollout_service.agent import EpisodeError, TurnEngine, load_agent, run_episode

gem = pytest.importorskip("gem", reason="gem-llm is not installed (make setup installs it: docs/environments.md)")

from rollout_service.env_pool import EnvPool  # noqa: E402 - after the skip
from rollout_service.hub_envs import GemExecutor, task_seed  # noqa: E402

EOS = CharTokenizer.eos_token_id
GUESS = "gem:game:GuessTheNumber-v0-easy"
FAULTS = "gem:rayless-test:Faults-v0?import=helpers.gem_envs"
SUFFIX = "Enter your next guess."


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    # the workers build the tokenizer and import helpers.gem_envs from tests/
    monkeypatch.setenv("PYTHONPATH", str(HELPERS.parent))


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def act(text: str) -> list[int]:
    return [*ids(text), EOS]


def target(seed: int) -> tuple[str, int]:
    """GuessTheNumber-v0-easy's first observation and number for ``seed``, from GEM itself."""
    env = gem.make("game:GuessTheNumber-v0-easy")
    obs, _ = env.reset(seed=seed)
    return obs, env.game_number


def engine_for(actions, prompt="task", max_len=2000, max_turns=0):
    req = ScriptedRequest(actions)
    return TurnEngine(req, same_params, prompt_token_ids=ids(prompt), max_len=max_len, max_turns=max_turns), req


def play(executor, actions, *, label, tokenizer=None, prompt="task", **kw):
    engine, req = engine_for(actions, prompt, **kw)

    async def main():
        return await run_episode(
            executor,
            engine,
            prompt_text=prompt,
            label=label,
            sampling_params=SimpleNamespace(max_tokens=40, logprobs=0),
            tokenizer=tokenizer or ChatCharTokenizer(),
            step_timeout_s=20.0,
        )

    return run(main()), req


# ---------------------------------------------------------------------------------- start-up


def test_task_seed_from_the_label_else_a_hash_of_the_prompt():
    assert task_seed("p", "17") == 17 and task_seed("p", '{"seed": 4, "x": 1}') == 4
    assert task_seed("p", "hello") == task_seed("p", "hello") != task_seed("q", "hello")
    assert 0 <= task_seed("p", "-3") < 2**31 and task_seed("p", None) == task_seed("p", "")


def test_start_up_errors_name_the_spec(monkeypatch):
    with pytest.raises(ValueError, match=r"gem:game:GuessTheNumbr-v0-easy: GEM has no environment .*did you mean "):
        load_agent("gem:game:GuessTheNumbr-v0-easy")
    with pytest.raises(ValueError, match=r"gem\.make\('game:GuessTheNumber-v0-easy'.*raised TypeError"):
        load_agent("gem:game:GuessTheNumber-v0-easy?max_number=[1]")  # its constructor compares it with ints
    with pytest.raises(ValueError, match=r"import=no_such_envs raised ModuleNotFoundError"):
        load_agent("gem:x:Y-v0?import=no_such_envs")
    with pytest.raises(
        ValueError, match=r"gem:code:CodeContest: gem.envs.code_env:CodeEnv runs the policy's code .*outside"
    ):
        load_agent("gem:code:CodeContest")  # before gem.make, which would download its dataset
    with pytest.raises(ValueError, match="template must be chat or raw"):
        load_agent(GUESS + "?template=jinja")
    monkeypatch.setitem(sys.modules, "gem", None)  # as if gem-llm were not installed
    with pytest.raises(ValueError, match=r"gem:x:Y-v0: GEM is not installed .*pip install --no-deps gem-llm"):
        load_agent("gem:x:Y-v0")


# ---------------------------------------------------------------------------------- in-process


def test_guess_the_number_token_exact_with_masks_and_summed_reward():
    obs, number = target(5)
    wrong = 1 if number != 1 else 2
    a1, a2 = act(f"\\boxed{{{wrong}}}"), act(f"I say \\boxed{{{number}}}")
    executor, identity = load_agent(GUESS)
    assert identity == GUESS and isinstance(executor, GemExecutor)
    ep, req = play(executor, [a1, a2], label="5")

    first = obs + SUFFIX  # GEM's observation wrappers add info's suffix; obs ends with a newline
    hint = "higher" if number > wrong else "lower"
    second = f"At turn 1, you guessed {wrong}, and the target number is {hint} than {wrong}.\n{SUFFIX}"
    # the environment's prompt replaces the learner's; between the actions only the template's
    # text after the reply (the action's own EOS is not repeated)
    assert ep.prompt == ids(render([{"role": "user", "content": first}]))
    feedback = ids(f"\n\x01user\n{second}\x03\n\x01assistant\n")
    assert ep.response == [*a1, *feedback, *a2]
    assert ep.action_mask == [1] * len(a1) + [0] * len(feedback) + [1] * len(a2)
    assert req.calls[1][0] == [*ep.prompt, *a1, *feedback]  # the second turn continued the first as sampled
    assert (ep.reward, ep.score, ep.turns, ep.finish_reason) == (1.0, 1.0, 2, "stop")
    assert ep.extra_logs["gem/return"] == 1.0 and ep.extra_logs["gem/steps"] == 2.0
    assert (ep.extra_logs["gem/last_reward"], ep.extra_logs["gem/step_reward_min"]) == (1.0, 0.0)
    assert (ep.extra_logs["gem/terminated"], ep.extra_logs["gem/truncated"]) == (1.0, 0.0)

    # the same prompt again: the same game (a group's episodes play one task), on a reused env
    again, _ = play(executor, [act(f"\\boxed{{{number}}}")], label="5")
    assert again.prompt == ep.prompt and again.reward == 1.0 and again.turns == 1


def test_raw_template_and_a_system_message():
    executor, _ = load_agent(FAULTS + "&template=raw")
    ep, _ = play(executor, [act("one"), act("two")], label="0", tokenizer=CharTokenizer())
    assert ep.prompt == ids("COUNT TO 2\n")
    assert ep.response == [*act("one"), *ids("\nOK 1\n"), *act("two")]  # GEM's plain-text history
    assert (ep.reward, ep.extra_logs["gem/step_reward_mean"], ep.extra_logs["gem/info/turn"]) == (1.0, 0.5, 2.0)

    executor, _ = load_agent(FAULTS + "&system=Count.")
    ep, _ = play(executor, [act("1"), act("2")], label="0")
    assert ep.prompt == ids(
        render([{"role": "system", "content": "Count."}, {"role": "user", "content": "COUNT TO 2\n"}])
    )


def test_limits_end_an_endless_game_as_length():
    executor, _ = load_agent(FAULTS)
    ep, _ = play(executor, [act("a")] * 5, label="3", max_turns=3)
    assert (ep.turns, ep.reward, ep.finish_reason, ep.extra_logs["gem/terminated"]) == (3, 1.5, "length", 0.0)
    with pytest.raises(EpisodeError, match="first observation .* leaves no room .* --max_len 8"):
        play(executor, [act("a")], label="0", max_len=8)


def test_an_environment_that_raises_fails_its_episode_naming_it():
    executor, _ = load_agent(FAULTS)
    with pytest.raises(EpisodeError, match=r"rayless-test:Faults-v0: step\(\) raised RuntimeError: board on fire"):
        play(executor, [act("a")], label="1")
    with pytest.raises(EpisodeError, match=r"step\(\) returned a int observation \(text expected\)"):
        play(executor, [act("a"), act("b")], label="2")
    ok, _ = play(executor, [act("a"), act("b")], label="0")  # the executor goes on
    assert ok.reward == 1.0


def test_openrlhf_gem_agent_file_trains_unchanged():
    executor, _ = load_agent(str(HELPERS / "gem_openrlhf_multiturn.py"))
    guesses = [act(f"\\boxed{{{k}}}") for k in (1, 2, 3, 4)]
    ep, _ = play(executor, guesses, label="L", tokenizer=CharTokenizer(), prompt="guess")
    assert ep.prompt == ids("guess")  # it keeps the learner's prompt
    assert 1 <= ep.turns <= 4 and ep.reward in (0.0, 1.0) or ep.turns == 4  # easy: 4 guesses, 1..10
    starts = [
        i for i, (m, prev) in enumerate(zip(ep.action_mask, [0, *ep.action_mask], strict=False)) if m and not prev
    ]
    assert [ep.response[i : i + len(guesses[0])] for i in starts] == guesses[: ep.turns]  # actions as sampled


# ---------------------------------------------------------------------------------- worker processes


async def _pool_episodes(spec, scripts):
    pool = EnvPool(spec, workers=1, tokenizer_factory="helpers.chat_fakes:ChatCharTokenizer", start_timeout_s=60)
    await pool.start()
    try:

        async def one(i, label, actions):
            engine, _ = engine_for(actions)
            return await pool.run_episode(
                engine,
                prompt_id=i,
                prompt_text="task",
                label=label,
                sampling_params=SimpleNamespace(max_tokens=40, logprobs=0, temperature=1.0),
                step_timeout_s=20.0,
                episode_timeout_s=0.0,
            )

        eps = await asyncio.gather(*(one(i, lab, a) for i, (lab, a) in enumerate(scripts)), return_exceptions=True)
        return eps, pool.metrics()
    finally:
        await pool.close()


def test_gem_in_environment_workers_matches_in_process():
    _, number = target(7)
    # label 7: right at once; label 5: four guesses, the game ends at its fourth turn whatever they are
    scripts = [("7", [act(f"\\boxed{{{number}}}")]), ("5", [act(f"\\boxed{{{k}}}") for k in (1, 2, 3, 4)])]
    eps, m = run(_pool_episodes(GUESS, scripts), timeout=120)
    executor, _ = load_agent(GUESS)
    for (label, actions), ep in zip(scripts, eps, strict=True):
        here, _ = play(executor, actions, label=label)
        assert (ep.prompt, ep.response, ep.action_mask, ep.reward) == (
            here.prompt,
            here.response,
            here.action_mask,
            here.reward,
        )
    assert eps[0].reward == 1.0 and m["env_worker_deaths"] == 0


def test_a_raising_environment_in_a_worker_fails_only_its_episode():
    scripts = [("0", [act("a"), act("b")]), ("1", [act("a")]), ("0", [act("c"), act("d")])]
    eps, m = run(_pool_episodes(FAULTS, scripts), timeout=120)
    assert eps[0].reward == eps[2].reward == 1.0
    assert isinstance(
        eps[1], EpisodeError
    ) and "rayless-test:Faults-v0: step() raised RuntimeError: board on fire" in str(eps[1])
    assert m["env_worker_deaths"] == 0
