"""Environment worker: a child process of a rollout server that runs the user's agent episodes.

Started by ``rollout_service/env_pool.py`` as ``python -m rollout_service.env_worker --fd N
--agent FILE --tokenizer MODEL``. Why a process: the user's environment (``reset``/``step``, a
custom executor's own work) may hang, segfault, leak memory or call ``sys.exit``; inside the
rollout server it would do so on the event loop that drives vLLM and the heartbeats, or keep one
of its threads forever. Here the server can kill it, and its episodes' fate is decided there.

The worker loads the agent file itself (``rollout_service.agent.load_agent``, the same loader
the server uses to check the file at start-up) and its own tokenizer (the executor receives
one), and runs any number of episodes at once on its own event loop (plain ``def`` steps on its
own thread pool, ``agent_api``'s). An episode's state (the ``AgentInstance``, the executor's
locals) lives only here. Its ``llm_engine`` (``SharedEngine``, one object for every episode, as
OpenRLHF's, each call routed to the calling episode's ``EngineProxy``): every ``generate`` is sent to
the server, whose ``TurnEngine`` runs it (records the turn, checks the limits, goes through the
version gate) and sends back what an executor reads of vLLM's ``RequestOutput``.

``--kind`` names the kind of agent file: ``executor`` (OpenRLHF's ``AgentExecutor``) is the one
built; other kinds (an agent written against an OpenAI-compatible API) plug in as another entry
of ``KINDS``, with the same wire.

Wire: the socket ``--fd`` (a Unix socketpair), frames of a 4-byte big-endian length and a
msgpack map with an ``op`` (never pickle). Server -> worker: ``run`` (start an episode),
``out`` (the answer to a ``gen``: the output or an error), ``cancel`` (give an episode up: its
deadline passed). Worker -> server: ``ready`` or ``error`` (after loading), ``gen`` (an engine
call of an episode), ``done`` (the executor's result) or ``failed`` (why the episode failed),
``cancelled`` (a cancel was acted on), ``beat`` (every ``--beat_s``: the worker's event loop
runs), ``ack`` (a ``run`` or ``out`` was read: written before the episode's code can run). Every
worker message carries ``ack``, how many server messages it has read: the server tells an
episode whose answer the worker never read (innocent when it dies) from one whose environment
code may be running. EOF on the socket: exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import copy
import functools
import importlib
import signal
import struct
import sys
import traceback
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

MAX_FRAME = 256 << 20  # an episode's result is token ids: megabytes at most; more is a broken peer
_LEN = struct.Struct(">I")
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def frame(msg: dict) -> bytes:
    body = _ENC.encode(msg)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """The next message; raises EOFError when the peer closed (or died), ValueError if malformed."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_FRAME:
            raise ValueError(f"environment worker frame of {n} bytes (over {MAX_FRAME})")
        msg = _DEC.decode(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        raise EOFError from None
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"environment worker message without an op: {msg!r:.100}")
    return msg


# What a turn's sampling parameters carry across the wire: the fields the server's turn
# parameters read (RolloutCore._turn_params), with vLLM's names and defaults.
SAMPLING_FIELDS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": None,
    "min_tokens": 0,
    "stop_token_ids": None,
    "seed": None,
    "logprobs": 0,
}


def sampling_dict(sp: Any, base: dict | None = None) -> dict:
    """The wire form of sampling parameters: ours, vLLM's (an environment may return its own
    ``SamplingParams``) or anything with those attributes; a missing one keeps ``base``'s."""
    base = base or SAMPLING_FIELDS
    out: dict[str, Any] = {k: getattr(sp, k, base.get(k, d)) for k, d in SAMPLING_FIELDS.items()}
    if out["stop_token_ids"] is not None:
        out["stop_token_ids"] = [int(t) for t in out["stop_token_ids"]]
    return out


@dataclass
class SamplingParams:
    """The ``sampling_params`` an executor gets here: vLLM's field names (the ones a turn uses),
    without importing vLLM into every worker (seconds and hundreds of MB each)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = 0
    n: int = 1


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    cumulative_logprob: float | None = None
    stop_reason: Any = None


@dataclass
class RequestOutput:
    """What an executor reads of vLLM's ``RequestOutput`` (``outputs[0].token_ids``, ``.text``,
    ``.logprobs[i][token].logprob``, ``.finish_reason``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


def request_output(msg: dict, prompt: list[int], request_id: str) -> RequestOutput:
    toks = list(msg["token_ids"])
    lps = [{t: Logprob(lp)} for t, lp in zip(toks, msg["logprobs"], strict=True)]
    o = CompletionOutput(0, msg["text"], toks, lps, msg["finish_reason"], cumulative_logprob=sum(msg["logprobs"]))
    return RequestOutput(request_id, prompt, [o], num_cached_tokens=int(msg.get("cached", 0)))


class RemoteEpisodeError(Exception):
    """The server refused an engine call for the agent's input (past --agent_max_turns, no room
    under --max_len, tokens outside the vocabulary): the episode fails with the server's words."""


class EngineFailed(Exception):
    """The engine itself failed under the episode (the server's fault, not the agent's)."""


@dataclass
class EngineProxy:
    """The ``llm_engine`` of an episode in a worker: ``TurnEngine``'s surface, answered by the server."""

    worker: Worker
    episode: int
    prompt_token_ids: list[int]
    max_turns: int
    calls: int = 0
    actions: int = 0
    _waiting: dict = field(default_factory=dict)

    def turns_left(self) -> int | None:
        return None if not self.max_turns else self.max_turns - self.actions

    async def generate(self, token_ids: Any, sampling_params: Any, **kw: Any) -> RequestOutput:
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        toks = [int(t) for t in token_ids]
        self.calls += 1
        call = self.calls
        fut = asyncio.get_running_loop().create_future()
        self.worker.pending[(self.episode, call)] = fut
        msg = {"op": "gen", "ep": self.episode, "call": call, "token_ids": toks, "sp": sampling_dict(sampling_params)}
        extra = {k: v for k, v in kw.items() if v is not None}
        if extra:  # the server's TurnEngine says whether it takes them; msgpack whether they travel
            msg["kw"] = extra
        try:
            self.worker.send(msg)
            answer = await fut
        finally:
            self.worker.pending.pop((self.episode, call), None)
        if "error" in answer:
            raise (EngineFailed if answer.get("engine") else RemoteEpisodeError)(answer["error"])
        self.actions += 1
        return request_output(answer, toks, f"ep{self.episode}-{call}")


_episode: contextvars.ContextVar[EngineProxy | None] = contextvars.ContextVar("rayless_env_episode", default=None)


class SharedEngine:
    """The one ``llm_engine`` every episode of this worker is handed, as OpenRLHF hands its executors
    one engine object (an executor may keep the first episode's): each call is the calling
    episode's, found by a context variable set in the episode's task (tasks it spawns inherit
    it). A call from a thread of the executor's own carries no episode and is refused with why."""

    def __getattr__(self, name: str) -> Any:
        proxy = _episode.get()
        if proxy is None or name.startswith("_"):
            raise AttributeError(f"llm_engine.{name} is an episode's, and no episode is running here")
        return getattr(proxy, name)

    async def generate(self, token_ids: Any, sampling_params: Any, **kw: Any) -> RequestOutput:
        proxy = _episode.get()
        if proxy is None:
            raise RuntimeError(
                "llm_engine.generate was called outside an episode's task (from a thread of the executor's own?): "
                "in an environment worker an episode's calls come from its task; run such an executor with "
                "--agent_env_workers 0"
            )
        return await proxy.generate(token_ids, sampling_params, **kw)


def _portable(result: Any) -> Any:
    """The executor's result as msgpack carries it: the fields the server builds the episode
    from, numbers checked here (with the server's field names) so a tensor reward travels."""
    from rollout_service.agent_api import as_number, numeric_logs

    if not isinstance(result, dict):
        return result  # the server names the type in its error
    out: dict[str, Any] = {}
    toks: Any = result.get("observation_tokens")
    if hasattr(toks, "tolist"):
        toks = toks.tolist()
    out["observation_tokens"] = list(toks) if isinstance(toks, list | tuple) else toks
    out["action_ranges"] = [[int(a), int(b)] for a, b in result.get("action_ranges") or []]
    if "reward" in result:  # None: left to the run's reward service (build_episode's rule)
        r = result["reward"]
        out["reward"] = None if r is None else as_number(r, "the episode's 'reward'")
    if result.get("scores") is not None:
        out["scores"] = as_number(result["scores"], "the episode's 'scores'")
    out["extra_logs"] = numeric_logs(result.get("extra_logs"), "execute()")
    if result.get("done") is not None:
        out["done"] = bool(result["done"])
    return out


class Worker:
    def __init__(self, writer: asyncio.StreamWriter, run_episode: Any) -> None:
        self.writer = writer
        self.run_episode = run_episode  # (llm_engine, msg) -> awaitable result dict
        self.pending: dict[tuple[int, int], asyncio.Future] = {}
        self.episodes: dict[int, asyncio.Task] = {}
        self.engine = SharedEngine()
        self.handled = 0  # messages read from the server: every message says so ("ack")

    def send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame({**msg, "ack": self.handled}))

    async def beat(self, every_s: float) -> None:
        """Says the event loop runs: a blocking call in an ``async`` step stops these, and the
        server tells such a worker from one whose episode merely awaits too long."""
        while True:
            self.send({"op": "beat"})
            await asyncio.sleep(every_s)

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                msg = await read_frame(reader)
            except EOFError:
                return  # the server closed the socket (or died): stop
            self.handled += 1
            op = msg["op"]
            if op in ("run", "out"):
                # Said before the episode's code can run (it runs on a later turn of this loop):
                # the server then knows this episode's code may be running when the worker dies.
                self.send({"op": "ack"})
            if op == "run":
                ep: int = msg["ep"]
                task = asyncio.ensure_future(self._episode(msg))
                self.episodes[ep] = task
                task.add_done_callback(functools.partial(self._forget, ep))
            elif op == "out":
                fut = self.pending.get((msg["ep"], msg["call"]))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif op == "cancel":
                gone = self.episodes.pop(msg["ep"], None)
                if gone is not None:
                    gone.cancel()  # a plain-def step in a thread keeps running: its thread is lost
                self.send({"op": "cancelled", "ep": msg["ep"]})
            await self.writer.drain()

    def _forget(self, ep: int, _task: asyncio.Task) -> None:
        self.episodes.pop(ep, None)

    async def _episode(self, msg: dict) -> None:
        ep = msg["ep"]
        _episode.set(EngineProxy(self, ep, list(msg["prompt_token_ids"]), int(msg.get("max_turns", 0))))
        try:
            result = await self.run_episode(self.engine, msg)
            answer = {"op": "done", "ep": ep, "result": _portable(result)}
        except asyncio.CancelledError:
            return  # the server gave the episode up and was answered by the cancel
        except (RemoteEpisodeError, EngineFailed) as e:
            answer = {"op": "failed", "ep": ep, "error": str(e), "server": True}
        except SystemExit as e:  # an exception like any other here: the episode fails, not the worker
            answer = {"op": "failed", "ep": ep, "error": f"the agent called sys.exit({e.code!r})"}
        except BaseException as e:  # noqa: BLE001 - anything the user's code raises fails its episode only
            from rollout_service.agent_api import EnvironmentError_

            what = str(e) if isinstance(e, EnvironmentError_) else f"the agent raised {type(e).__name__}: {e}"
            answer = {"op": "failed", "ep": ep, "error": what, "traceback": traceback.format_exc(limit=-4)}
        try:
            self.send(answer)
        except (TypeError, OverflowError) as e:  # a value msgpack cannot carry
            self.send({"op": "failed", "ep": ep, "error": f"execute() returned a value that cannot be sent: {e}"})


def _executor_kind(args: argparse.Namespace, tokenizer: Any):
    """OpenRLHF's AgentExecutor contract: ``execute(prompt, label, sampling_params, max_length,
    hf_tokenizer, llm_engine)``."""
    from rollout_service.agent import load_agent

    executor, _ = load_agent(args.agent)

    async def run_episode(engine: SharedEngine, msg: dict) -> Any:
        sp = SamplingParams(**{k: v for k, v in msg["sp"].items() if k in {f.name for f in fields(SamplingParams)}})
        return await executor.execute(msg["prompt"], msg["label"], copy.copy(sp), msg["max_len"], tokenizer, engine)

    return run_episode


KINDS = {"executor": _executor_kind}


def load_tokenizer(model: str, factory: str) -> Any:
    """``AutoTokenizer.from_pretrained(model)``, or ``factory`` ("module:callable") when given
    (tests and benches: a tokenizer whose tokens are known by hand, without transformers)."""
    if factory:
        mod, _, name = factory.partition(":")
        return getattr(importlib.import_module(mod), name)()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


async def _main(args: argparse.Namespace) -> int:
    import socket

    sock = socket.socket(fileno=args.fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_factory)
        run_episode = KINDS[args.kind](args, tokenizer)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in the file is a load error too
        writer.write(frame({"op": "error", "error": str(e) if isinstance(e, ValueError) else repr(e)}))
        await writer.drain()
        return 1
    worker = Worker(writer, run_episode)
    worker.send({"op": "ready"})
    beats = asyncio.ensure_future(worker.beat(args.beat_s))
    await worker.serve(reader)
    beats.cancel()
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description="environment worker (started by a rollout server)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--agent", required=True, help="the agent file")
    p.add_argument("--kind", default="executor", choices=sorted(KINDS))
    p.add_argument("--tokenizer", default="", help="model whose tokenizer the executor gets")
    p.add_argument("--tokenizer_factory", default="", help="module:callable building the tokenizer instead")
    p.add_argument("--beat_s", type=float, default=0.2, help="seconds between the loop's beats to the server")
    args = p.parse_args()
    from common.child_process import die_with_parent

    die_with_parent()
    # A Ctrl-C in the terminal reaches the whole process group: the server stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
