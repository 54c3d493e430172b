"""Agents written against the OpenAI API: an ``agent_func`` file (docs/agents.md).

An agent file that defines, at its top level, ::

    async def agent_func(client, prompt, label, **kwargs):   # client: openai.AsyncOpenAI
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return reward        # a number, {"rewards": r, "scores": s, "extra_logs": {...}}, or None

(and no ``AgentExecutor`` class) trains as it is: every episode gets a client bound to its own
base URL and key on the server's OpenAI-compatible endpoint (``openai_api.py``), each call is a
turn of that episode through the server's gate, and the sample is the episode's calls stitched
token for token (``trace.py``), with the function's reward. Keyword arguments the function
declares (or takes through ``**kwargs``) are passed: ``model`` (the served model's name),
``max_tokens`` (a turn's cap, ``--generate_max_len``), ``max_len`` (the episode's cap).

The client has no timeout and no retries: a call may wait out a weight update, and a retried
call would be a second turn of the episode (the endpoint refuses a call while another of the same
episode runs). Time between calls is the environment's, under ``--agent_step_timeout_s``.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any

from common.agent_file import agent_identity
from rollout_service.agent import Episode, EpisodeError, TurnEngine, run_episode
from rollout_service.agent_api import EnvironmentError_, as_number, numeric_logs
from rollout_service.openai_api import EpisodeSession, OpenAIEndpoint

log = logging.getLogger(__name__)

FUNCTION = "agent_func"
OPTIONAL_KWARGS = ("model", "max_tokens", "max_len")


def defines_agent_func(path: str) -> bool:
    """Whether the file is an OpenAI-API agent: a top-level ``async def agent_func`` and no
    ``AgentExecutor`` class (read without importing it: the file is imported once, by its loader)."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False  # the OpenRLHF loader names the problem
    names = {n.name: n for n in tree.body if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef | ast.ClassDef)}
    return FUNCTION in names and "AgentExecutor" not in names


def load_agent_func(path: str) -> tuple[Any, str]:
    """The file's ``agent_func`` and the file's identity; ValueError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rayless_agent_{p.stem}", p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--agent_func_path {path}: importing it raised {type(e).__name__}: {e}") from e
    fn = getattr(module, FUNCTION, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"--agent_func_path {path}: {FUNCTION} must be an async function (async def {FUNCTION}(client, prompt, label))"
        )
    return fn, agent_identity(p)


def reward_of(result: Any) -> tuple[float | None, float | None, dict[str, float]]:
    """``agent_func``'s answer as (reward, score, extra_logs): a number (or one-element tensor), or
    a dict with ``rewards`` (OpenRLHF's reward-function key; ``reward`` also read), ``scores``
    and ``extra_logs``, as an OpenRLHF reward function returns. ``None`` (or a reward of None):
    the run's reward service scores the episode, as with an OpenRLHF executor's ``reward: None``."""
    try:
        if isinstance(result, dict):
            keys = [k for k in ("rewards", "reward") if k in result]
            if len(keys) != 1:
                raise EnvironmentError_(
                    f"{FUNCTION}'s dict must hold one of 'rewards' or 'reward' (keys: {sorted(result)})"
                )
            r = result[keys[0]]
            reward = None if r is None else as_number(r, f"{FUNCTION}'s {keys[0]!r}")
            s = result.get("scores")
            score = reward if s is None else as_number(s, f"{FUNCTION}'s 'scores'")
            return reward, score, numeric_logs(result.get("extra_logs"), FUNCTION)
        if result is None:
            return None, None, {}
        reward = as_number(result, f"{FUNCTION}'s reward")
        return reward, reward, {}
    except EnvironmentError_ as e:
        raise EpisodeError(str(e)) from None


class OpenAIAgent:
    """The ``EpisodeSource`` of an ``agent_func`` file: the function driven through the endpoint."""

    def __init__(
        self,
        func: Any,
        identity: str,
        tokenizer: Any,
        *,
        model: str,
        tool_call_parser: str = "",
        endpoint: OpenAIEndpoint | None = None,
        in_process: bool = True,
    ) -> None:
        from rollout_service.openai_api import tool_parser_class

        self.func, self.identity, self.tokenizer = func, identity, tokenizer
        self.model = model
        self.tool_parser = tool_parser_class(tool_call_parser) if tool_call_parser else None
        self.endpoint = endpoint or OpenAIEndpoint(model)
        params = inspect.signature(func).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._kwargs = [k for k in OPTIONAL_KWARGS if takes_all or k in params]
        self.in_process = in_process  # the client's requests: in this process, or over loopback HTTP
        self._http: Any = None

    def client(self, session: EpisodeSession) -> Any:
        """An ``openai.AsyncOpenAI`` bound to the episode (its base URL and key). Its requests
        reach the endpoint in this process (``InProcessTransport``: no socket, no HTTP parsing;
        with ``in_process=False``, over loopback HTTP through one aiohttp connection pool), on the
        loop that also drives the engine, so every millisecond a call costs here is the engine's
        (bench/agent.py --openai)."""
        import httpx
        from openai import AsyncOpenAI

        if self._http is None:
            if self.in_process:
                self._http = httpx.AsyncClient(transport=self.endpoint.transport(), timeout=None, trust_env=False)
            else:  # httpx's interface over aiohttp's client (openai's DefaultAioHttpClient)
                from httpx_aiohttp import HttpxAiohttpClient

                limits = httpx.Limits(max_connections=4096)
                self._http = HttpxAiohttpClient(trust_env=False, timeout=None, limits=limits)
        return AsyncOpenAI(
            base_url=self.endpoint.base_url(session),
            api_key=session.key,
            http_client=self._http,
            max_retries=0,
            timeout=None,
        )

    async def run(
        self, prompt_text: str, label: str | None, sampling_params: Any, engine: TurnEngine, step_timeout_s: float
    ) -> Episode:
        await self.endpoint.start()
        return await run_episode(
            _Executor(self),
            engine,
            prompt_text=prompt_text,
            label=label,
            sampling_params=sampling_params,
            tokenizer=self.tokenizer,
            step_timeout_s=step_timeout_s,
        )

    async def close(self) -> None:
        await self.endpoint.stop()
        if self._http is not None:
            await self._http.aclose()
            self._http = None


class _Executor:
    """``agent.run_episode``'s executor for one ``agent_func`` episode (the step deadline, the
    engine's faults and ``build_episode``'s checks are run_episode's)."""

    def __init__(self, agent: OpenAIAgent) -> None:
        self.agent = agent

    async def execute(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any, llm_engine: TurnEngine
    ) -> dict:
        a = self.agent
        session = a.endpoint.open(
            EpisodeSession(llm_engine, hf_tokenizer, sampling_params, model=a.model, tool_parser=a.tool_parser)
        )
        extra = {"model": a.model, "max_tokens": sampling_params.max_tokens, "max_len": max_length}
        try:
            result = await a.func(a.client(session), prompt, label, **{k: extra[k] for k in a._kwargs})
        except Exception as e:
            if (
                session.error is not None
            ):  # the agent caught nothing of it, or re-raised: the trace's refusal is the cause
                raise EpisodeError(session.error) from None
            if llm_engine.engine_error is not None:  # the engine failed under it: run_episode raises that
                raise
            raise EpisodeError(f"{FUNCTION} raised {type(e).__name__}: {e}") from e
        finally:
            a.endpoint.close(session)
        if session.error is not None:
            raise EpisodeError(session.error)
        reward, score, logs = reward_of(result)
        seq, ranges = session.trace.stitch()
        last = session.trace.calls[-1]
        return {
            "observation_tokens": seq,
            "action_ranges": ranges,
            "reward": reward,
            "scores": score,
            "extra_logs": logs,
            # "stop" when the agent ended it after an answer that stopped by itself
            "done": not session.truncated and last.finish_reason == "stop",
        }
