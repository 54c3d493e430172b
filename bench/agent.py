"""The agent loop's cost: episodes against plain generation of the same tokens on the same engine.

One ``RolloutCore`` (the rollout server's socket-free core, a real vLLM ``AsyncLLM``) on the
tiny model, with ``bench/agent_env.py`` as its agent. In alternating rounds, the same P prompts
x n samples are generated as:

* plain: one request per prompt, up to K x T new tokens per sample;
* agent, zero-cost environment: episodes of K turns of up to T tokens (each turn a request of
  its own, its input the episode so far; the environment answers at once, with no feedback);
* agent, slow environment: the same, each step waiting ``--step_s`` (default 50 ms; awaited by
  an ``async def step``, or with ``--blocking`` slept in a plain ``def`` the server runs in a
  thread);
* agent in worker processes, zero-cost environment: the zero-cost episodes with the executor in
  ``--env_workers`` environment worker processes (``rollout_service/env_pool.py``, the server's
  ``--agent_env_workers``), every turn a message to the server and back.

With ``--openai``, the task is a chat (``bench/agent_openai_env.py``) and the variants are the
OpenAI-compatible endpoint's (issue 39): the same episodes as an OpenRLHF-contract executor
(direct), as an ``agent_func`` with the ``openai`` client rayless hands it (openai: its requests
answered in the server's process), and the same over loopback HTTP (openai_http: what any other
client pays). Goal: openai / direct >= 0.85. The endpoint's own time per call (an engine
answering at once) is printed first.

Reported per variant: generated tokens/s (the policy's tokens only) and episodes/s; the medians
of the per-round ratios are the numbers to read. Goals (issue 26): zero-cost agent / plain
>= 0.9 (the loop adds little), slow / zero-cost >= 0.8 at 16+ concurrent episodes (waiting on
environments overlaps generation), zero-cost agent in workers / plain >= 0.9 (issue 39: the
environments out of the engine's process cost little). The later turns' prefix-cache hit rate is printed too (the
CPU backend caches whole 128-token blocks: the prompts are long enough to fill one).

Run: ``python bench/agent.py [--rounds 4] [--prompts 16] [--n 2] [--turns 3] [--turn_tokens 48]
[--step_s 0.05] [--blocking] [--env_workers 2]``, or ``python bench/agent.py --openai [--rounds 4]
[--turn_tokens 32]`` (needs vllm; prints a JSON summary line last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from _setup import prepare

REPO = prepare(tests=True)
ENV_FILE = REPO / "bench" / "agent_env.py"


async def _run(core, prompts, sampling, agent=None) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(core.generate(10_000 + i, p, sampling, agent=agent, label="") for i, p in enumerate(prompts))
    )
    wall = time.perf_counter() - t0
    samples = [s for r in results for s in r.samples]
    if agent is None:
        tokens = sum(len(s.token_ids) for s in samples)
    else:
        tokens = sum(sum(s.episode.action_mask) for s in samples)
    return {"s": wall, "tokens_per_s": tokens / wall, "episodes_per_s": len(samples) / wall, "tokens": tokens}


class _Switch:
    """The episode source of the bench's core: one of several (in this process, in the worker
    pool, through the OpenAI endpoint), as the variant asks (one engine for every variant)."""

    def __init__(self, sources: dict) -> None:
        self.sources = sources
        self.use = next(iter(sources))
        self.identity = sources[self.use].identity

    async def run(self, *args):
        return await self.sources[self.use].run(*args)

    async def close(self) -> None:
        for source in self.sources.values():
            close = getattr(source, "close", None)
            if close is not None:
                await close()


async def _core(switch: _Switch, tokenizer):
    """The tiny model's rollout core with ``switch`` as its agent."""
    from rollout_service.config import RolloutConfig
    from rollout_service.core import RolloutCore
    from rollout_service.episodes import EpisodeRunner

    cfg = RolloutConfig(
        model=str(tiny_model()),
        controller="tcp://127.0.0.1:1",
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=64,
        seed=0,
    )
    return await RolloutCore.create(cfg, episodes=EpisodeRunner(switch, tokenizer, max_model_len=cfg.max_model_len))


def tiny_model() -> Path:
    from common.tiny import build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / "rayless-bench-tiny")


async def _rounds(core, variant, names: list[str], rounds: int, line) -> list[dict]:
    """``rounds`` rounds of every variant, the order reversed every other round (the host's
    drift falls on each alike); ``line(round, results)`` prints a round."""
    for name in names:  # warm-up: first-use costs out of the rounds
        await variant(name)
    out = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        before = core.metrics()
        got = {name: await variant(name) for name in order}
        later = core.metrics()["agent_later_turn_tokens"] - before["agent_later_turn_tokens"]
        cached = core.metrics()["agent_later_turn_cached"] - before["agent_later_turn_cached"]
        got["prefix_hit"] = cached / later if later else float("nan")
        out.append(got)
        print(f"round {r}: {line(got)}", flush=True)
    return out


def _median(rounds: list[dict], f) -> float:
    return statistics.median(f(g) for g in rounds)


async def main_async(args) -> dict:
    from common import protocol as P
    from rollout_service.episodes import EpisodeRunner

    model = tiny_model()
    os.environ["RAYLESS_BENCH_TURNS"] = str(args.turns)  # before the workers start: they read their own copy
    os.environ["RAYLESS_BENCH_STEP_S"] = "0"  # the workers' environment is the zero-cost one
    os.environ["RAYLESS_BENCH_BLOCKING"] = "0"
    in_process = EpisodeRunner.load(str(ENV_FILE), str(model), max_model_len=1024)
    pooled = await in_process.in_workers(str(ENV_FILE), str(model), workers=args.env_workers)
    switch = _Switch({"agent": in_process.source, "workers": pooled.source})
    core = await _core(switch, in_process.tokenizer)
    rng = random.Random(0)
    vocab = core.llm.model_config.get_vocab_size()
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)] for _ in range(args.prompts)]
    k, t = args.turns, args.turn_tokens
    agent = P.AgentParams(
        agent=core.agent_identity, max_len=args.prompt_len + k * t + 1, max_turns=k, step_timeout_s=60
    )
    os.environ["RAYLESS_BENCH_BLOCKING"] = "1" if args.blocking else "0"
    # the episodes' turns stop on the tokens the plain samples stop on: none but the length
    plain_sp = P.SamplingParams(n=args.n, temperature=1.0, max_new_tokens=k * t, stop_token_ids=[])
    turn_sp = P.SamplingParams(n=args.n, temperature=1.0, max_new_tokens=t, stop_token_ids=[])

    async def variant(name: str) -> dict:
        if name == "plain":
            return await _run(core, prompts, plain_sp)
        switch.use = "workers" if name == "workers" else "agent"
        os.environ["RAYLESS_BENCH_STEP_S"] = str(args.step_s) if name == "slow_env" else "0"
        return await _run(core, prompts, turn_sp, agent)

    def line(got: dict) -> str:
        return (
            f"plain {got['plain']['tokens_per_s']:.0f} tok/s, agent {got['agent']['tokens_per_s']:.0f}, "
            f"in {args.env_workers} workers {got['workers']['tokens_per_s']:.0f}, "
            f"slow env {got['slow_env']['tokens_per_s']:.0f} ({got['slow_env']['episodes_per_s']:.1f} episodes/s); "
            f"later turns' prefix-cache hit {got['prefix_hit']:.2f}"
        )

    rounds = await _rounds(core, variant, ["plain", "agent", "workers", "slow_env"], args.rounds, line)
    await core.shutdown()

    def med(f) -> float:
        return _median(rounds, f)

    return {
        "prompts": args.prompts,
        "n": args.n,
        "concurrent_episodes": args.prompts * args.n,
        "turns": k,
        "turn_tokens": t,
        "step_s": args.step_s,
        "blocking_step": args.blocking,
        "plain_tokens_per_s": med(lambda g: g["plain"]["tokens_per_s"]),
        "agent_tokens_per_s": med(lambda g: g["agent"]["tokens_per_s"]),
        "slow_env_tokens_per_s": med(lambda g: g["slow_env"]["tokens_per_s"]),
        "agent_over_plain": med(lambda g: g["agent"]["tokens_per_s"] / g["plain"]["tokens_per_s"]),
        "env_workers": args.env_workers,
        "workers_tokens_per_s": med(lambda g: g["workers"]["tokens_per_s"]),
        "workers_over_plain": med(lambda g: g["workers"]["tokens_per_s"] / g["plain"]["tokens_per_s"]),
        "workers_over_agent": med(lambda g: g["workers"]["tokens_per_s"] / g["agent"]["tokens_per_s"]),
        "slow_env_over_agent": med(lambda g: g["slow_env"]["tokens_per_s"] / g["agent"]["tokens_per_s"]),
        "later_turn_prefix_hit": med(lambda g: g["prefix_hit"]),
    }


async def main_openai(args) -> dict:
    """``--openai``: the endpoint's variants (module docstring)."""
    import agent_openai_env as task
    from transformers import AutoTokenizer

    from common import protocol as P

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model()))
    alone = {name: await task.endpoint_overhead(tokenizer, in_process=name == "openai") for name in OPENAI_VARIANTS}
    print(
        f"endpoint alone (engine answering at once), ms per chat call: in process {alone['openai'] * 1000:.2f}, "
        f"over loopback HTTP {alone['openai_http'] * 1000:.2f}",
        flush=True,
    )
    k, t = args.turns, args.turn_tokens
    switch = _Switch(
        {
            "direct": task.direct_source(k, tokenizer),
            "openai": task.openai_source(k, tokenizer, in_process=True),
            "openai_http": task.openai_source(k, tokenizer, in_process=False),
        }
    )
    core = await _core(switch, tokenizer)
    prompts = task.prompts(tokenizer, args.prompts, args.prompt_words, random.Random(0))
    agent = P.AgentParams(agent=task.IDENTITY, max_len=1000, max_turns=k, step_timeout_s=60)
    sp = P.SamplingParams(n=args.n, temperature=1.0, max_new_tokens=t, stop_token_ids=[])

    async def variant(name: str) -> dict:
        switch.use = name
        return await _run(core, prompts, sp, agent)

    def line(got: dict) -> str:
        return ", ".join(
            f"{name} {got[name]['episodes_per_s']:.2f} episodes/s ({got[name]['tokens_per_s']:.0f} tok/s)"
            for name in ("direct", *OPENAI_VARIANTS)
        )

    rounds = await _rounds(core, variant, ["direct", *OPENAI_VARIANTS], args.rounds, line)
    await core.shutdown()
    out: dict = {
        "prompts": args.prompts,
        "n": args.n,
        "concurrent_episodes": args.prompts * args.n,
        "turns": k,
        "turn_tokens": t,
        "direct_episodes_per_s": _median(rounds, lambda g: g["direct"]["episodes_per_s"]),
    }
    for name in OPENAI_VARIANTS:
        out[f"{name}_ms_per_call_alone"] = alone[name] * 1000
        out[f"{name}_episodes_per_s"] = _median(rounds, lambda g, n=name: g[n]["episodes_per_s"])
        out[f"{name}_over_direct"] = _median(
            rounds, lambda g, n=name: g[n]["episodes_per_s"] / g["direct"]["episodes_per_s"]
        )
    return out


OPENAI_VARIANTS = ("openai", "openai_http")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openai", action="store_true", help="the OpenAI endpoint's variants against the direct contract")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2, help="episodes per prompt (concurrent episodes: prompts x n)")
    ap.add_argument("--prompt_len", type=int, default=120)
    ap.add_argument("--prompt_words", type=int, default=40, help="--openai: words of a prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn_tokens", type=int, default=0, help="a turn's cap (default 48; 32 with --openai)")
    ap.add_argument("--step_s", type=float, default=0.05, help="the slow environment's step")
    ap.add_argument("--blocking", action="store_true", help="the slow step sleeps in a plain def (a thread)")
    ap.add_argument("--env_workers", type=int, default=2, help="environment worker processes of the workers variant")
    args = ap.parse_args()
    args.turn_tokens = args.turn_tokens or (32 if args.openai else 48)
    if args.openai:
        summary = asyncio.run(main_openai(args))
        print(
            f"episodes/s through the OpenAI endpoint / the direct contract: {summary['openai_over_direct']:.2f} "
            f"(goal >= 0.85; over loopback HTTP {summary['openai_http_over_direct']:.2f}) at "
            f"{summary['concurrent_episodes']} concurrent episodes; the endpoint alone "
            f"{summary['openai_ms_per_call_alone']:.2f} ms per call ({summary['openai_http_ms_per_call_alone']:.2f} "
            "over HTTP)"
        )
    else:
        summary = asyncio.run(main_async(args))
        print(
            f"agent loop / plain generation: {summary['agent_over_plain']:.2f} (goal >= 0.9); in "
            f"{summary['env_workers']} environment workers / plain: {summary['workers_over_plain']:.2f} (goal >= 0.9); "
            f"{summary['step_s'] * 1000:.0f} ms environment / zero-cost: {summary['slow_env_over_agent']:.2f} "
            f"(goal >= 0.8) at {summary['concurrent_episodes']} concurrent episodes"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
