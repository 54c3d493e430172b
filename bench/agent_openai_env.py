"""The task ``bench/agent.py --openai`` runs two ways on one engine: the same episodes through the
OpenAI-compatible endpoint and through the direct agent contract.

* direct (``direct_source``): an OpenRLHF-contract executor (``MultiTurnAgentExecutor``) whose
  environment answers each action with the chat template's next user turn ("go on") for K turns;
* openai (``openai_source``): an ``agent_func`` that does the same with the ``openai`` client (K
  chat calls, each sending the conversation so far plus "go on"), every call through the
  endpoint (``rollout_service/openai_api.py``): the client's request, the trace's template
  rendering and checks, the answer; in this process (the client rayless hands an agent) or over
  loopback HTTP (``in_process=False``: what any other client pays).

Both episodes hold the same tokens (the chat-templated prompt, K actions of up to T tokens, the
same feedback between them). ``endpoint_overhead``: the time of one chat call with an engine that
answers at once, so that the ratio can be read against it.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

IDENTITY = "bench_openai.py:000000000000"
FEEDBACK_USER = "go on"


def _direct_executor(turns: int):
    from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor

    class GoOn(AgentInstanceBase):
        def __init__(self, *a, **k) -> None:
            self.turn = 0

        async def reset(self, states, **kwargs):
            return {"observation": _chat_prompt(states["observation"])}

        async def step(self, states, **kwargs):
            self.turn += 1
            done = self.turn >= turns
            feedback = (
                "" if done else f"<|im_end|>\n<|im_start|>user\n{FEEDBACK_USER}<|im_end|>\n<|im_start|>assistant\n"
            )
            return {"rewards": 1.0, "environment_feedback": feedback, "done": done}

    return MultiTurnAgentExecutor(GoOn)


def _chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"  # the tiny model's template


def _agent_func(turns: int):
    async def agent_func(client, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        for turn in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            if turn + 1 < turns:
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
                messages += [{"role": "user", "content": FEEDBACK_USER}]
        return 1.0

    return agent_func


def direct_source(turns: int, tokenizer):
    from rollout_service.episodes import InProcessAgent

    return InProcessAgent(_direct_executor(turns), IDENTITY, tokenizer)


def openai_source(turns: int, tokenizer, in_process: bool = True):
    from rollout_service.agent_openai import OpenAIAgent

    return OpenAIAgent(_agent_func(turns), IDENTITY, tokenizer, model="policy", in_process=in_process)


def prompts(tokenizer, count: int, words: int, rng) -> list[list[int]]:
    """``count`` prompts of ``words`` random words each, as token ids (the agent reads them as text)."""
    vocab = ["alpha", "beta", "gamma", "delta", "one", "two", "three", "red", "blue"]
    texts = [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(count)]
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


async def endpoint_overhead(tokenizer, calls: int = 200, in_process: bool = True) -> float:
    """Seconds per chat call through the endpoint with an engine that answers at once (the median
    over episodes of 5 calls), in this process or over loopback HTTP."""
    from rollout_service.agent import TurnEngine
    from rollout_service.agent_openai import OpenAIAgent

    eos = tokenizer.eos_token_id

    async def request(toks, params):
        lp = {eos: SimpleNamespace(logprob=-0.5)}
        out = SimpleNamespace(
            index=0, token_ids=[eos], text="", logprobs=[lp], finish_reason="stop", weight_versions=[]
        )
        return SimpleNamespace(outputs=[out], num_cached_tokens=0), 0

    timing = {}
    per_episode = 5  # calls: a short conversation, as the bench's episodes are

    async def agent_func(client, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        t0 = time.perf_counter()
        for _ in range(per_episode):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "x"},
            ]
        timing["per_call"] = (time.perf_counter() - t0) / per_episode
        return 1.0

    agent = OpenAIAgent(agent_func, IDENTITY, tokenizer, model="m", in_process=in_process)
    per_call = []
    try:
        for _ in range(calls // per_episode):
            engine = TurnEngine(request, lambda p: p, prompt_token_ids=[1], max_len=10_000)
            await agent.run("hello", "", SimpleNamespace(max_tokens=8), engine, 60)
            per_call.append(timing["per_call"])
    finally:
        await agent.close()
    return statistics.median(per_call)
