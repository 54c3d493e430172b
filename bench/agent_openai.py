"""The OpenAI-compatible endpoint's cost: episodes through it against the direct agent contract.

One ``RolloutCore`` (a real vLLM ``AsyncLLM``, the tiny model) runs the same task two ways, in
alternating rounds, on the same engine:

* direct: an OpenRLHF-contract executor (``MultiTurnAgentExecutor``) whose environment answers
  each action with the chat template's next user turn ("go on") for K turns;
* openai: an ``agent_func`` that does the same over HTTP with the ``openai`` client (K chat
  calls, each sending the conversation so far plus "go on"), every call through the endpoint
  (``rollout_service/openai_api.py``): JSON, uvicorn, the trace's template rendering and checks.

Both episodes hold the same tokens (the chat-templated prompt, K actions of up to T tokens, the
same feedback between them). Reported: episodes/s and the policy's tokens/s of each, the median
of the per-round ratio openai / direct (goal >= 0.85, issue 39), and the endpoint's own time per
call measured without the engine (a stand-in answering at once), so the ratio can be read
against it.

Run: ``python bench/agent_openai.py [--rounds 3] [--prompts 16] [--n 2] [--turns 3]
[--turn_tokens 32]`` (needs vllm; prints a JSON summary line last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _setup import prepare

REPO = prepare(tests=True)
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


class _Switch:
    """The core's episode source: the direct executor or the endpoint, as the round asks."""

    def __init__(self, direct, openai) -> None:
        self.direct, self.openai, self.use_openai, self.identity = direct, openai, False, IDENTITY

    async def run(self, *args):
        return await (self.openai if self.use_openai else self.direct).run(*args)

    async def close(self) -> None:
        await self.openai.close()


async def _run(core, prompts, sampling, agent) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(core.generate(10_000 + i, p, sampling, agent=agent, label="") for i, p in enumerate(prompts))
    )
    wall = time.perf_counter() - t0
    samples = [s for r in results for s in r.samples]
    tokens = sum(sum(s.episode.action_mask) for s in samples)
    return {"s": wall, "episodes_per_s": len(samples) / wall, "tokens_per_s": tokens / wall}


async def endpoint_overhead(tokenizer, calls: int = 200) -> float:
    """Seconds per chat call through the endpoint with an engine that answers at once."""
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

    async def agent_func(client, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        t0 = time.perf_counter()
        for _ in range(calls):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "x"},
            ]
            if len(messages) > 9:  # keep the conversation short: a new episode's worth
                break
        timing["first"] = (time.perf_counter() - t0) / 5
        return 1.0

    agent = OpenAIAgent(agent_func, IDENTITY, tokenizer, model="m")
    per_call = []
    try:
        for _ in range(calls // 5):
            engine = TurnEngine(request, lambda p: p, prompt_token_ids=[1], max_len=10_000)
            await agent.run("hello", "", SimpleNamespace(max_tokens=8), engine, 60)
            per_call.append(timing["first"])
    finally:
        await agent.close()
    return statistics.median(per_call)


async def main_async(args) -> dict:
    from transformers import AutoTokenizer

    from common import protocol as P
    from common.tiny import build_tiny_model
    from rollout_service.agent_openai import OpenAIAgent
    from rollout_service.config import RolloutConfig
    from rollout_service.core import RolloutCore
    from rollout_service.episodes import EpisodeRunner, InProcessAgent

    model = build_tiny_model(Path(tempfile.gettempdir()) / "rayless-bench-tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    overhead = await endpoint_overhead(tokenizer)
    print(f"endpoint alone: {overhead * 1000:.2f} ms per chat call (engine answering at once)", flush=True)
    cfg = RolloutConfig(
        model=str(model),
        controller="tcp://127.0.0.1:1",
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=64,
        seed=0,
    )
    switch = _Switch(
        InProcessAgent(_direct_executor(args.turns), IDENTITY, tokenizer),
        OpenAIAgent(_agent_func(args.turns), IDENTITY, tokenizer, model="policy"),
    )
    core = await RolloutCore.create(cfg, episodes=EpisodeRunner(switch, tokenizer, max_model_len=cfg.max_model_len))
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "one", "two", "three", "red", "blue"]
    texts = [" ".join(rng.choice(words) for _ in range(args.prompt_words)) for _ in range(args.prompts)]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    k, t = args.turns, args.turn_tokens
    agent = P.AgentParams(agent=IDENTITY, max_len=1000, max_turns=k, step_timeout_s=60)
    sp = P.SamplingParams(n=args.n, temperature=1.0, max_new_tokens=t, stop_token_ids=[])

    async def variant(name: str) -> dict:
        switch.use_openai = name == "openai"
        return await _run(core, prompts, sp, agent)

    await variant("direct")  # warm-up: first-use costs (the endpoint's start) out of the rounds
    await variant("openai")
    rounds = []
    for r in range(args.rounds):
        order = ["direct", "openai"] if r % 2 == 0 else ["openai", "direct"]
        got = {name: await variant(name) for name in order}
        rounds.append(got)
        print(
            f"round {r}: direct {got['direct']['episodes_per_s']:.2f} episodes/s "
            f"({got['direct']['tokens_per_s']:.0f} tok/s), openai endpoint {got['openai']['episodes_per_s']:.2f} "
            f"({got['openai']['tokens_per_s']:.0f} tok/s)",
            flush=True,
        )
    await core.shutdown()

    def med(f) -> float:
        return statistics.median(f(g) for g in rounds)

    return {
        "prompts": args.prompts,
        "n": args.n,
        "concurrent_episodes": args.prompts * args.n,
        "turns": k,
        "turn_tokens": t,
        "endpoint_ms_per_call": overhead * 1000,
        "direct_episodes_per_s": med(lambda g: g["direct"]["episodes_per_s"]),
        "openai_episodes_per_s": med(lambda g: g["openai"]["episodes_per_s"]),
        "openai_over_direct": med(lambda g: g["openai"]["episodes_per_s"] / g["direct"]["episodes_per_s"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2, help="episodes per prompt (concurrent episodes: prompts x n)")
    ap.add_argument("--prompt_words", type=int, default=40)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn_tokens", type=int, default=32)
    summary = asyncio.run(main_async(ap.parse_args()))
    print(
        f"episodes/s through the OpenAI endpoint / the direct contract: {summary['openai_over_direct']:.2f} "
        f"(goal >= 0.85) at {summary['concurrent_episodes']} concurrent episodes; the endpoint alone "
        f"{summary['endpoint_ms_per_call']:.2f} ms per call"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
