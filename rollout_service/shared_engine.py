"""One ``llm_engine`` for every episode of an in-process executor, routing each call to its episode.

OpenRLHF hands ``execute`` the same engine object in every episode (its Ray actor), and its own
``examples/python/agent_func_openai_server_executor.py`` relies on that: the first episode's
``llm_engine`` is kept by the executor, which serves it over HTTP from a uvicorn thread of its
own, and every later episode's calls reach that object. rayless records each episode's turns on
an engine of its own (``TurnEngine``), so the kept one belonged to a finished episode and every
later episode "took no action". Here every executor gets this one object instead:

* a call made from the episode's own task (every ``MultiTurnAgentExecutor``, every custom
  executor that awaits ``generate`` itself) goes to that episode's ``TurnEngine``: a context
  variable set for the episode's task says which (tasks it spawns inherit it);
* a call from another thread (an executor serving HTTP from a thread and event loop of its
  own) carries no such context. It runs on the server's loop (the gate's locks live there) and
  goes to the running episode whose last input and action it extends, longest first; a first
  call goes to an episode that has made none and whose prompt text it contains. Two episodes of
  one prompt cannot be told apart by their first call, so an episode's calls may be recorded on
  its twin's engine; when ``execute`` returns, the records are exchanged so that each episode is
  built from its own calls (``claim``). The one thing not exchanged is the step clock: until then
  the twin's engine counted that call's time as the engine's;
* ``generate`` takes OpenRLHF 0.10's ``multi_modal_data`` (handed to the episode's engine, which
  serves text turns and fails an episode that sends images) and ignores other keywords.

Other attributes (``prompt_token_ids``, ``turns_left``, ``max_len``) are the calling episode's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from rollout_service.agent import EpisodeError, TurnEngine

_episode: contextvars.ContextVar[TurnEngine | None] = contextvars.ContextVar("rayless_episode_engine", default=None)


def holds(engine: TurnEngine, result: Any) -> bool:
    """Whether ``engine``'s record is the turns of an executor's result (as ``build_episode``
    checks them: each turn's input a prefix of the sequence, its action right after it)."""
    seq = result.get("observation_tokens") if isinstance(result, dict) else None
    if not isinstance(seq, list | tuple) or not engine.turns:
        return False
    seq = list(seq)
    return all(
        seq[: t.prompt_len] == inp and seq[t.prompt_len : t.prompt_len + len(t.action)] == t.action
        for inp, t in zip(engine.history, engine.turns, strict=True)
    )


class SharedEngine:
    """``decode``: token ids -> text (a first call from another thread is matched by prompt text)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prompts: dict[TurnEngine, str] = {}  # running episodes: engine -> its prompt text
        self._routed: dict[TurnEngine, int] = {}  # engines with a call from another thread running

    @contextlib.contextmanager
    def episode(self, engine: TurnEngine, prompt_text: str) -> Iterator[None]:
        """While the block runs (in the episode's task), calls without other context are ``engine``'s."""
        self._loop = asyncio.get_running_loop()
        self._prompts[engine] = prompt_text
        token = _episode.set(engine)
        try:
            yield
        finally:
            _episode.reset(token)
            self._prompts.pop(engine, None)

    def __getattr__(self, name: str) -> Any:
        engine = _episode.get()
        if engine is None or name.startswith("_"):
            raise AttributeError(f"llm_engine.{name} is an episode's, and no episode is running here")
        return getattr(engine, name)

    async def generate(self, token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None, **_: Any) -> Any:
        engine = _episode.get()
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if engine is not None and here:
            return await engine.generate(token_ids, sampling_params, multi_modal_data)
        if self._loop is None:
            raise EpisodeError("llm_engine.generate was called while no episode runs")
        # Another thread's loop: run on the server's, where the gate and the engine live.
        call = self._generate_routed(list(token_ids), sampling_params, multi_modal_data)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop))

    async def _generate_routed(self, token_ids: list[int], sampling_params: Any, multi_modal_data: Any) -> Any:
        engine = self._route(token_ids)
        self._routed[engine] = self._routed.get(engine, 0) + 1
        try:
            return await engine.generate(token_ids, sampling_params, multi_modal_data)
        finally:
            self._routed[engine] -= 1
            if not self._routed[engine]:
                del self._routed[engine]

    def _route(self, toks: list[int]) -> TurnEngine:
        # The longest record the call extends; of equal ones (twins that sampled the same tokens,
        # so either may take it), one without a routed call running.
        best, best_key = None, (-1, False)
        for engine in self._prompts:
            if engine.turns:
                seq = engine.history[-1] + engine.turns[-1].action
                key = (len(seq), engine not in self._routed)
                if key > best_key and toks[: len(seq)] == seq:
                    best, best_key = engine, key
        if best is not None:
            return best
        text = self._decode(toks)
        fresh = [e for e, p in self._prompts.items() if not e.turns and e not in self._routed and p in text]
        if not fresh:
            raise EpisodeError(
                f"a call of {len(toks)} tokens from outside any episode's task extends no running episode's last turn "
                "and holds no prompt of an episode that has made no call yet"
            )
        return max(fresh, key=lambda e: len(self._prompts[e]))

    async def claim(self, result: Any, engine: TurnEngine) -> None:
        """Before ``engine``'s episode is built from ``result``: if another running engine recorded
        its calls (see the module docstring), the two records are exchanged."""
        if holds(engine, result):
            return
        for other in list(self._prompts):
            if other is not engine and holds(other, result):
                while other in self._routed or engine in self._routed:  # not under a running call
                    await asyncio.sleep(0.005)
                for attr in ("turns", "history"):  # the records only: each engine keeps its own clock
                    mine, theirs = getattr(engine, attr), getattr(other, attr)
                    setattr(engine, attr, theirs)
                    setattr(other, attr, mine)
                return


class SharedEngineExecutor:
    """An OpenRLHF executor run with the ``SharedEngine`` as its ``llm_engine`` (what
    ``agent.run_episode`` drives: same ``execute``, the episode's own engine claimed after it)."""

    def __init__(self, executor: Any, shared: SharedEngine) -> None:
        self.executor, self.shared = executor, shared

    async def execute(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any, llm_engine: TurnEngine
    ) -> Any:
        with self.shared.episode(llm_engine, prompt):
            result = await self.executor.execute(prompt, label, sampling_params, max_length, hf_tokenizer, self.shared)
            await self.shared.claim(result, llm_engine)
        return result
