"""The rollout server process: ``RolloutCore`` behind a DEALER socket to the controller.

One asyncio loop owns the socket (``AsyncEndpoint``; sends from many coroutines are serialised
by its lock). After the handshake (Hello with capacity, model, TP, dtype, weight backend;
Welcome) two loops run side by side:

- the receive loop: a PromptBatch becomes one task per prompt; each finished prompt goes back
  as a SampleBatch at once (or, with ``--coalesce_ms``, gathered with others finishing within
  that window). Control calls (weight-update steps, pause, resume, sleep, health, shutdown)
  run as tasks and are answered with the request's ``call_id``;
- heartbeats every ``--heartbeat_s`` with the policy version and metrics;
- nothing else: vLLM's own engine process does the work.

Errors: a bad request (a prompt outside the vocabulary, a weight step out of order, a message
a rollout server does not take) is answered with ``Error`` for that request, naming the prompt
ids it concerns, and the server carries on. A dead engine, SIGTERM or an unexpected crash
sends ``Error(code="fatal")`` first, so the controller re-issues this server's prompts at
once instead of waiting for the heartbeat deadline, then the process exits (1 for a fault,
143 for SIGTERM, which is logged as INFO: a stop that was asked for). While it waits for a
controller -- before the first Welcome, or for a restarted one -- a signal still ends it at
once (nobody to tell before a Welcome), and so does an engine that dies (exit 1, one error
line): a server that cannot serve does not keep saying Hello. An engine that cannot start
here (vLLM-CPU's memory check, ``common/vllm_memory.py``) is one log line naming the flag and
exit 2, not retried. The handshake, heartbeat timing, last words, signals and exit codes are
the shell both services share (``common/service.py``, which states the exit codes); what is
here is the rollout server's own.

The controller's policy version from Welcome is a floor: no prompt is started on weights
older than it, so a server that joins mid-run serves nothing until the learner has pushed it
the current weights (the controller also holds work back until then; this is the backstop).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from common import protocol as P
from common.service import RECONNECT_SEND_S, STOP_SIGNALS, ExitCode, ServiceShell, signal_exit_code
from common.transport import AsyncEndpoint, TransportError, default_name
from common.vllm_memory import EngineStartRefused
from rollout_service.config import RolloutConfig
from rollout_service.core import AgentFailed, BadRequest, NotSupported, PromptResult, RolloutCore

log = logging.getLogger(__name__)

ENGINE_WATCH_S = 0.5  # how often the engine's health is read while no controller has welcomed us


def sample_batch(results: list[PromptResult], server: str) -> P.SampleBatch:
    """Columnar SampleBatch of the samples of ``results`` (prompt by prompt, sample by sample).
    Agent episodes (every sample of a batch is one, or none is) add their own prompt and their
    outputs (``EpisodeOutputs``: action mask, reward, score, turns, logs)."""
    pids, idx, lens, toks, reasons, versions = [], [], [], [], [], []
    lps: list[float] = []
    with_lp = all(s.logprobs is not None for r in results for s in r.samples)
    episodes = [s.episode for r in results for s in r.samples if s.episode is not None]
    agent = bool(episodes) and len(episodes) == sum(len(r.samples) for r in results)
    for r in results:
        for i, s in enumerate(r.samples):
            pids.append(r.prompt_id)
            idx.append(i)
            lens.append(len(s.token_ids))
            toks.extend(s.token_ids)
            if with_lp and s.logprobs is not None:  # with_lp: every sample has them
                lps.extend(s.logprobs)
            reasons.append(s.finish_reason)
            versions.append(s.policy_version)
    extra: dict = {}
    if agent:
        extra = dict(
            prompt_token_ids=[list(e.prompt) for e in episodes],
            episodes=P.EpisodeOutputs(
                action_mask=np.asarray([m for e in episodes for m in e.action_mask], dtype=np.uint8),
                rewards=[e.reward for e in episodes],  # None: left to the run's reward service
                scores=[e.score for e in episodes],
                turns=[int(e.turns) for e in episodes],
                logs=[dict(e.extra_logs) for e in episodes],
            ),
        )
    return P.SampleBatch(
        prompt_ids=pids,
        sample_indices=idx,
        response_lengths=lens,
        response_ids=np.asarray(toks, dtype=np.int32),
        logprobs=np.asarray(lps, dtype=np.float32) if with_lp else None,
        finish_reasons=reasons,
        policy_versions=versions,
        server=server,
        **extra,
    )


class RolloutServer:
    def __init__(self, cfg: RolloutConfig, core: RolloutCore, ep: AsyncEndpoint) -> None:
        self.cfg, self.core, self.ep = cfg, core, ep
        self.name = ep.name
        self.shell = ServiceShell(
            "rollout",
            self.name,
            cfg.controller,
            heartbeat_s=cfg.heartbeat_s,
            connect_timeout_s=cfg.connect_timeout_s,
            reconnect_timeout_s=cfg.reconnect_timeout_s,
        )
        self._stop = asyncio.Event()
        self._exit_code: int = ExitCode.STOPPED  # or 128 + a signal's number (signal_exit)
        self._tasks: set[asyncio.Task] = set()
        self._prompt_tasks: dict[int, asyncio.Task] = {}  # prompt id -> its task, for Abort
        self._pending: list[PromptResult] = []  # finished, waiting for the coalescing window
        self._flush_task: asyncio.Task | None = None
        self._weights_dropped = False  # abort_weight_sync done for the current loss of the controller
        self._welcomed = False  # a controller knows this server: it gets last words
        # Each takes the message type it is keyed by (see _call), which a dict's type cannot say: Any.
        self._handlers: dict[type[P.Message], Callable[[Any], Awaitable[P.Message]]] = {
            P.WeightSyncInit: self._on_sync_init,
            P.WeightUpdateStart: self._on_update_start,
            P.WeightUpdate: self._on_update,
            P.WeightUpdateFinish: self._on_update_finish,
            P.WeightSyncClose: self._on_sync_close,
            P.Pause: self._on_pause,
            P.Resume: self._on_resume,
            P.Sleep: self._on_sleep,
            P.WakeUp: self._on_wake_up,
            P.GetHealth: self._on_health,
            P.Shutdown: self._on_shutdown,
        }

    # ------------------------------------------------------------------ main
    async def serve(self) -> int:
        # Before the first Hello: a server waiting for a controller that is not there (yet) must
        # still stop when told, and stop its engine.
        self.shell.catch_signals(asyncio.get_running_loop(), then=self._on_signal)
        welcome = await self._handshake()
        if welcome is None:
            return self._exit_code
        self._welcomed = True
        self.core.admit_from(welcome.policy_version)
        log.info(
            "%s welcomed by the controller (its policy version %d, ours %d)",
            self.name,
            welcome.policy_version,
            self.core.version,
        )
        workers = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]
        for w in workers:
            w.add_done_callback(self._loop_ended)
        await self._stop.wait()
        for t in workers + list(self._tasks):
            t.cancel()
        await asyncio.gather(*workers, *self._tasks, return_exceptions=True)
        return self._exit_code

    async def _handshake(self) -> P.Welcome | None:
        """Hello until Welcome (``TransportError`` after --connect_timeout_s), or None when the
        server is to stop first: on a signal, or when its engine died meanwhile -- it would only
        say Hello, for as long as --connect_timeout_s, for a server that cannot serve."""
        hello = asyncio.create_task(self.shell.asay_hello(self.ep, self.core.capabilities()))
        watch = asyncio.create_task(self._engine_watch())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({hello, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (hello, watch, stop):
                t.cancel()
            await asyncio.gather(hello, watch, stop, return_exceptions=True)
        # A stop wins over a Welcome that came in the same instant: the controller then finds
        # this server silent and drops it, as if the signal had come a moment earlier.
        if self._stop.is_set() or hello.cancelled():
            return None
        return hello.result()  # the Welcome, or the TransportError of no controller in time

    async def _engine_watch(self) -> None:
        """Before the Welcome: an engine that dies ends the server (exit 1), in one line."""
        while not self._engine_dead:
            await asyncio.sleep(ENGINE_WATCH_S)
        log.error(
            "%s: the vLLM engine died while waiting for the controller at %s; stopping (see its log above)",
            self.name,
            self.cfg.controller,
        )
        self._exit_code = ExitCode.FATAL
        self._stop.set()

    @property
    def _engine_dead(self) -> bool:
        return self.core.llm is not None and self.core.llm.errored

    def _on_signal(self, words: str) -> None:
        """SIGTERM/SIGINT (on the loop, ``ServiceShell.catch_signals``): a controller that knows
        this server is told it is going; before any did, there is nobody to tell."""
        if self._welcomed:
            self._spawn(self._die(words, self.shell.signal_exit, fault=False))
            return
        if self._stop.is_set():  # stopping already (an engine that died, an earlier signal)
            return
        log.info("%s (no controller had welcomed it)", words)
        self._exit_code = self.shell.signal_exit
        self._stop.set()

    def _loop_ended(self, task: asyncio.Task) -> None:
        # A bug in a loop must not leave a zombie that heartbeats nothing and serves nothing.
        if not task.cancelled() and task.exception() is not None and not self._stop.is_set():
            log.error("internal error", exc_info=task.exception())
            self._spawn(self._fatal(f"internal error: {task.exception()!r}"))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _recv_loop(self) -> None:
        while not self._stop.is_set():
            msg = await self.ep.recv(timeout=0.5)
            if msg is None:
                continue
            if isinstance(msg, P.PromptBatch):
                seeds: Sequence[int | None] = msg.seeds or [None] * len(msg.prompt_ids)
                labels: Sequence[str | None] = msg.labels or [None] * len(msg.prompt_ids)
                for pid, toks, seed, label in zip(msg.prompt_ids, msg.token_ids, seeds, labels, strict=True):
                    serve = self._serve_prompt(pid, toks, msg.sampling, msg.policy_version, seed, msg.agent, label)
                    self._track(pid, self._spawn(serve))
            elif isinstance(msg, P.Abort):
                self._abort(msg)
            elif type(msg) in self._handlers:
                self._spawn(self._call(msg))
            elif isinstance(msg, P.Error) and msg.code == "unknown_peer":
                await self._hello_again()
            elif isinstance(msg, P.Welcome) and self.shell.welcomed_again(msg):
                self.core.admit_from(msg.policy_version)
                # Before any call of the new controller is spawned: the old one's weight calls
                # still queued are refused, its open update failed, its group dropped.
                self._drop_weight_sync("a new controller session began")
            elif isinstance(msg, P.Welcome):
                log.debug("ignoring a Welcome to an earlier Hello")
            elif isinstance(msg, P.Error):
                log.error("controller reported an error: %s: %s", msg.code, msg.message)
            else:
                await self._send(
                    P.Error(
                        code="bad_request",
                        call_id=msg.call_id,
                        message=f"a rollout server does not take {type(msg).__name__}",
                    )
                )

    def _track(self, pid: int, task: asyncio.Task) -> None:
        self._prompt_tasks[pid] = task
        task.add_done_callback(
            lambda t: self._prompt_tasks.pop(pid, None) if self._prompt_tasks.get(pid) is t else None
        )

    def _abort(self, msg: P.Abort) -> None:
        """Cancelling a prompt's task aborts its request in vLLM (``RolloutCore.generate``) or,
        before admission, keeps it from starting; nothing is sent for it."""
        tasks = [t for pid in msg.prompt_ids if (t := self._prompt_tasks.pop(pid, None)) is not None]
        for t in tasks:
            t.cancel()
        self.core.count_aborted_by_controller(len(tasks))
        log.info(
            "aborted %d of %d prompt(s) on the controller's request: %s", len(tasks), len(msg.prompt_ids), msg.reason
        )

    async def _hello_again(self) -> None:
        """Forgotten by the controller: introduce ourselves again. It treats us as a joiner (new
        weight group, current weights) before giving us work."""
        hello = self.shell.hello_again(self.core.capabilities(), self.ep.core.new_call_id())
        if hello is not None:
            await self._send(hello)

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            if self._engine_dead:  # also while the controller is gone (_reconnect): checked every second
                await self._fatal("vLLM engine died (see its log above)")
                return
            if self.shell.lost:
                await self._reconnect()
                continue
            await self._send(self.shell.heartbeat(self.core.metrics(), self.core.version), self.shell.heartbeat_send_s)
            await asyncio.sleep(self.shell.heartbeat_in())

    async def _reconnect(self) -> None:
        """The controller is gone (a send could not leave): Hello until a restarted one
        welcomes us (the receive loop sees the Welcome), keeping the engine; give up after
        --reconnect_timeout_s."""
        if self.shell.reconnect_expired():
            self._exit_code = self.shell.no_controller_exit
            self._stop.set()
            return
        if not self._weights_dropped:  # once per loss: free the engine of the gone learner's push
            self._drop_weight_sync("the controller went away")
        if self._prompt_tasks:  # asked by the gone controller: free vLLM of them at once
            log.info("aborting %d prompt(s) of the controller that went away", len(self._prompt_tasks))
            for t in list(self._prompt_tasks.values()):
                t.cancel()
            self._prompt_tasks.clear()
        hello = self.shell.reconnect_hello(self.core.capabilities(), self.ep.core.new_call_id())
        if hello is not None:
            try:
                await self.ep.send(hello, timeout=RECONNECT_SEND_S)
            except TransportError:
                self.shell.hello_unsent()
        await asyncio.sleep(RECONNECT_SEND_S)

    def _drop_weight_sync(self, why: str) -> None:
        """A learner killed mid-push would otherwise leave the update open and the next
        learner's WeightSyncInit refused or stuck behind it (``RolloutCore.abort_weight_sync``)."""
        self._weights_dropped = self.shell.lost
        self._spawn(self.core.abort_weight_sync(why))

    async def _send(self, msg: P.Message, timeout: float | None = None) -> None:
        try:
            await self.ep.send(msg, timeout=timeout)
        except TransportError as e:
            # The controller is gone or not reading; what we could not deliver it re-issues.
            log.error("could not send %s: %s", type(msg).__name__, e)
            self.shell.controller_lost(f"could not send {type(msg).__name__}")

    async def _fatal(self, why: str) -> None:
        await self._die(f"{self.name}: {why}", ExitCode.FATAL)

    async def _die(self, last_words: str, code: int, fault: bool = True) -> None:
        if self._stop.is_set():
            return  # stopped on the controller's Shutdown: nobody is waiting for last words
        if await self.shell.asend_last_words(self.ep, last_words, fault=fault):
            self._exit_code = code
            self._stop.set()

    # ------------------------------------------------------------------ work
    async def _serve_prompt(
        self,
        pid: int,
        toks: list[int],
        sampling: P.SamplingParams,
        min_version: int,
        seed: int | None,
        agent: P.AgentParams | None = None,
        label: str | None = None,
    ) -> None:
        session = self.shell.session
        try:
            result = await self.core.generate(pid, toks, sampling, min_version, seed=seed, agent=agent, label=label)
        except asyncio.CancelledError:
            raise
        except BadRequest as e:
            await self._send(P.Error(code="bad_request", message=f"prompt {pid}: {e}", prompt_ids=[pid]))
            return
        except AgentFailed as e:  # the environment's fault: the controller issues the prompt again
            await self._send(P.Error(code="agent_failed", message=f"prompt {pid}: {e}", prompt_ids=[pid]))
            return
        except Exception as e:  # reported, then decided fatal or not
            if self._engine_dead:
                await self._fatal(f"vLLM engine died while generating prompt {pid}: {e!r}")
            else:
                log.exception("prompt %d failed", pid)
                await self._send(P.Error(code="internal", message=f"prompt {pid}: {e!r}", prompt_ids=[pid]))
            return
        if session != self.shell.session:
            # Asked by a controller that has since forgotten us (or restarted): its prompt ids
            # mean nothing to the one we serve now.
            log.info("dropping prompt %d: asked before the controller welcomed us again", pid)
            return
        if self.cfg.coalesce_ms <= 0:
            await self._send(sample_batch([result], self.name))
            return
        self._pending.append(result)
        if self._flush_task is None:
            self._flush_task = self._spawn(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.cfg.coalesce_ms / 1000)
        batch, self._pending, self._flush_task = self._pending, [], None
        for agent in (False, True):  # a SampleBatch is all agent episodes or none
            part = [r for r in batch if (r.samples[0].episode is not None) == agent]
            if part:
                await self._send(sample_batch(part, self.name))

    # ------------------------------------------------------------------ control calls
    async def _call(self, msg: P.Message) -> None:
        try:
            reply = await self._handlers[type(msg)](msg)
        except asyncio.CancelledError:
            raise
        except BadRequest as e:
            reply = P.Error(code="bad_request", message=str(e))
        except NotSupported as e:
            reply = P.Error(code="not_supported", message=str(e))
        except TimeoutError as e:
            reply = P.Error(code="timeout", message=f"{type(msg).__name__} timed out: {e}")
        except Exception as e:  # answered; the server lives on unless the engine died
            log.exception("%s failed", type(msg).__name__)
            reply = P.Error(code="internal", message=f"{type(msg).__name__} failed: {e!r}")
        reply.call_id = msg.call_id
        await self._send(reply)
        if self._engine_dead:
            await self._fatal(f"vLLM engine died during {type(msg).__name__}")

    async def _on_sync_init(self, m: P.WeightSyncInit) -> P.Message:
        workers = await self.core.init_weight_transfer(m.backend, m.init_info, m.timeout_s)
        return P.Ack(info=P.WorkersJoined(workers=workers))

    async def _on_update_start(self, m: P.WeightUpdateStart) -> P.Message:
        await self.core.start_weight_update(m.policy_version, adapter_only=m.adapter_only)
        return P.Ack()

    async def _on_update(self, m: P.WeightUpdate) -> P.Message:
        seconds = await self.core.update_weights(m.names, m.dtype_names, m.shapes, m.aliases, m.lora, m.encoding)
        return P.Ack(info=P.WeightsLoaded(seconds=seconds))

    async def _on_update_finish(self, m: P.WeightUpdateFinish) -> P.Message:
        reset = await self.core.finish_weight_update(m.policy_version)
        return P.Ack(info=P.UpdateFinished(policy_version=self.core.version, prefix_cache_reset=bool(reset)))

    async def _on_sync_close(self, m: P.WeightSyncClose) -> P.Message:
        await self.core.close_weight_transfer()
        return P.Ack()

    async def _on_pause(self, m: P.Pause) -> P.Message:
        await self.core.pause()
        return P.Ack()

    async def _on_resume(self, m: P.Resume) -> P.Message:
        await self.core.resume()
        return P.Ack()

    async def _on_sleep(self, m: P.Sleep) -> P.Message:
        await self.core.sleep(m.level)
        return P.Ack()

    async def _on_wake_up(self, m: P.WakeUp) -> P.Message:
        await self.core.wake_up(m.tags)
        return P.Ack()

    async def _on_health(self, m: P.GetHealth) -> P.Message:
        return P.Health(
            name=self.name, state=self.core.state, policy_version=self.core.version, stats=self.core.metrics()
        )

    async def _on_shutdown(self, m: P.Shutdown) -> P.Message:
        log.info("shutdown requested by the controller: %s", m.reason or "(no reason given)")
        # Answer first, then stop: in-flight prompts are dropped (the controller asked).
        asyncio.get_running_loop().call_soon(self._stop.set)
        return P.Ack(info=P.ShutdownAccepted(unanswered=self.core.in_flight))


async def amain(cfg: RolloutConfig) -> int:
    name = cfg.name = cfg.name or default_name("rollout")
    t0 = time.monotonic()
    # vLLM's start-up blocks this loop for seconds while it spawns the engine's processes. A
    # SIGTERM/SIGINT then must not kill this process alone: the engine's processes would outlive
    # it (holding their memory, a GPU's too). It is noted, and acted on once create() returns.
    loop = asyncio.get_running_loop()
    stopped: list[signal.Signals] = []
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stopped.append, sig)
    try:  # a create() that fails has stopped what it started
        core = await RolloutCore.create(cfg)
    except EngineStartRefused as e:  # one line that names the flag; the same start would fail again
        log.error("%s", e)
        return ExitCode.NO_START
    for _ in range(3):  # a few turns of the loop: a signal that came during create() reaches `stopped`
        await asyncio.sleep(0)
    if stopped:
        log.warning("%s: %s during engine start-up; stopping the engine", name, stopped[0].name)
        await core.shutdown()
        return signal_exit_code(stopped[0])  # as a signal while serving
    log.info("%s: engine ready in %.1f s", name, time.monotonic() - t0)
    ep = AsyncEndpoint(cfg.controller, name=name, auth_dir=cfg.auth_dir or None)
    server = RolloutServer(cfg, core, ep)
    try:
        return await server.serve()
    except TransportError as e:  # no Welcome: the only send whose failure is not just logged
        log.error("%s", e)
        return server.shell.no_controller_exit
    finally:
        c = core.metrics()
        log.info(
            "%s: served %d prompt(s), %d sample(s), %d weight update(s) in %.0f s",
            name,
            int(c["prompts"]),
            int(c["samples"]),
            int(c["updates"]),
            time.monotonic() - t0,
        )
        ep.close()
        await core.shutdown()


def run(cfg: RolloutConfig) -> int:
    import os

    if os.environ.get("RAYLESS_EVENT_LOOP", "asyncio") == "uvloop":
        import uvloop

        return uvloop.run(amain(cfg))
    return asyncio.run(amain(cfg))
