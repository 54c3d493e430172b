"""The OpenAI-compatible endpoint for agent episodes, without vLLM: the trace, the HTTP endpoint
(real HTTP, the ``openai`` client), tool calls, and episodes side by side.

A character tokenizer with a Qwen3-shaped chat template (``helpers.chat_fakes``: one token per
character, EOS = 3 ends a turn, earlier ``<think>`` blocks dropped) makes every expected sequence
writable by hand; a scripted engine (``helpers.agent_fakes.ScriptedRequest``) answers each call
with known tokens and log-probs (-0.1 * (k + 1) for the k-th token of an action).
"""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest

from helpers.agent_fakes import ScriptedRequest, ids, same_params
from helpers.chat_fakes import ChatCharTokenizer, render
from rollout_service.agent import EpisodeError, TurnEngine
from rollout_service.agent_openai import OpenAIAgent, defines_agent_func, load_agent_func, reward_of
from rollout_service.trace import Trace, TraceError

EOS = 3
TOK = ChatCharTokenizer()


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def text(toks: list[int]) -> str:
    return "".join(chr(t) for t in toks)


def lps(action: list[int]) -> list[float]:
    return [-0.1 * (k + 1) for k in range(len(action))]


# ---------------------------------------------------------------------------------------- trace
def test_a_later_call_reuses_the_sampled_tokens_of_the_reply_the_template_would_rewrite():
    t = Trace(TOK)
    m1 = [{"role": "user", "content": "hi"}]
    c1 = t.chat_prompt(m1)
    assert text(c1.prompt) == "\x01user\nhi\x03\n\x01assistant\n"
    a1 = ids("<think>x</think>ok") + [EOS]
    t.record(c1, a1, "stop")
    m2 = [*m1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]  # the agent even strips it
    c2 = t.chat_prompt(m2)
    # The template renders the reply as "ok" (think dropped); the policy sampled more than that:
    assert "<think>" not in render(m2)
    # its tokens stand in the reply's place, the template's end of turn (EOS) is not doubled.
    assert c2.prompt == c1.prompt + a1 + ids("\n\x01user\nmore\x03\n\x01assistant\n")
    a2 = ids("fine") + [EOS]
    t.record(c2, a2, "stop")
    m3 = [*m2, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "bye"}]
    c3 = t.chat_prompt(m3)
    assert c3.prompt == c2.prompt + a2 + ids("\n\x01user\nbye\x03\n\x01assistant\n")
    t.record(c3, [ord("!")], "length")
    seq, ranges = t.stitch()
    assert seq == c3.prompt + [ord("!")]
    assert ranges == [
        (len(c1.prompt), len(c1.prompt) + len(a1)),
        (len(c2.prompt), len(c2.prompt) + 5),
        (len(c3.prompt), len(seq)),
    ]


def test_an_action_cut_by_length_gets_the_templates_end_of_turn_as_an_environment_token():
    t = Trace(TOK)
    c1 = t.chat_prompt([{"role": "user", "content": "q"}])
    t.record(c1, ids("abc"), "length")
    c2 = t.chat_prompt(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "abc"},
            {"role": "user", "content": "go on"},
        ]
    )
    assert c2.prompt == c1.prompt + ids("abc") + [EOS] + ids("\n\x01user\ngo on\x03\n\x01assistant\n")


@pytest.mark.parametrize(
    "second, match",
    [
        # an earlier user message edited: the policy's turn 1 was sampled after the old one
        (
            [
                {"role": "user", "content": "HI"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "x"},
            ],
            r"call 2: message 0 \(user\) is not what call 1 sent \(after turn 0\): was user \"hi\", now user \"HI\"",
        ),
        # the reply not carried back
        (
            [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
            r"call 2: message 1 should be call 1's reply",
        ),
        # nothing after the reply
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            r"call 2 adds no message after call 1's reply",
        ),
    ],
)
def test_a_conversation_that_does_not_extend_the_last_call_is_refused_naming_call_and_message(second, match):
    t = Trace(TOK)
    c1 = t.chat_prompt([{"role": "user", "content": "hi"}])
    t.record(c1, ids("ok") + [EOS], "stop")
    with pytest.raises(TraceError, match=match):
        t.chat_prompt(second)


def test_a_third_call_that_rewrites_the_first_turns_context_names_the_turn():
    t = Trace(TOK)
    m = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    t.record(t.chat_prompt(m), ids("1") + [EOS], "stop")
    m = [*m, {"role": "assistant", "content": "1"}, {"role": "tool", "content": "r1"}]
    t.record(t.chat_prompt(m), ids("2") + [EOS], "stop")
    bad = [dict(x) for x in m] + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "b"}]
    bad[3]["content"] = "r1 (edited)"
    with pytest.raises(TraceError, match=r"call 3: message 3 \(tool\) is not what call 2 sent \(after turn 1\)"):
        t.chat_prompt(bad)
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(TraceError, match="call 3 changed 'tools'"):
        t.chat_prompt([*m, {"role": "assistant", "content": "2"}, {"role": "user", "content": "b"}], tools)


def test_completion_calls_extend_the_text_returned_and_refuse_a_rewrite():
    t = Trace(TOK)
    c1 = t.completion_prompt("2+2=")
    t.record(c1, ids("4") + [EOS], "stop", returned_text="4")
    c2 = t.completion_prompt("2+2=4\n3+3=")
    assert c2.prompt == ids("2+2=") + ids("4") + [EOS] + ids("\n3+3=")
    t.record(c2, ids("7"), "length", returned_text="7")
    with pytest.raises(
        TraceError, match=r"call 3: its prompt does not extend call 2's .*character 10: .6. where .7. was"
    ):
        t.completion_prompt("2+2=4\n3+3=6")
    with pytest.raises(TraceError, match="call 3 is a chat call after completion calls"):
        t.chat_prompt([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------- endpoint
def agent_file(tmp_path, body: str, name: str = "agent.py") -> str:
    p = tmp_path / name
    p.write_text(body)
    return str(p)


def make_agent(func, tool_call_parser: str = "", in_process: bool = True) -> OpenAIAgent:
    return OpenAIAgent(
        func, "agent.py:0", TOK, model="char-model", tool_call_parser=tool_call_parser, in_process=in_process
    )


# The client rayless hands an agent reaches the endpoint in-process; any other client over HTTP.
TRANSPORTS = pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "http"])


def engine_for(actions: list[list[int]], max_len: int = 200, max_turns: int = 0) -> tuple[TurnEngine, ScriptedRequest]:
    req = ScriptedRequest(actions)
    eng = TurnEngine(
        req,
        same_params,
        prompt_token_ids=ids("learner prompt"),
        max_len=max_len,
        max_turns=max_turns,
        decode=TOK.decode,
    )
    return eng, req


PARAMS = SimpleNamespace(max_tokens=100)


async def episode(agent: OpenAIAgent, engine: TurnEngine, prompt: str = "hi", label: str = "4"):
    try:
        return await agent.run(prompt, label, PARAMS, engine, step_timeout_s=30)
    finally:
        await agent.close()


@TRANSPORTS
def test_an_openai_client_agent_trains_on_the_exact_tokens_with_a_parsed_tool_call(in_process):
    """Two chat calls (in-process, and through real HTTP): a tool call parsed by vLLM's hermes parser, the tool's
    answer sent back, a final answer; the sample is the two calls stitched, mask and log-probs
    exact, the reward the function's."""
    pytest.importorskip("vllm")
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>'
    a1 = ids("<think>add</think>" + call) + [EOS]
    a2 = ids("4") + [EOS]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    seen = {}

    async def agent_func(client, prompt, label, model):
        msgs = [{"role": "user", "content": prompt}]
        r = await client.chat.completions.create(model=model, messages=msgs, tools=tools, logprobs=True)
        seen["first"] = r
        tc = r.choices[0].message.tool_calls[0]
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "4"},
        ]
        r2 = await client.chat.completions.create(model=model, messages=msgs, tools=tools)
        seen["second"] = r2
        return {"rewards": float(r2.choices[0].message.content == label), "extra_logs": {"tool_calls": 1}}

    eng, req = engine_for([a1, a2])
    ep = run(episode(make_agent(agent_func, "hermes", in_process), eng))
    r = seen["first"]
    assert r.choices[0].finish_reason == "tool_calls"
    tc = r.choices[0].message.tool_calls[0]
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("calc", {"expr": "2+2"})
    assert r.choices[0].message.content == "<think>add</think>"
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(lps(a1))
    assert r.usage.completion_tokens == len(a1)
    assert seen["second"].choices[0].message.content == "4"
    p1 = ids(render([{"role": "user", "content": "hi"}], tools))
    env = ids("\n\x01tool\n4\x03\n\x01assistant\n")  # the tool's answer and the generation prompt
    assert [c[0] for c in req.calls] == [p1, p1 + a1 + env]
    assert ep.prompt == p1
    assert ep.response == a1 + env + a2
    assert ep.action_mask == [1] * len(a1) + [0] * len(env) + [1] * len(a2)
    assert ep.logprobs == pytest.approx(lps(a1) + [0.0] * len(env) + lps(a2))
    assert (ep.reward, ep.score, ep.turns, ep.finish_reason) == (1.0, 1.0, 2, "stop")
    assert ep.extra_logs == {"tool_calls": 1.0}


def test_concurrent_episodes_each_reach_only_their_own_trace():
    """Eight episodes at once on one endpoint, each with its own base URL and key and its own
    scripted actions: every sample holds its own tokens only; a foreign key is refused."""
    codes = {}

    async def agent_func(client, prompt, label):
        msgs = [{"role": "user", "content": prompt}]
        for _ in range(2):
            r = await client.chat.completions.create(model="any", messages=msgs)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "+"}]
            await asyncio.sleep(0.01)
        return float(label)

    async def main():
        import httpx

        agent = make_agent(agent_func)
        engines = [engine_for([ids(f"a{i}") + [EOS], ids(f"b{i}") + [EOS]]) for i in range(8)]
        try:
            eps = await asyncio.gather(*(agent.run(f"p{i}", str(i), PARAMS, e, 30) for i, (e, _) in enumerate(engines)))
            async with httpx.AsyncClient(trust_env=False) as h:
                codes["wrong"] = (
                    await h.post(
                        f"{agent.endpoint.url}/v1/chat/completions", json={}, headers={"Authorization": "Bearer nope"}
                    )
                ).status_code
        finally:
            await agent.close()
        return eps, engines

    eps, engines = run(main())
    for i, (ep, (_, req)) in enumerate(zip(eps, engines, strict=True)):
        assert ep.reward == float(i)
        assert text(ep.prompt) == f"\x01user\np{i}\x03\n\x01assistant\n"
        assert text(ep.response) == f"a{i}\x03\n\x01user\n+\x03\n\x01assistant\nb{i}\x03"
        assert len(req.calls) == 2
    assert codes["wrong"] == 401


@TRANSPORTS
def test_unserved_requests_get_a_clear_400_and_a_history_rewrite_fails_the_episode_even_if_caught(in_process):
    import openai

    errors = {}

    async def agent_func(client, prompt, label):
        msgs = [{"role": "user", "content": prompt}]
        for key, extra in [("stream", {"stream": True}), ("n", {"n": 2}), ("stop", {"stop": ["\n"]})]:
            try:
                await client.chat.completions.create(model="m", messages=msgs, **extra)
            except openai.BadRequestError as e:
                errors[key] = e.message
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs2 = [
            {"role": "user", "content": "edited"},
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "+"},
        ]
        try:
            await client.chat.completions.create(model="m", messages=msgs2)
        except openai.BadRequestError as e:
            errors["rewrite"] = e.message
        return 1.0  # the agent carries on: the episode must fail all the same

    eng, _ = engine_for([ids("x") + [EOS], ids("y") + [EOS]])
    with pytest.raises(EpisodeError, match=r"call 2: message 0 \(user\) is not what call 1 sent"):
        run(episode(make_agent(agent_func, in_process=in_process), eng))
    assert "'stream': true is not served" in errors["stream"]
    assert "'n' must be 1" in errors["n"]
    assert "'stop' strings are not served" in errors["stop"]
    assert "is not what call 1 sent" in errors["rewrite"]


def test_a_call_past_max_len_is_refused_and_the_episode_ends_as_length_with_the_agents_reward():
    import openai

    async def agent_func(client, prompt, label):
        msgs = [{"role": "user", "content": prompt}]
        try:
            while True:
                r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
                msgs += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "?"},
                ]
        except openai.BadRequestError as e:
            assert "--max_len" in e.message
        return 0.5

    eng, req = engine_for([ids("abcdef")] * 10, max_len=40)
    ep = run(episode(make_agent(agent_func), eng))
    assert all(n <= 3 for _, n in req.calls)  # the request's max_tokens, under the per-turn cap of 100
    assert (ep.finish_reason, ep.reward) == ("length", 0.5)
    assert len(ep.prompt) + len(ep.response) <= 40


@TRANSPORTS
def test_completions_models_and_tokenize_through_http(in_process):
    got = {}

    async def agent_func(client, prompt, label, **kw):
        got["kw"] = kw
        got["models"] = [m.id for m in (await client.models.list()).data]
        r = await client.completions.create(model="m", prompt="2+2=", logprobs=1)
        got["text"], got["lps"] = r.choices[0].text, r.choices[0].logprobs.token_logprobs
        r = await client.completions.create(model="m", prompt="2+2=" + r.choices[0].text + "\n3+3=")
        root = str(client.base_url).rstrip("/").removesuffix("/v1")  # vLLM serves /tokenize beside /v1
        tok = await client.post(root + "/tokenize", body={"prompt": "ab"}, cast_to=object)
        got["tokenize"] = tok
        try:
            await client.with_options(base_url="http://127.0.0.1:1/v1").models.list()
        except Exception as e:  # noqa: BLE001 - in-process: the endpoint's refusal; over HTTP: no server there
            got["elsewhere"] = str(e)
        return 1

    eng, req = engine_for([ids("4") + [EOS], ids("6") + [EOS]])
    ep = run(episode(make_agent(agent_func, in_process=in_process), eng))
    if in_process:  # the handed client answers for its endpoint only, never for another host
        assert "reaches only its episode's endpoint" in got["elsewhere"]
    assert got["kw"] == {"model": "char-model", "max_tokens": 100, "max_len": 200}
    assert got["models"] == ["char-model"]
    assert got["text"] == "4" and got["lps"] == pytest.approx([-0.1, -0.2])
    assert req.calls[1][0] == ids("2+2=4") + [EOS] + ids("\n3+3=")
    assert ep.response == ids("4") + [EOS] + ids("\n3+3=") + ids("6") + [EOS]
    assert got["tokenize"]["tokens"] == ids("ab") and got["tokenize"]["max_model_len"] == 200


# ---------------------------------------------------------------------------------------- the file
def test_agent_func_files_are_told_apart_loaded_and_their_rewards_read(tmp_path):
    good = agent_file(tmp_path, "async def agent_func(client, prompt, label):\n    return 1.0\n")
    assert defines_agent_func(good)
    fn, identity = load_agent_func(good)
    assert identity.startswith("agent.py:")
    executor = agent_file(tmp_path, "class AgentExecutor: ...\nasync def agent_func(c, p, l): ...\n", "ex.py")
    assert not defines_agent_func(executor)
    sync = agent_file(tmp_path, "def agent_func(client, prompt, label):\n    return 1.0\n", "sync.py")
    assert defines_agent_func(sync)
    with pytest.raises(ValueError, match=r"sync.py: agent_func must be an async function"):
        load_agent_func(sync)
    assert reward_of(0.5) == (0.5, 0.5, {})
    assert reward_of({"rewards": 1, "scores": 0, "extra_logs": {"hit": True}}) == (1.0, 0.0, {"hit": 1.0})
    assert reward_of(None) == (None, None, {})  # the run's reward service scores it
    with pytest.raises(EpisodeError, match="'rewards' must be a number"):
        reward_of({"rewards": "high"})
    with pytest.raises(EpisodeError, match="one of 'rewards' or 'reward'"):
        reward_of({"score": 1})
    assert "helpers" in sys.modules  # (the helpers import path the suite sets)


# ---------------------------------------------------------------------------------------- in the core
def core_running_agent_func(func, in_process: bool = True):
    """A core on the vLLM stand-in (``helpers.fake_llm``) whose episodes run ``func`` through the
    endpoint. The stand-in samples 3 + (input length + t) % 7 (EOS is 3), log-prob -1.5; its
    vocabulary is widened to the character tokenizer's text."""
    from common import protocol as P
    from helpers.fake_llm import core_on_fake_llm
    from rollout_service.episodes import EpisodeRunner

    agent = OpenAIAgent(func, "f.py:0123456789ab", TOK, model="m", in_process=in_process)
    core = core_on_fake_llm(EpisodeRunner(agent, TOK, max_model_len=200), max_model_len=200)
    core.llm.model_config = SimpleNamespace(get_vocab_size=lambda: 256)
    return core, P.AgentParams(agent="f.py:0123456789ab", max_len=200, max_turns=0, step_timeout_s=5)


def test_calls_go_through_the_cores_gate_a_weight_update_mid_episode_included():
    from common import protocol as P

    answered, pushed = [], asyncio.Event()

    async def agent_func(client, prompt, label):
        msgs = [{"role": "user", "content": "q"}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        answered.append(1)
        await pushed.wait()  # the update lands while the agent thinks
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=msgs)
        return 1.0

    core, params = core_running_agent_func(agent_func)
    sp = P.SamplingParams(temperature=1.0, max_new_tokens=3, n=2, logprobs=True)

    async def scenario():
        ep = asyncio.ensure_future(core.generate(1, ids("learner"), sp, agent=params, label=""))
        while len(answered) < 2:  # both episodes' first calls answered on v0
            await asyncio.sleep(0.01)
        await core.start_weight_update(1)
        await core.update_weights(["w"], ["float32"], [[1]])
        await core.finish_weight_update(1)
        pushed.set()
        res = await ep
        await core.shutdown()
        return res

    llm = core.llm  # (shutdown lets go of it)
    res = run(scenario())
    p1 = ids(render([{"role": "user", "content": "q"}]))
    a1 = [3 + (len(p1) + t) % 7 for t in range(3)]  # cut by length: the template's EOS follows as feedback
    env = [EOS] + ids("\n\x01user\nagain\x03\n\x01assistant\n")
    a2 = [3 + (len(p1) + 3 + len(env) + t) % 7 for t in range(3)]
    for s in res.samples:
        assert s.episode.prompt == p1 and s.token_ids == a1 + env + a2
        assert s.episode.action_mask == [1] * 3 + [0] * len(env) + [1] * 3
        assert s.logprobs == [-1.5] * 3 + [0.0] * len(env) + [-1.5] * 3
        assert s.policy_version == 0 and s.episode.turns == 2 and s.finish_reason == "length"
    salts = [p.get("cache_salt") for p in llm.prompts.values()]
    assert salts.count("rayless-v0") == 2 and salts.count("rayless-v1") == 2
    assert core.episodes.counters["episodes"] == 2


@TRANSPORTS
def test_an_episode_cancelled_mid_call_aborts_the_engine_request_behind_the_endpoint(in_process):
    """The episode's cancel reaches the agent as a cancel (never swallowed into an answer it could
    catch and carry on from) and aborts the engine request of the call it was waiting on."""
    from common import protocol as P

    got = {}

    async def agent_func(client, prompt, label):
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        except asyncio.CancelledError:
            got["cancelled"] = True
            raise
        except Exception as e:  # noqa: BLE001 - what an agent that carries on would catch
            got["caught"] = type(e).__name__
        return 0.0

    core, params = core_running_agent_func(agent_func, in_process)
    llm = core.llm
    sp = P.SamplingParams(temperature=1.0, max_new_tokens=100, n=1, logprobs=True)  # 1 s on the stand-in

    async def scenario():
        ep = asyncio.ensure_future(core.generate(1, ids("learner"), sp, agent=params, label=""))
        while not llm.running:  # the call is in the engine
            await asyncio.sleep(0.01)
        ep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ep
        for _ in range(50):
            if "abort" in llm.calls:
                break
            await asyncio.sleep(0.02)
        assert "abort" in llm.calls
        await core.shutdown()

    run(scenario())
    assert got == {"cancelled": True}


def test_the_calculator_example_trains_with_its_tool():
    """examples/agents/openai_calculator.py as a user would run it, on the scripted engine: a
    calculator call, the tool's value in the conversation, the right answer rewarded."""
    pytest.importorskip("vllm")
    from helpers.paths import ROOT

    func, _ = load_agent_func(str(ROOT / "examples/agents/openai_calculator.py"))
    calc = func.__globals__["calculate"]
    assert calc("(3 + 4) * 12") == "84" and calc("1/4") == "0.25"
    assert calc("__import__('os')").startswith("error") and calc("2 ** 1000").startswith("error")
    a1 = ids('<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>') + [EOS]
    a2 = ids("It is 391") + [EOS]
    eng, req = engine_for([a1, a2], max_len=400)
    ep = run(episode(make_agent(func, "hermes"), eng, prompt="What is 17 * 23?", label="391"))
    assert (ep.reward, ep.turns, ep.extra_logs) == (1.0, 2, {"tool_calls": 1.0, "answered": 1.0})
    assert "\x01tool\n391\x03" in text(req.calls[1][0])  # the tool's value, as the template writes it


# ---------------------------------------------------------------------------------------- one llm_engine
def test_an_executor_that_keeps_the_first_llm_engine_and_calls_it_from_its_own_thread_trains():
    """OpenRLHF's agent_func_openai_server_executor.py keeps the first episode's llm_engine and
    calls it from a uvicorn thread: every episode of every prompt, two prompts at once and one
    after them, is built from its own calls (before: 'the episode took no action')."""
    from common import protocol as P
    from helpers.agent_fakes import CharTokenizer
    from helpers.fake_llm import core_on_fake_llm
    from helpers.thread_server_executor import AgentExecutor
    from rollout_service.episodes import EpisodeRunner, InProcessAgent

    tok = CharTokenizer()
    core = core_on_fake_llm(EpisodeRunner(InProcessAgent(AgentExecutor(), "t.py:0", tok), tok, max_model_len=64))
    params = P.AgentParams(agent="t.py:0", max_len=40, max_turns=0, step_timeout_s=5)
    sp = P.SamplingParams(temperature=1.0, max_new_tokens=3, n=2, logprobs=True)

    async def scenario():
        both = await asyncio.gather(
            core.generate(1, [1, 2], sp, agent=params, label=""),
            core.generate(2, [5, 6, 7], sp, agent=params, label=""),
        )
        later = await core.generate(3, [8], sp, agent=params, label="")
        await core.shutdown()
        return [*both, later]

    for res in run(scenario()):
        n = len(res.prompt_token_ids)
        a1 = [3 + (n + t) % 7 for t in range(3)]
        a2 = [3 + (n + 4 + t) % 7 for t in range(3)]
        for s in res.samples:
            assert s.episode.prompt == res.prompt_token_ids and s.token_ids == a1 + [ord("?")] + a2
            assert s.episode.action_mask == [1, 1, 1, 0, 1, 1, 1] and s.episode.turns == 2


def test_twin_episodes_whose_first_calls_crossed_are_each_built_from_their_own_calls():
    """Two episodes of one prompt, calls from a foreign thread: the first call cannot say whose it
    is, so episode A's lands on B's engine; when A's executor returns, the records are exchanged."""
    import threading

    from helpers.agent_fakes import CharTokenizer
    from rollout_service.shared_engine import SharedEngine, SharedEngineExecutor

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    shared = SharedEngine(CharTokenizer().decode)
    b_started, a_done = asyncio.Event(), asyncio.Event()

    class Executor:
        async def execute(self, prompt, label, sp, max_length, tokenizer, llm_engine):
            me = label
            if me == "A":
                await b_started.wait()  # B is registered first, so A's first call goes to B's engine
            else:
                b_started.set()
                await a_done.wait()
            toks = ids(prompt)
            out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(llm_engine.generate(toks, sp), loop))
            seq = toks + list(out.outputs[0].token_ids)
            if me == "A":
                a_done.set()
            return {"observation_tokens": seq, "action_ranges": [(len(toks), len(seq))], "reward": 1.0}

    async def main():
        req = ScriptedRequest([ids("aa"), ids("bb")])  # one engine behind both, as the server's gate is
        ea, eb = (TurnEngine(req, same_params, prompt_token_ids=ids("p"), max_len=100) for _ in range(2))
        run_ = SharedEngineExecutor(Executor(), shared)
        # B's episode starts (and registers) first.
        tb = asyncio.ensure_future(run_.execute("p", "B", PARAMS, 100, TOK, eb))
        await asyncio.sleep(0)
        ta = asyncio.ensure_future(run_.execute("p", "A", PARAMS, 100, TOK, ea))
        ra, rb = await asyncio.gather(ta, tb)
        return ea, eb, ra, rb

    ea, eb, ra, rb = run(main())
    loop.call_soon_threadsafe(loop.stop)
    assert ra["observation_tokens"] == ids("paa") and rb["observation_tokens"] == ids("pbb")
    assert [t.action for t in ea.turns] == [ids("aa")] and [t.action for t in eb.turns] == [ids("bb")]


def test_an_agent_func_file_loads_as_the_openai_kind_and_stays_in_process_with_env_workers(tmp_path):
    from rollout_service.episodes import EpisodeRunner

    path = agent_file(tmp_path, "async def agent_func(client, prompt, label):\n    return 1.0\n")
    runner = EpisodeRunner(OpenAIAgent(load_agent_func(path)[0], "a.py:0", TOK, model="m"), TOK, max_model_len=64)
    assert run(runner.in_workers(path, "m", workers=2)) is runner


def test_chat_template_kwargs_reach_the_template_and_may_not_change_within_an_episode():
    t = Trace(TOK)
    m1 = [{"role": "user", "content": "hi"}]
    c1 = t.chat_prompt(m1, None, {"enable_thinking": False})
    assert text(c1.prompt).endswith("\x01assistant\n<think></think>")
    t.record(c1, ids("ok") + [EOS], "stop")
    m2 = [*m1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    c2 = t.chat_prompt(m2, None, {"enable_thinking": False})
    assert c2.prompt == c1.prompt + ids("ok") + [EOS] + ids("\n\x01user\nmore\x03\n\x01assistant\n<think></think>")
    with pytest.raises(TraceError, match="call 2 changed 'chat_template_kwargs'"):
        t.chat_prompt(m2)


def test_with_the_tiny_models_own_tokenizer_the_stitched_input_is_the_templates_rendering(tiny_model_dir):
    """The tiny model's ChatML template keeps history as it was, so exact reuse must give, token
    for token, what the template itself renders for the whole conversation: the sampled reply
    (ending in its <|im_end|>) stands where the template writes the reply's text, no token of the
    policy's re-encoded, none doubled."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Trace(tok)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"}]
    c1 = t.chat_prompt(msgs)
    assert c1.prompt == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    reply = "four, I think"
    a1 = list(tok(reply, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]  # as sampled, EOS kept
    t.record(c1, a1, "stop")
    msgs = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "and three plus three"}]
    c2 = t.chat_prompt(msgs)
    whole = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert c2.prompt == list(tok(whole, add_special_tokens=False)["input_ids"])
    assert c2.prompt[: len(c1.prompt) + len(a1)] == c1.prompt + a1
