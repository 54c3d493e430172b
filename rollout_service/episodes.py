"""``EpisodeRunner``: a rollout server's agent episodes (``--agent_func_path``, docs/agents.md).

When the learner asks for episodes (``PromptBatch.agent``), each prompt becomes ``sampling.n``
episodes run concurrently, every turn on this server's engine through the core's version gate
(``RolloutCore.turn``): a turn waits out a weight update like any prompt, and its prefix cache
holds the episode's earlier turns. An episode that fails (the environment raised, hung, answered
garbage) fails the prompt: counted, logged with its id, and answered as an error the controller
re-issues or drops (``AgentFailed``). The rules an episode is checked against are in
``rollout_service/agent.py``.

The runner owns the agent (its identity and the tokenizer episodes read and write text with) and
the episode counters; the gate, the engine and the generation counters stay the core's.

Where an episode runs is one seam, ``EpisodeSource.run(prompt_text, label, sampling_params,
engine, step_timeout_s) -> Episode``: ``InProcessAgent`` runs an OpenRLHF ``AgentExecutor``'s
``execute`` on this process's event loop; another kind of agent (environment worker processes,
an agent written against an OpenAI-compatible endpoint) is another ``EpisodeSource``, handed the
same ``TurnEngine`` (each of its ``generate`` calls is one turn through the gate) and returning
the same checked ``Episode`` (``agent.build_episode``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from common import protocol as P
from rollout_service.agent import Episode, EpisodeError, TurnEngine, run_episode
from rollout_service.errors import AgentFailed, BadRequest

log = logging.getLogger(__name__)

# turn(token_ids, vLLM params) -> (vLLM RequestOutput, the version it was admitted under): one
# request of the prompt being run, through the core's gate (``RolloutCore.turn``).
TurnRequest = Callable[[list[int], Any], Awaitable[tuple[Any, int]]]


EPISODE_COUNTERS = (
    "episodes",  # agent episodes finished (each is a sample)
    "agent_turns",
    "failed_episodes",  # the environment raised, hung or answered garbage
    # An episode's turns after its first: their input tokens and the share of them vLLM's prefix
    # cache held (every turn of an episode runs on this engine: close to all of it, less what a
    # weight update in between made stale).
    "agent_later_turn_tokens",
    "agent_later_turn_cached",
)


class EpisodeSource(Protocol):
    """Runs one episode on ``engine`` (the seam where an agent runs)."""

    identity: str  # "<file name>:<sha256, 12 hex>": what the learner names (RolloutCapabilities.agent)

    async def run(
        self, prompt_text: str, label: str | None, sampling_params: Any, engine: TurnEngine, step_timeout_s: float
    ) -> Episode:
        """One episode from the prompt; raises EpisodeError (the agent's or its environment's
        fault) or what the engine raised (the server's)."""
        ...


class InProcessAgent:
    """An OpenRLHF ``AgentExecutor`` run in this process, on the server's event loop
    (``agent.run_episode``: the environment's deadline per step, the episode checked). The
    executor's ``llm_engine`` is one object for every episode, as OpenRLHF's is
    (``shared_engine.SharedEngine``: an executor that keeps the first one still reaches each
    episode's own engine)."""

    def __init__(self, executor: Any, identity: str, tokenizer: Any) -> None:
        from rollout_service.shared_engine import SharedEngine, SharedEngineExecutor

        self.executor, self.identity, self.tokenizer = executor, identity, tokenizer
        self.shared = SharedEngine(lambda toks: tokenizer.decode(toks, skip_special_tokens=False))
        self._run = SharedEngineExecutor(executor, self.shared)

    async def run(
        self, prompt_text: str, label: str | None, sampling_params: Any, engine: TurnEngine, step_timeout_s: float
    ) -> Episode:
        return await run_episode(
            self._run,
            engine,
            prompt_text=prompt_text,
            label=label,
            sampling_params=sampling_params,
            tokenizer=self.tokenizer,
            step_timeout_s=step_timeout_s,
        )


class EpisodeRunner:
    def __init__(self, source: EpisodeSource, tokenizer: Any, *, max_model_len: int) -> None:
        """``tokenizer``: the served model's (the prompt's text, each action's text)."""
        self.source, self.tokenizer, self.max_model_len = source, tokenizer, max_model_len
        self.counters = dict.fromkeys(EPISODE_COUNTERS, 0)

    @property
    def identity(self) -> str:
        return self.source.identity

    async def in_workers(
        self, path: str, model: str, *, workers: int, episode_timeout_s: float = 0.0, memory_mb: float = 0.0
    ) -> EpisodeRunner:
        """This runner's agent file run in ``workers`` environment worker processes instead
        (``env_pool.py``), each with the model's tokenizer; raises ValueError naming the file."""
        from rollout_service.agent_openai import OpenAIAgent
        from rollout_service.env_pool import EnvPool, PooledAgent

        if isinstance(self.source, OpenAIAgent):  # its workers would need the endpoint's address: not built yet
            log.warning("--agent_env_workers: an agent_func file (OpenAI API) runs in the server's process for now")
            return self

        pool = EnvPool(path, workers=workers, model=model, memory_mb=memory_mb)
        source = PooledAgent(pool, self.identity, episode_timeout_s=episode_timeout_s)
        await source.start()
        return EpisodeRunner(source, self.tokenizer, max_model_len=self.max_model_len)

    def metrics(self) -> dict[str, float]:
        """The episode counters, and the environment workers' when the agent runs in them."""
        extra = getattr(self.source, "metrics", None)
        return {**self.counters, **(extra() if extra is not None else {})}

    @classmethod
    def load(cls, path: str, model: str, *, max_model_len: int, tool_call_parser: str = "") -> EpisodeRunner:
        """The agent file's executor run in-process, with the model's tokenizer; a file that defines
        ``agent_func`` runs through the OpenAI-compatible endpoint (``agent_openai.py``). Raises
        ValueError naming the file (before any engine starts: a bad file fails in a second)."""
        from transformers import AutoTokenizer

        from rollout_service.agent import load_agent
        from rollout_service.agent_openai import OpenAIAgent, defines_agent_func, load_agent_func

        source: EpisodeSource
        if defines_agent_func(path):
            func, identity = load_agent_func(path)
            tokenizer = AutoTokenizer.from_pretrained(model)
            source = OpenAIAgent(func, identity, tokenizer, model=model, tool_call_parser=tool_call_parser)
        else:
            executor, identity = load_agent(path)
            tokenizer = AutoTokenizer.from_pretrained(model)
            source = InProcessAgent(executor, identity, tokenizer)
        log.info("agent %s from %s (%s)", identity, path, type(source).__name__)
        return cls(source, tokenizer, max_model_len=max_model_len)

    async def close(self) -> None:
        """Stops what the agent source serves (the OpenAI-compatible endpoint), if anything."""
        close = getattr(self.source, "close", None)
        if close is not None:
            await close()

    def check(self, token_ids: list[int], agent: P.AgentParams) -> None:
        """Raises BadRequest for episodes this server cannot run."""
        if agent.agent != self.identity:
            raise BadRequest(f"the learner's agent is {agent.agent}; this server runs {self.identity}")
        if agent.max_len > self.max_model_len:
            raise BadRequest(
                f"agent.max_len {agent.max_len} exceeds this server's --max_model_len {self.max_model_len}"
            )
        if len(token_ids) >= agent.max_len:
            raise BadRequest(f"prompt of {len(token_ids)} tokens leaves no room under agent.max_len {agent.max_len}")

    async def run(
        self,
        prompt_id: int,
        token_ids: list[int],
        n: int,
        agent: P.AgentParams,
        label: str | None,
        *,
        first_params: Callable[[int], Any],
        turn: TurnRequest,
        vocab: int,
    ) -> list[Episode]:
        """``n`` episodes from one prompt, concurrently. ``first_params(i)``: episode i's vLLM
        parameters for its first turn (its own seed); ``turn``: one request through the gate."""
        self.check(token_ids, agent)
        prompt_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)

        async def request(toks: list[int], params: Any) -> tuple[Any, int]:
            if any(not (isinstance(t, int) and 0 <= t < vocab) for t in toks):
                raise EpisodeError(f"the agent asked to generate from token ids outside the vocabulary [0, {vocab})")
            return await turn(toks, params)

        async def one(i: int) -> Episode:
            engine = TurnEngine(
                request,
                self.turn_params,
                prompt_token_ids=token_ids,
                max_len=agent.max_len,
                max_turns=agent.max_turns,
                decode=self.action_text,
                prompt_id=prompt_id,
            )
            return await self.source.run(prompt_text, label, first_params(i), engine, agent.step_timeout_s)

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            episodes = list(await asyncio.gather(*tasks))
        except EpisodeError as e:
            self.counters["failed_episodes"] += 1
            log.warning("prompt %d: agent episode failed: %s", prompt_id, e)
            raise AgentFailed(str(e)) from None
        finally:
            for t in tasks:
                t.cancel()
        self.counters["episodes"] += len(episodes)
        self.counters["agent_turns"] += sum(e.turns for e in episodes)
        self.counters["agent_later_turn_tokens"] += sum(e.later_turn_tokens for e in episodes)
        self.counters["agent_later_turn_cached"] += sum(e.later_turn_cached for e in episodes)
        return episodes

    def action_text(self, token_ids: list[int]) -> str:
        """An action as the environment reads it: as vLLM's own detokenizer would give it
        (special tokens such as EOS left out)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @staticmethod
    def turn_params(sp: Any) -> Any:
        """vLLM parameters of one agent turn from what the executor passes (ours, or one its
        environment returned): the sampling choices kept; one sample, the sampled token's
        log-prob, the final output only. Not detokenized by vLLM: the environment's action text
        is decoded once per turn (``action_text``); the episode is built from the token ids."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty,
            max_tokens=sp.max_tokens,
            min_tokens=sp.min_tokens,
            stop_token_ids=list(sp.stop_token_ids or []),
            seed=sp.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
