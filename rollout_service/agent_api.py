"""The agent API a user's ``--agent_func_path`` file is written against (OpenRLHF's contract).

A file defines ``AgentExecutor``, built with no arguments. Usually::

    from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor
    # or, unchanged from an OpenRLHF script: from openrlhf.utils.agent import ...

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs): ...           # one instance per episode
        async def reset(self, states):                     # {"observation": prompt text, "label": label}
            return {"observation": states["observation"]}
        async def step(self, states):                      # observation_text, action_text, label, sampling_params
            return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "...", "done": True,
                    "sampling_params": None, "extra_logs": {}}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

A file that imports these names from OpenRLHF's module path (``openrlhf.utils.agent``) loads
without OpenRLHF installed: ``rollout_service.agent.load_agent`` points that path here.

``step`` and ``reset`` may be ``async def`` (awaited on the server's event loop: keep them
non-blocking) or plain ``def`` (run in a thread pool, so a blocking environment overlaps other
episodes' generation). ``rewards`` and ``scores`` may be numbers or one-element tensors.

A custom executor overrides ``execute(prompt, label, sampling_params, max_length, hf_tokenizer,
llm_engine)`` and drives the engine with ``await llm_engine.generate(token_ids,
sampling_params)`` (OpenRLHF 0.10's ``multi_modal_data=`` keyword is taken: None or no images;
images fail the episode, vision being issue 42), which returns a vLLM ``RequestOutput``
(``outputs[0].token_ids``, ``.text``, ``.logprobs``); it returns OpenRLHF's dict:
``observation_tokens`` (the whole episode), ``action_ranges`` (``[start, end)`` of every action
in it), ``reward`` (None: the run's reward service scores the episode), ``scores``,
``extra_logs`` (``rollout_log_probs`` is read from the engine's own record, not from the dict).

Where rayless differs from OpenRLHF's ``MultiTurnAgentExecutor`` (docs/agents.md):
* the episode starts from the learner's prompt token ids when ``reset`` keeps the observation
  (OpenRLHF re-encodes the decoded text, which need not give the same tokens back);
* each turn may generate the smaller of the per-turn cap (``sampling_params.max_tokens``, i.e.
  ``--generate_max_len``) and what is left of ``max_length`` (OpenRLHF: only the latter);
* ``--agent_max_turns`` ends an episode after that many actions (0: the environment decides);
* an environment that raises, hangs past ``--agent_step_timeout_s`` or answers malformed output
  fails that episode with a message naming the field, never the server.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import numbers
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor", "EnvironmentError_"]

# Plain-``def`` environment steps run here, not in asyncio's default pool (min(32, cores + 4)
# threads: 6 on a 2-core host, which would cap concurrent blocking steps far below the episodes
# in flight). A step that hangs past its timeout keeps its thread: Python cannot kill it.
_STEP_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="agent-step")


class EnvironmentError_(ValueError):  # noqa: N801 - not the builtin EnvironmentError (an OSError alias)
    """The environment's answer is malformed (names the field); the episode fails."""


class AgentInstanceBase(ABC):
    """One environment instance; ``MultiTurnAgentExecutor`` builds one per episode, no arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027 - optional to override
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """``states``: ``{"observation": prompt text, "label": label}``; returns ``{"observation": text}``."""
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        """One environment step after an action; see the module docstring for the fields."""
        raise NotImplementedError


class AgentExecutorBase(ABC):
    @abstractmethod
    async def execute(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any, llm_engine: Any
    ) -> dict:
        """One whole episode; returns OpenRLHF's dict (module docstring)."""
        raise NotImplementedError


async def call_environment(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` of the user's environment: awaited if async, else run in a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.get_running_loop().run_in_executor(_STEP_THREADS, fn, *args)
    return await out if inspect.isawaitable(out) else out


async def new_instance(cls: type[Any]) -> Any:
    """``cls()``, one environment per episode. OpenRLHF's published example declares ``async def
    __init__``, which ``cls()`` cannot run (Python refuses an ``__init__`` that returns a
    coroutine); such an ``__init__`` is awaited here on a bare instance, so that file works too."""
    if inspect.iscoroutinefunction(cls.__init__):
        # mypy looks __new__ of a type[Any] up on the metaclass (type.__new__): it is the class's own here
        env = cls.__new__(cls)  # type: ignore[call-overload]
        await env.__init__()
        return env
    return cls()


def as_number(value: Any, field: str) -> float:
    """A reward or score as a float: a number or a one-element tensor/array."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch tensor
        if value.numel() != 1:
            raise EnvironmentError_(f"{field} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    elif hasattr(value, "size") and hasattr(value, "item"):  # numpy
        if value.size != 1:
            raise EnvironmentError_(f"{field} must be one number, got an array of {value.size}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EnvironmentError_(f"{field} must be a number, got {type(value).__name__}: {value!r:.80}")
    if not math.isfinite(float(value)):
        raise EnvironmentError_(f"{field} must be finite, got {value}")
    return float(value)


def _mapping(result: Any, what: str) -> dict:
    if not isinstance(result, dict):
        raise EnvironmentError_(f"{what} must return a dict, got {type(result).__name__}: {result!r:.80}")
    return result


def _text(result: dict, key: str, what: str) -> str:
    if key not in result:
        raise EnvironmentError_(f"{what} returned no {key!r} (keys: {sorted(result)})")
    value = result[key]
    if not isinstance(value, str):
        raise EnvironmentError_(f"{what}'s {key!r} must be text, got {type(value).__name__}: {value!r:.80}")
    return value


def numeric_logs(logs: Any, what: str) -> dict[str, float]:
    """``extra_logs`` as name -> float (numbers or one-element tensors; a bool counts as 0/1)."""
    if logs is None:
        return {}
    if not isinstance(logs, dict):
        raise EnvironmentError_(f"{what}'s 'extra_logs' must be a dict, got {type(logs).__name__}")
    return {str(k): as_number(float(v) if isinstance(v, bool) else v, f"extra_logs[{k!r}]") for k, v in logs.items()}


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Act, read the environment, act again: OpenRLHF's multi-turn loop, token in, token out.

    The sequence after each turn is the one before it, plus the action's token ids as vLLM
    sampled them (the stop/EOS token included), plus the environment feedback's tokens: the
    policy's tokens are never decoded and encoded again; only the environment's text is.
    """

    def __init__(self, agent_instance_cls: type) -> None:
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor needs a subclass of AgentInstanceBase, got {agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls

    async def execute(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any, llm_engine: Any
    ) -> dict:
        env = await new_instance(self.agent_instance_cls)
        reset = _mapping(await call_environment(env.reset, {"observation": prompt, "label": label}), "reset()")
        observation_text = _text(reset, "observation", "reset()")
        # The learner's own prompt tokens when the environment keeps the observation.
        start = getattr(llm_engine, "prompt_token_ids", None)
        tokens = (
            list(start) if start is not None and observation_text == prompt else _tokens(hf_tokenizer, observation_text)
        )
        turn_cap = getattr(sampling_params, "max_tokens", None) or max_length
        action_ranges: list[tuple[int, int]] = []
        total_reward, scores, extra_logs, done = 0.0, None, {}, False
        turns_left = getattr(llm_engine, "turns_left", lambda: None)  # rayless's engine: --agent_max_turns
        while not done and turns_left() != 0:
            budget = max_length - len(tokens)
            if budget <= 0:
                break
            params = copy.deepcopy(sampling_params)
            params.max_tokens = min(turn_cap, budget)
            out = await llm_engine.generate(tokens, params)
            action = list(out.outputs[0].token_ids)
            action_text = out.outputs[0].text
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            tokens += action
            states = {
                "observation_text": observation_text,
                "action_text": action_text,
                "label": label,
                "sampling_params": params,
            }
            result = _mapping(await call_environment(env.step, states), "step()")
            if "rewards" not in result:
                raise EnvironmentError_(f"step() returned no 'rewards' (keys: {sorted(result)})")
            total_reward += as_number(result["rewards"], "step()'s 'rewards'")
            s = result.get("scores")
            scores = as_number(s, "step()'s 'scores'") if s is not None else total_reward
            feedback = _text(result, "environment_feedback", "step()")
            if "done" not in result:
                raise EnvironmentError_(f"step() returned no 'done' (keys: {sorted(result)})")
            done = bool(result["done"])
            extra_logs = numeric_logs(result.get("extra_logs"), "step()")
            observation_text = observation_text + action_text + feedback
            tokens += _tokens(hf_tokenizer, feedback) if feedback else []
            if result.get("sampling_params") is not None:
                sampling_params = result["sampling_params"]
                turn_cap = getattr(sampling_params, "max_tokens", None) or turn_cap
        return {
            "prompt": prompt,
            "label": label,
            "reward": total_reward,
            "scores": total_reward if scores is None else scores,
            "observation_tokens": tokens,
            "action_ranges": action_ranges,
            "extra_logs": extra_logs,
            "done": done,  # rayless: the episode's finish reason ("stop" when the environment ended it)
        }
