"""Environments from the hubs as rayless agents: ``--agent_func_path gem:ENV_ID`` (docs/environments.md).

GEM (``gem-llm``) environments are gym-style text environments: ``reset(seed) -> (observation,
info)``, ``step(action_text) -> (observation, reward, terminated, truncated, info)``. The
``GemExecutor`` here is an ``AgentExecutor`` like any agent file's, so it runs wherever those run
(the rollout server, or its environment worker processes with ``--agent_env_workers``) and its
episodes are checked and built by the same code (``agent.build_episode``). One episode:

* ``reset(seed)``, the seed taken from the learner's prompt (``task_seed``): the ``sampling.n``
  episodes of a prompt play the same task, as group-relative estimators need;
* the observation (with the ``prefix``/``suffix`` GEM's info carries, as GEM's own observation
  wrappers add them) is a user message through the model's chat template (``template=chat``,
  the default) or raw text (``template=raw``); it replaces the learner's prompt as the
  episode's prompt;
* each action's text (as the environment reads it: special tokens left out) goes to ``step``;
  the next observation is the next user message. The turns are stitched by ``trace.Trace``, the
  OpenAI endpoint's exact-reuse rule: the policy's tokens stay as sampled, only the
  environment's text is rendered and tokenized;
* rewards are summed (the episode's reward and score); ``terminated`` or ``truncated`` ends the
  episode (finish reason ``stop``); ``--max_len`` or ``--agent_max_turns`` ending it first gives
  ``length``. Per-step rewards go to ``extra_logs`` (``gem/...``, logged as ``agent/gem/...``).

Where it differs from GEM's own wrappers (``concat_chat``): the history is never re-rendered
(GEM renders the conversation again each turn, with the parsed action as the assistant's
message), and a prefix/suffix goes inside the user message, not after the generation prompt.

Environments are made once and reused: a finished episode gives its environment back to the
executor's idle list (an environment under an episode that failed or was cancelled is dropped),
since ``gem.make`` may load a dataset. ``reset`` runs under a process-wide lock: GEM seeds
Python's and numpy's global generators, so two resets at once would draw each other's numbers.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import importlib
import json
import math
import threading
from collections.abc import Callable
from typing import Any

from common.agent_file import HubSpec, hub_spec
from rollout_service.agent_api import AgentExecutorBase, EnvironmentError_, as_number, call_environment
from rollout_service.trace import Trace

# What the adapter reads from the spec itself; every other key goes to gem.make.
OPTIONS = {
    "template": "chat (the tokenizer's chat template, default) or raw (the observations as plain text)",
    "system": "a system message before the first observation (chat template only)",
    "import": "a module imported first, which registers its environments with gem.register",
}
GEM_INSTALL = (
    "pip install --no-deps gem-llm==0.1.0 reasoning-gym==0.1.23 nltk==3.9.1 and reasoning-gym's own "
    "dependencies (`make setup` installs them; docs/environments.md, 'GEM')"
)
_SEED_LOCK = threading.Lock()
# GEM environments that run the policy's code with GEM's own runner (gem.utils.sandbox: a plain
# subprocess unless bubblewrap is asked for). Model-written code runs only in common.sandbox
# (DESIGN.md, "Agents"): refused, naming what to use instead.
RUNS_MODEL_CODE = ("gem.envs.code_env:CodeEnv",)


def load_hub_agent(path: str) -> tuple[Any, str]:
    """The executor of a hub spec and its identity; ValueError naming the flag at start-up (a
    package missing, an unknown environment, arguments its constructor refuses)."""
    spec = hub_spec(path)
    assert spec is not None
    if spec.hub == "gem":
        return GemExecutor.load(spec), spec.text
    raise ValueError(f"--agent_func_path {path}: no adapter for {spec.hub}")  # hub_spec refuses those first


def task_seed(prompt: str, label: str | None) -> int:
    """The seed of a prompt's task: the label when it is a non-negative integer or ``{"seed": N}``
    (its JSON text), else a hash of the prompt and the label (the same prompt, the same task)."""
    try:
        value = json.loads(label) if label else None
    except ValueError:
        value = None
    if isinstance(value, dict):
        value = value.get("seed")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    digest = hashlib.sha256(f"{prompt}\0{label or ''}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _seeded_reset(env: Any, seed: int) -> Any:
    with _SEED_LOCK:
        return env.reset(seed=seed)


def _text_with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


class GemExecutor(AgentExecutorBase):
    """A GEM environment played as an episode (module docstring)."""

    def __init__(self, spec: HubSpec, make: Callable[[], Any], first_env: Any = None) -> None:
        self.spec = spec
        self.env_id = spec.env_id
        self._make = make
        self._idle: list[Any] = [] if first_env is None else [first_env]
        self.template = spec.kwargs.get("template", "chat")
        self.system = spec.kwargs.get("system")
        if self.template not in ("chat", "raw"):
            raise ValueError(f"--agent_func_path {spec.text}: template must be chat or raw, got {self.template!r}")
        if self.system is not None and (self.template != "chat" or not isinstance(self.system, str)):
            raise ValueError(f"--agent_func_path {spec.text}: system is a text, with template=chat")

    @classmethod
    def load(cls, spec: HubSpec) -> GemExecutor:
        where = f"--agent_func_path {spec.text}"
        extra = spec.kwargs.get("import")
        try:
            import gem
            from gem.envs.registration import ENV_REGISTRY
        except ImportError as e:
            raise ValueError(f"{where}: GEM is not installed ({e}); {GEM_INSTALL}") from None
        if extra is not None:
            try:
                importlib.import_module(str(extra))
            except Exception as e:
                raise ValueError(f"{where}: import={extra} raised {type(e).__name__}: {e}") from e
        if spec.env_id not in ENV_REGISTRY:
            near = difflib.get_close_matches(spec.env_id, list(ENV_REGISTRY), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ValueError(
                f"{where}: GEM has no environment {spec.env_id!r} ({len(ENV_REGISTRY)} registered{hint} "
                "gem.print_envs() lists them)"
            )
        entry = ENV_REGISTRY[spec.env_id].entry_point
        entry_name = entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
        if entry_name in RUNS_MODEL_CODE:
            raise ValueError(
                f"{where}: {entry_name} runs the policy's code with GEM's own runner, outside rayless's sandbox; "
                "code tasks: examples/rewards/code_tests.py or examples/agents/python_tool.py (docs/environments.md)"
            )
        kwargs = {k: v for k, v in spec.kwargs.items() if k not in OPTIONS}

        def make() -> Any:
            return gem.make(spec.env_id, **kwargs)

        try:  # made now: arguments it refuses fail the start, not every episode
            env = make()
        except Exception as e:
            raise ValueError(f"{where}: gem.make({spec.env_id!r}, **{kwargs}) raised {type(e).__name__}: {e}") from e
        return cls(spec, make, env)

    def _observation(self, obs: Any, info: Any, call: str) -> str:
        if not isinstance(obs, str):
            raise EnvironmentError_(
                f"GEM environment {self.env_id}: {call} returned a {type(obs).__name__} observation (text expected)"
            )
        info = info if isinstance(info, dict) else {}
        return f"{info.get('prefix') or ''}{_text_with_newline(obs)}{info.get('suffix') or ''}"

    async def _env_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await call_environment(fn, *args)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise EnvironmentError_(f"GEM environment {self.env_id}: {what} raised {type(e).__name__}: {e}") from e

    async def execute(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any, llm_engine: Any
    ) -> dict:
        env = self._idle.pop() if self._idle else await self._env_call("gem.make", self._make)
        result = await self._episode(env, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)
        self._idle.append(env)  # only after an episode that ended well: a failed one's state is unknown
        return result

    async def _episode(
        self, env: Any, prompt: str, label: Any, sampling_params: Any, max_length: int, tokenizer: Any, engine: Any
    ) -> dict:
        label_text = label if isinstance(label, str) or label is None else json.dumps(label)
        first = await self._env_call("reset()", _seeded_reset, env, task_seed(prompt, label_text))
        if not (isinstance(first, tuple) and len(first) == 2):
            raise EnvironmentError_(f"GEM environment {self.env_id}: reset() must return (observation, info)")
        content = self._observation(*first, "reset()")
        trace = Trace(tokenizer)
        chat = self.template == "chat"
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": content})
        call = trace.chat_prompt(messages) if chat else trace.completion_prompt(content)
        turns_left = getattr(engine, "turns_left", lambda: None)  # rayless's engine: --agent_max_turns
        rewards: list[float] = []
        terminated = truncated = False
        info: Any = {}
        while len(call.prompt) < max_length and turns_left() != 0:
            out = (await engine.generate(call.prompt, sampling_params)).outputs[0]
            trace.record(call, list(out.token_ids), out.finish_reason, returned_text=out.text)
            step = await self._env_call("step()", env.step, out.text)
            if not (isinstance(step, tuple) and len(step) == 5):
                raise EnvironmentError_(
                    f"GEM environment {self.env_id}: step() must return (observation, reward, terminated, truncated, "
                    f"info), got {type(step).__name__}: {step!r:.80}"
                )
            obs, reward, terminated, truncated, info = step
            rewards.append(as_number(reward, f"GEM environment {self.env_id}: step()'s reward"))
            if terminated or truncated:
                break
            content = self._observation(obs, info, "step()")
            if chat:
                messages += [{"role": "assistant", "content": out.text}, {"role": "user", "content": content}]
                call = trace.chat_prompt(messages)
            else:  # GEM's plain-text history: each observation and action on lines of their own
                call = trace.completion_prompt(
                    trace.calls[-1].text + ("" if out.text.endswith("\n") else "\n") + content
                )
        if not trace.calls:
            raise EnvironmentError_(
                f"GEM environment {self.env_id}: the first observation ({len(call.prompt)} tokens) leaves no room for "
                f"an action under --max_len {max_length}"
            )
        seq, ranges = trace.stitch()
        total = math.fsum(rewards)
        return {
            "observation_tokens": seq,
            "action_ranges": ranges,
            "reward": total,
            "scores": total,
            "extra_logs": self._logs(rewards, bool(terminated), bool(truncated), info),
            "done": bool(terminated or truncated),  # False: --max_len or --agent_max_turns ended it ("length")
        }

    @staticmethod
    def _logs(rewards: list[float], terminated: bool, truncated: bool, info: Any) -> dict[str, float]:
        logs = {
            "gem/return": math.fsum(rewards),
            "gem/steps": float(len(rewards)),
            "gem/last_reward": rewards[-1] if rewards else 0.0,
            "gem/step_reward_mean": math.fsum(rewards) / len(rewards) if rewards else 0.0,
            "gem/step_reward_min": min(rewards, default=0.0),
            "gem/step_reward_max": max(rewards, default=0.0),
            "gem/terminated": float(terminated),
            "gem/truncated": float(truncated),
        }
        for k, v in (info if isinstance(info, dict) else {}).items():  # the last step's numeric info
            if isinstance(v, bool | int | float) and math.isfinite(float(v)):
                logs[f"gem/info/{k}"] = float(v)
        return logs
