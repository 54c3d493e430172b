"""Agent episodes in the rollout server: load the user's file, run one episode, check it.

``RolloutCore`` runs ``sampling.n`` episodes per prompt when the learner asks for them
(``PromptBatch.agent``). Each episode is the user's ``AgentExecutor.execute`` (usually
``agent_api.MultiTurnAgentExecutor``) driving a ``TurnEngine``: every turn is one request to this
server's vLLM engine through its version gate, so a turn waits out a weight update like any
prompt, and the episode's earlier turns are a prefix-cache hit (the same engine, the same cache
salt while the weights stay). The engine records what it was asked and what it sampled; the
episode is then built from that record, not from what the executor says:

* token in, token out: every turn's input must be a prefix of the final sequence and its action
  must sit right after it, as sampled (a re-encoded action fails the episode, naming the turn);
* the action mask is 1 exactly on sampled tokens; vLLM's log-probs are taken for them;
* environment tokens after the last action are dropped: nothing that trains follows them, and
  so the reward sits on the last action token under every estimator, GAE included;
* the episode's version is the one that sampled its first action token.

Time. An environment has ``step_timeout_s`` for each stretch between two engine calls (reset,
each step, a custom executor's own work); time inside ``generate`` (waiting for a weight update
included) is the engine's, not the environment's. Past it, the episode is cancelled and fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.agent_file import agent_identity, hub_spec
from rollout_service import agent_api
from rollout_service.agent_api import EnvironmentError_, as_number, numeric_logs

OPENRLHF_MODULE = "openrlhf.utils.agent"


class EpisodeError(Exception):
    """An episode failed through the agent or its environment (the message says which part)."""


def _alias_openrlhf() -> None:
    """Lets ``from openrlhf.utils.agent import ...`` load our base classes when OpenRLHF is not
    installed (an installed OpenRLHF is left alone: its classes speak the same contract)."""
    try:
        if importlib.util.find_spec("openrlhf") is not None:
            return
    except (ImportError, ValueError):
        pass
    for name in ("openrlhf", "openrlhf.utils"):
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__path__ = []  # a package, so the submodule import resolves through sys.modules
    sys.modules[OPENRLHF_MODULE] = agent_api
    sys.modules["openrlhf.utils"].agent = agent_api  # type: ignore[attr-defined]
    sys.modules["openrlhf"].utils = sys.modules["openrlhf.utils"]  # type: ignore[attr-defined]


def load_agent(path: str) -> tuple[Any, str]:
    """The ``AgentExecutor()`` of an agent file and the file's identity. Raises ValueError naming
    the file and what is wrong with it. A hub environment (``gem:ENV_ID``) is adapted instead
    (``hub_envs.py``)."""
    if hub_spec(path) is not None:
        from rollout_service.hub_envs import load_hub_agent

        return load_hub_agent(path)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--agent_func_path {path}: no such file")
    _alias_openrlhf()
    spec = importlib.util.spec_from_file_location(f"rayless_agent_{p.stem}", p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--agent_func_path {path}: importing it raised {type(e).__name__}: {e}") from e
    cls = getattr(module, "AgentExecutor", None)
    if not isinstance(cls, type):
        raise ValueError(f"--agent_func_path {path}: defines no class AgentExecutor (OpenRLHF's contract)")
    try:
        executor = cls()
    except Exception as e:
        raise ValueError(f"--agent_func_path {path}: AgentExecutor() raised {type(e).__name__}: {e}") from e
    if not callable(getattr(executor, "execute", None)):
        raise ValueError(f"--agent_func_path {path}: AgentExecutor has no execute() method")
    return executor, agent_identity(p)


# request(token_ids, params) -> (vLLM RequestOutput, the version it was admitted under)
Request = Callable[[list[int], Any], Awaitable[tuple[Any, int]]]


@dataclass
class Turn:
    prompt_len: int  # tokens before the action
    action: list[int]
    logprobs: list[float]
    version: int  # the weights that sampled the action's first token
    finish_reason: str
    cached: int = 0  # of prompt_len, the tokens vLLM found in its prefix cache


class TurnEngine:
    """The ``llm_engine`` an executor drives: ``await generate(token_ids, sampling_params)``.

    Every call is recorded (``turns``) and checked: within ``max_len`` (the action may take at
    most what is left), within ``max_turns``. ``request`` sends one vLLM request through the
    server's gate; ``to_params`` turns the executor's sampling parameters into the server's.
    """

    def __init__(
        self,
        request: Request,
        to_params: Callable[[Any], Any],
        *,
        prompt_token_ids: list[int],
        max_len: int,
        max_turns: int = 0,
        decode: Callable[[list[int]], str] | None = None,
        prompt_id: int = -1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._request, self._to_params, self._clock = request, to_params, clock
        # The action's text, when the engine did not detokenize (cheaper: one decode per turn
        # instead of vLLM's incremental one per token, in the process that runs the episodes).
        self._decode = decode
        self.prompt_token_ids = list(prompt_token_ids)  # the learner's prompt (agent_api uses it)
        self.prompt_id = prompt_id  # the controller's id of the prompt, for logs (-1: unknown)
        self.max_len, self.max_turns = max_len, max_turns
        self.turns: list[Turn] = []
        self.history: list[list[int]] = []  # each turn's input, for the prefix check
        self._busy = 0
        self._idle_since = clock()
        self.engine_error: BaseException | None = None  # the server's fault, not the agent's

    def turns_left(self) -> int | None:
        return None if not self.max_turns else self.max_turns - len(self.turns)

    def environment_time(self) -> float:
        """Seconds since the engine last had a call running (0 while one runs)."""
        return 0.0 if self._busy else self._clock() - self._idle_since

    @property
    def in_engine(self) -> bool:
        """A call of the episode is running on the engine (its environment's code is not)."""
        return self._busy > 0

    def restart(self) -> None:
        """Forgets the record: the episode runs again from its first turn (its environment
        worker died under it: ``env_pool.py``). Only once no call of the old run is running."""
        self.turns.clear()
        self.history.clear()
        self.engine_error = None
        self._idle_since = self._clock()

    async def generate(self, token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        """One turn: ``token_ids`` continued under ``sampling_params``. ``multi_modal_data`` is
        OpenRLHF 0.10's (its executors pass it on every call: ``{"image": [PIL images]}`` or
        None); text only here: None or no images is a text turn, images fail the episode."""
        media = multi_modal_data.values() if isinstance(multi_modal_data, dict) else [multi_modal_data]
        if any(m is not None and (not hasattr(m, "__len__") or len(m)) for m in media):
            kinds = (
                sorted(multi_modal_data) if isinstance(multi_modal_data, dict) else [type(multi_modal_data).__name__]
            )
            raise EpisodeError(
                f"the agent passed images to generate() (multi_modal_data: {', '.join(map(str, kinds))}): vision is "
                "not yet supported in rayless (issue 42); episodes are text only"
            )
        token_ids = list(token_ids)
        if self.max_turns and len(self.turns) >= self.max_turns:
            raise EpisodeError(
                f"the agent asked for action {len(self.turns) + 1} past --agent_max_turns {self.max_turns}"
            )
        room = self.max_len - len(token_ids)
        if room <= 0:
            raise EpisodeError(
                f"the agent asked to generate after {len(token_ids)} tokens, at --max_len {self.max_len}"
            )
        params = self._to_params(sampling_params)
        params.max_tokens = min(params.max_tokens or room, room)
        self._busy += 1
        try:
            out, admitted = await self._request(token_ids, params)
        except (asyncio.CancelledError, EpisodeError):  # EpisodeError: the request refused the agent's input
            raise
        except Exception as e:
            self.engine_error = e
            raise
        finally:
            self._busy -= 1
            self._idle_since = self._clock()
        o = out.outputs[0]
        action = list(o.token_ids)
        if self._decode is not None and not o.text:
            o.text = self._decode(action)
        if len(o.logprobs or []) != len(action):
            self.engine_error = RuntimeError(f"vLLM returned {len(o.logprobs or [])} logprobs for {len(action)} tokens")
            raise self.engine_error
        lps = [float(d[t].logprob) for t, d in zip(action, o.logprobs, strict=True)]
        spans = getattr(o, "weight_versions", None) or []
        version = int(spans[0].version) if spans else admitted
        reason = o.finish_reason if o.finish_reason in ("stop", "length", "abort") else "abort"
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        self.turns.append(Turn(len(token_ids), action, lps, version, reason, cached))
        self.history.append(token_ids)
        return out


@dataclass
class Episode:
    prompt: list[int]  # the episode's own prompt (the environment may have rewritten it)
    response: list[int]  # actions and environment feedback, up to the last action
    action_mask: list[int]  # (len(response),) 1 on sampled tokens
    logprobs: list[float]  # (len(response),) vLLM's on actions, 0.0 on feedback
    reward: float | None  # None: left to the run's reward service (an OpenRLHF executor's None)
    score: float | None  # None: the reward's (the service's, when it scores the episode)
    turns: int
    version: int  # of the first action token
    finish_reason: str  # "stop" (the environment ended it) | "length" (max_len or max_turns)
    extra_logs: dict[str, float] = field(default_factory=dict)
    # Turns after the first: their input tokens, and how many of those the prefix cache held
    # (each such turn's input starts with the previous turn's whole input and action).
    later_turn_tokens: int = 0
    later_turn_cached: int = 0


def build_episode(result: Any, engine: TurnEngine) -> Episode:
    """The episode from an executor's result and the engine's record; EpisodeError if they
    disagree (an action not where it was sampled, a turn's input not a prefix) or a field is bad."""
    if not isinstance(result, dict):
        raise EpisodeError(f"execute() must return a dict, got {type(result).__name__}")
    if not engine.turns:
        raise EpisodeError("the episode took no action (the first observation left no room under --max_len?)")
    seq = result.get("observation_tokens")
    if not isinstance(seq, list | tuple) or not all(isinstance(t, int) for t in seq):
        raise EpisodeError("execute()'s 'observation_tokens' must be a list of token ids")
    seq = list(seq)
    for k, (inp, turn) in enumerate(zip(engine.history, engine.turns, strict=True)):
        end = turn.prompt_len + len(turn.action)
        if seq[: turn.prompt_len] != inp or seq[turn.prompt_len : end] != turn.action:
            raise EpisodeError(
                f"turn {k + 1}: the final sequence does not hold that turn's input followed by its action as sampled "
                "(token in, token out: the policy's tokens must not be decoded and encoded again)"
            )
    ranges = [(t.prompt_len, t.prompt_len + len(t.action)) for t in engine.turns]
    claimed = [tuple(r) for r in result.get("action_ranges") or []]
    if claimed and claimed != ranges:
        raise EpisodeError(f"execute()'s 'action_ranges' {claimed} are not where the actions were sampled {ranges}")
    if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise EpisodeError(f"actions overlap: {ranges}")
    start, end = ranges[0][0], ranges[-1][1]
    mask, lps = [0] * (end - start), [0.0] * (end - start)
    for t, (a, b) in zip(engine.turns, ranges, strict=True):
        mask[a - start : b - start] = [1] * (b - a)
        lps[a - start : b - start] = t.logprobs
    if "reward" not in result:
        raise EpisodeError(
            "execute() returned no 'reward' (a number, or None to have the run's reward service score the episode)"
        )
    try:
        # None: OpenRLHF's executors leave the reward to the reward model / function; so does rayless
        r = result["reward"]
        reward = None if r is None else as_number(r, "the episode's 'reward'")
        s = result.get("scores")
        score = reward if s is None else as_number(s, "the episode's 'scores'")
        logs = numeric_logs(result.get("extra_logs"), "execute()")
    except EnvironmentError_ as e:
        raise EpisodeError(str(e)) from None
    done = result.get("done")
    if done is None:  # a custom executor: "length" if the last action or the sequence hit a limit
        last = engine.turns[-1]
        done = last.finish_reason == "stop" and end < engine.max_len
    return Episode(
        prompt=seq[:start],
        response=seq[start:end],
        action_mask=mask,
        logprobs=lps,
        reward=reward,
        score=score,
        turns=len(engine.turns),
        version=engine.turns[0].version,
        finish_reason="stop" if done else "length",
        extra_logs=logs,
        later_turn_tokens=sum(t.prompt_len for t in engine.turns[1:]),
        later_turn_cached=sum(t.cached for t in engine.turns[1:]),
    )


async def run_episode(
    executor: Any,
    engine: TurnEngine,
    *,
    prompt_text: str,
    label: str | None,
    sampling_params: Any,
    tokenizer: Any,
    step_timeout_s: float,
) -> Episode:
    """One episode under the environment's deadline. Raises EpisodeError (the agent's or the
    environment's fault) or whatever the engine raised (the server's)."""
    task = asyncio.ensure_future(
        executor.execute(prompt_text, label, sampling_params, engine.max_len, tokenizer, engine)
    )
    try:
        while not task.done():
            left = step_timeout_s - engine.environment_time()
            if left <= 0:
                task.cancel()
                raise EpisodeError(
                    f"the environment took over {step_timeout_s:g} s in one step (--agent_step_timeout_s), "
                    f"after {len(engine.turns)} action(s)"
                )
            await asyncio.wait({task}, timeout=left)
    except asyncio.CancelledError:
        task.cancel()
        raise
    try:
        result = task.result()
    except EpisodeError:
        raise
    except Exception as e:
        if engine.engine_error is not None:  # vLLM failed under the agent: the server's fault
            raise engine.engine_error from None
        raise EpisodeError(f"the agent raised {type(e).__name__}: {e}") from e
    return build_episode(result, engine)
