"""Environment worker processes beside a rollout server: agent episodes run there, not here.

``--agent_env_workers N`` child processes (``rollout_service/env_worker.py``) each load the
agent file and a tokenizer and run episodes; the server keeps the engine. An episode's state
(its ``AgentInstance``, the executor) lives in one worker; every engine call it makes comes
back here as a message, and the episode's ``TurnEngine`` runs it as it would in-process
(records the turn, checks ``--max_len``/``--agent_max_turns``, goes through the version gate),
so the episode is built and checked here from the engine's own record (``build_episode``),
never from what the worker says it generated. ``N = 0`` runs the executor in the server's own
process as before (``agent.run_episode``): for comparison (``bench/agent.py``) and debugging
an agent file, not for training with untrusted environments.

Why processes. A user environment that hangs, segfaults, leaks memory or calls ``sys.exit``
inside the server does it on the event loop that drives vLLM and the heartbeats, or keeps one
of its 64 step threads forever: 64 hung steps leave a server that heartbeats healthy and
serves nothing. A process can be killed from outside and replaced.

How many episodes a worker runs: any number, at once (the least loaded live worker takes the
next one). A worker process per episode would cost a tokenizer and an agent file per episode
in flight (hundreds of them) and would not beat a shared event loop for async environments;
plain ``def`` steps run on the worker's own thread pool, as they did in the server's.

Faults, and what happens to the other episodes of a worker:

* a step past ``--agent_step_timeout_s`` (the server times it: no engine call running), or an
  episode past ``--agent_episode_timeout_s`` (wall time from its start): that episode fails and
  the worker is told to cancel it. A worker that does not acknowledge within ``cancel_grace_s``
  has a blocked event loop (a blocking call in an ``async`` step): it is killed, and its other
  episodes, innocent, are re-run. A step past its limit while the worker's loop has been quiet
  (no beat) for ``blocked_after_s`` (at most half the step limit) blocked the loop itself: the worker is killed at once, the
  episode in environment code the longest fails (the worker handles messages in order: the
  others' answers wait behind the blocking step) and the others are re-run. A cancelled plain-``def`` step keeps its thread in the worker;
  after ``max_step_cancels`` cancels the worker is retired: it takes no new episode, finishes its
  running ones and is replaced (a fresh one starts at once);
* a worker that dies (a segfault, ``os._exit``, the kernel's OOM killer) or whose resident
  memory passes ``--agent_env_worker_memory_mb`` (killed; polled every ``poll_s``: an address
  space limit breaks torch's and tokenizers' reservations): its episodes that were inside an
  engine call are innocent and re-run on another worker from their first turn; those whose
  environment code was running are suspects: a lone suspect is the cause and fails; several
  are re-run, each at most once (suspected a second time, it fails). An innocent episode is
  re-run when its worker dies, up to ``MAX_RERUNS`` times. A worker acknowledges every message
  that resumes an episode before that episode's code can run, so an episode whose answer was
  never read (waiting behind a blocked loop, or in flight) is not a suspect.
  The worker is replaced (with a back-off when replacements fail to start);
* ``sys.exit`` in a step is an exception in the worker (``SystemExit``): that episode fails,
  the worker and its other episodes go on.

A failed episode raises ``EpisodeError`` (the server fails its prompt as for any agent fault:
counted, logged with the prompt id, re-issued or dropped by ``--agent_failure``); counters in
``metrics()``. ``live_share()`` is the share of the pool that is up: the server's heartbeat
scales its capacity by it, so a server whose workers keep dying gets less work, none at 0.
Worker processes die with the server (``PR_SET_PDEATHSIG``) and are stopped by ``close()``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.agent_file import agent_argument
from common.child_process import stop as stop_process
from rollout_service.agent import Episode, EpisodeError, TurnEngine, build_episode
from rollout_service.env_worker import frame, read_frame, sampling_dict

log = logging.getLogger(__name__)

MAX_RERUNS = 3  # however innocent it looks, an episode whose worker died this often fails
ROOT = Path(__file__).resolve().parents[1]  # the worker imports rollout_service and common from here
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB (Linux /proc); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / (1 << 20)
    except (OSError, ValueError, IndexError):
        return None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "closed its socket"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Run:
    """One attempt of an episode on one worker."""

    ep: int
    prompt_id: int
    engine: TurnEngine
    done: asyncio.Future  # ("done", result) | ("failed", message) | ("rerun", suspected) | ("lost", why)
    suspected: bool  # an earlier attempt was in environment code when its worker died
    calls: set[asyncio.Task] = field(default_factory=set)  # engine calls of this attempt, running here
    last_sent: int = 0  # the worker's frame number of the last message sent for it (its start, an answer)
    reruns: int = 0  # attempts before this one


class _Worker:
    def __init__(self, proc: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.proc, self.reader, self.writer = proc, reader, writer
        self.runs: dict[int, _Run] = {}
        self.retiring = False  # takes no new episode; stopped when its running ones end
        self.dead = False
        self.step_cancels = 0
        # (why, who is suspected: "gone" (the culprit already failed), "crash" (the episodes in
        # environment code), "blocked" (those in environment code since before the loop went quiet))
        self.kill_reason: tuple[str, str] | None = None
        self.last_heard = time.monotonic()  # any message, beats included: its event loop ran
        self.sent = 0  # frames sent to it
        self.acked = -1  # of those, how many it said it had read (-1: it never said)
        self.acks: dict[int, asyncio.Future] = {}
        self.reader_task: asyncio.Task | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict) -> int:
        """Sends ``msg``; its frame number (whether the worker read it: ``acked``)."""
        if not self.dead and not self.writer.is_closing():
            self.writer.write(frame(msg))
            self.sent += 1
        return self.sent

    def delivered(self, run: _Run) -> bool:
        """The worker read the last message sent for ``run``: its code may be running."""
        return self.acked < 0 or run.last_sent <= self.acked


class EnvPool:
    """``workers`` environment worker processes running ``agent_path``'s episodes (module docstring)."""

    def __init__(
        self,
        agent_path: str,
        *,
        workers: int,
        model: str = "",
        tokenizer_factory: str = "",
        memory_mb: float = 0.0,
        kind: str = "executor",
        start_timeout_s: float = 120.0,
        cancel_grace_s: float = 2.0,
        max_step_cancels: int = 8,
        poll_s: float = 0.25,
        blocked_after_s: float = 0.5,
        beat_s: float = 0.2,
    ) -> None:
        if workers < 1:
            raise ValueError(f"--agent_env_workers must be >= 1 for a worker pool, got {workers}")
        self.agent_path = agent_argument(agent_path)  # a file's absolute path; a hub spec (gem:ID) as it is
        self.size = workers
        self.memory_mb = memory_mb
        self.start_timeout_s, self.cancel_grace_s = start_timeout_s, cancel_grace_s
        self.max_step_cancels, self.poll_s, self.blocked_after_s = max_step_cancels, poll_s, blocked_after_s
        self._argv = [
            sys.executable,
            "-m",
            "rollout_service.env_worker",
            "--agent",
            self.agent_path,
            "--kind",
            kind,
            "--tokenizer",
            model,
            "--tokenizer_factory",
            tokenizer_factory,
            "--beat_s",
            str(beat_s),
        ]
        self.beat_s = beat_s
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self._env = env
        self._workers: set[_Worker] = set()
        self._starting = 0
        self._ids = itertools.count()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._last_death = ""
        self._start_failures_in_a_row = 0
        self.counters = {
            "env_worker_deaths": 0,  # every worker that died or was killed (each one replaced)
            "env_worker_crashes": 0,  # died on its own: a signal, os._exit, the OOM killer
            "env_worker_hung": 0,  # killed: its event loop did not answer a cancel
            "env_worker_over_memory": 0,  # killed: resident memory past --agent_env_worker_memory_mb
            "env_worker_retired": 0,  # replaced after max_step_cancels cancelled steps (lost threads)
            "env_worker_start_failures": 0,
            "env_episodes_rerun": 0,  # re-run from their first turn after their worker died
            "env_episodes_lost": 0,  # failed because their worker died under them
            "env_episodes_timed_out": 0,  # a step or the whole episode past its limit
        }

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Starts every worker and waits until each has loaded the file; raises ValueError
        naming the file when one cannot (the other workers are stopped)."""
        try:
            started = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        except BaseException:
            await self.close()
            raise
        self._workers.update(started)
        self._keep(self._monitor())
        log.info("%d environment worker(s) running %s (pids %s)", self.size, self.agent_path, [w.pid for w in started])

    async def _spawn(self) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [*self._argv, "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=self._env,
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        try:
            msg = await asyncio.wait_for(read_frame(reader), self.start_timeout_s)
        except (TimeoutError, EOFError, ValueError) as e:
            stop_process(proc, 1.0)
            writer.close()
            if isinstance(e, TimeoutError):
                why = f"did not load it within {self.start_timeout_s:.0f} s (does importing it hang?)"
            else:
                why = f"{_exit_text(proc.returncode)} while loading it (see its output above)"
            raise ValueError(f"--agent_func_path {self.agent_path}: an environment worker {why}") from None
        if msg.get("op") != "ready":
            stop_process(proc, 1.0)
            writer.close()
            raise ValueError(
                msg.get("error") or f"--agent_func_path {self.agent_path}: the worker answered {msg!r:.100}"
            )
        w = _Worker(proc, reader, writer)
        w.reader_task = self._keep(self._read(w))
        return w

    def _keep(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        workers, self._workers = list(self._workers), set()
        for w in workers:
            w.dead = True
            w.writer.close()  # EOF: the worker exits by itself
            for run in w.runs.values():
                if not run.done.done():
                    run.done.set_result(("lost", "the rollout server is stopping"))
        # terminate, then kill: a worker stuck in user code does not exit on EOF
        await asyncio.gather(*(asyncio.to_thread(stop_process, w.proc, 1.0) for w in workers), return_exceptions=True)

    def live(self) -> int:
        return sum(1 for w in self._workers if not w.dead and not w.retiring)

    def live_share(self) -> float:
        """The share of ``--agent_env_workers`` that is up and taking episodes."""
        return min(1.0, self.live() / self.size)

    def metrics(self) -> dict[str, float]:
        return {
            "env_workers": float(self.size),
            "env_workers_live": float(self.live()),
            "env_episodes_running": float(sum(len(w.runs) for w in self._workers)),
            **{k: float(v) for k, v in self.counters.items()},
        }

    # ------------------------------------------------------------------ episodes
    async def run_episode(
        self,
        engine: TurnEngine,
        *,
        prompt_id: int,
        prompt_text: str,
        label: str | None,
        sampling_params: Any,
        step_timeout_s: float,
        episode_timeout_s: float = 0.0,
    ) -> Episode:
        """One episode in a worker (``agent.run_episode``'s contract): the Episode, or
        EpisodeError (the agent's, its environment's or its worker's fault), or what the engine
        raised (the server's). ``episode_timeout_s`` 0: no wall limit."""
        t0 = time.monotonic()
        sp = sampling_dict(sampling_params)
        suspected: bool | None = None  # None: the first attempt
        reruns = 0
        while True:
            worker = await self._pick()
            if suspected is not None:  # a re-run: its environment time starts now, not while it waited
                engine.restart()
            ep = next(self._ids)
            run = _Run(
                ep, prompt_id, engine, asyncio.get_running_loop().create_future(), bool(suspected), reruns=reruns
            )
            worker.runs[ep] = run
            run.last_sent = worker.send(
                {
                    "op": "run",
                    "ep": ep,
                    "prompt": prompt_text,
                    "label": label,
                    "sp": sp,
                    "max_len": engine.max_len,
                    "max_turns": engine.max_turns,
                    "prompt_token_ids": engine.prompt_token_ids,
                }
            )
            try:
                outcome = await self._watch(worker, run, step_timeout_s, episode_timeout_s, t0)
            except BaseException:  # a deadline, or the prompt cancelled (aborted, the server stopping)
                self._give_up(worker, run)
                raise
            finally:
                if run.calls:
                    await asyncio.gather(*run.calls, return_exceptions=True)
            if outcome[0] == "done":
                return build_episode(outcome[1], engine)
            if outcome[0] == "failed":
                if engine.engine_error is not None:  # vLLM failed under the agent: the server's fault
                    raise engine.engine_error
                raise EpisodeError(outcome[1])
            if outcome[0] == "lost":
                raise EpisodeError(outcome[1])
            suspected = bool(suspected) or outcome[1]
            reruns += 1

    async def _watch(self, worker: _Worker, run: _Run, step_s: float, episode_s: float, t0: float) -> tuple:
        engine = run.engine
        while not run.done.done():
            step_left = step_s - engine.environment_time()
            wall_left = episode_s - (time.monotonic() - t0) if episode_s else float("inf")
            quiet = time.monotonic() - worker.last_heard
            if step_left <= 0 and quiet > min(self.blocked_after_s, step_s / 2) and not worker.dead:
                # Its event loop is blocked: every episode of the worker is stuck, not only this
                # one. The death settles them all (the culprit fails, the others are re-run).
                self.counters["env_worker_hung"] += 1
                self._kill(
                    worker,
                    f"was killed: its event loop was blocked for {quiet:.1f} s (a blocking call in an async step)",
                    suspects="blocked",
                )
                await asyncio.wait({run.done})
                break
            if step_left <= 0 or wall_left <= 0:
                self.counters["env_episodes_timed_out"] += 1
                if step_left <= 0:
                    raise EpisodeError(
                        f"the environment took over {step_s:g} s in one step (--agent_step_timeout_s), "
                        f"after {len(engine.turns)} action(s)"
                    )
                raise EpisodeError(
                    f"the episode took over {episode_s:g} s (--agent_episode_timeout_s), after {len(engine.turns)} action(s)"
                )
            await asyncio.wait({run.done}, timeout=min(step_left, wall_left))
        return run.done.result()

    async def _pick(self) -> _Worker:
        """The least loaded live worker; waits for one while none is (replacements starting)."""
        deadline = time.monotonic() + self.start_timeout_s
        async with self._changed:
            while True:
                live = [w for w in self._workers if not w.dead and not w.retiring]
                if live:
                    return min(live, key=lambda w: len(w.runs))
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise EpisodeError(
                        f"no environment worker is running (--agent_env_workers {self.size}; the last one {self._last_death})"
                    )
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass

    def _give_up(self, worker: _Worker, run: _Run) -> None:
        """The server stops waiting for ``run`` (its deadline passed, or its prompt was cancelled):
        its engine calls are cancelled here and the worker is told to drop it. A worker whose
        loop does not acknowledge is blocked in user code and is killed; one that has lost too
        many step threads to cancelled plain-def steps is retired."""
        if worker.runs.pop(run.ep, None) is None:
            return  # already settled (the worker died, or answered meanwhile)
        # Only an episode whose environment code may be running can leave a thread behind (one
        # waiting on the engine, e.g. a prompt the controller aborted, runs none).
        in_environment = not run.engine.in_engine and worker.delivered(run)
        if not run.done.done():
            run.done.set_result(("lost", "given up"))
        for t in run.calls:
            t.cancel()
        if worker.dead:
            return
        if worker.retiring and not worker.runs:
            self._stop_retired(worker)
            return
        worker.step_cancels += in_environment
        ack = asyncio.get_running_loop().create_future()
        worker.acks[run.ep] = ack
        worker.send({"op": "cancel", "ep": run.ep})
        self._keep(self._await_ack(worker, run, ack))

    async def _await_ack(self, worker: _Worker, run: _Run, ack: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(ack, self.cancel_grace_s)
        except TimeoutError:
            if not worker.dead:
                self.counters["env_worker_hung"] += 1
                self._kill(
                    worker,
                    f"was killed: it did not answer within {self.cancel_grace_s:g} s after prompt {run.prompt_id}'s "
                    "episode ran over its limit (a blocking call in an async step holds its event loop)",
                    suspects="gone",
                )
            return
        finally:
            worker.acks.pop(run.ep, None)
        if worker.step_cancels >= self.max_step_cancels and not worker.retiring and not worker.dead:
            self.counters["env_worker_retired"] += 1
            log.warning(
                "environment worker %d: %d episodes cancelled (a plain-def step that never returns keeps its thread): "
                "retired, a fresh one replaces it",
                worker.pid,
                worker.step_cancels,
            )
            await self._retire(worker)

    async def _retire(self, worker: _Worker) -> None:
        worker.retiring = True
        self._replace()
        if not worker.runs:
            self._stop_retired(worker)

    def _stop_retired(self, worker: _Worker) -> None:
        worker.dead = True
        self._workers.discard(worker)
        worker.writer.close()
        self._keep(asyncio.to_thread(stop_process, worker.proc, 1.0))

    # ------------------------------------------------------------------ the wire
    async def _read(self, w: _Worker) -> None:
        try:
            while True:
                msg = await read_frame(w.reader)
                w.last_heard = time.monotonic()
                w.acked = max(w.acked, int(msg.get("ack", -1)))
                self._dispatch(w, msg)
        except (EOFError, ValueError) as e:
            if isinstance(e, ValueError):
                log.error("environment worker %d sent a malformed message: %s; killing it", w.pid, e)
                w.proc.kill()
        if not self._closed and not w.dead:
            await self._died(w)

    def _dispatch(self, w: _Worker, msg: dict) -> None:
        op, ep = msg["op"], msg.get("ep")
        if op == "gen":
            run = w.runs.get(ep)  # type: ignore[arg-type]
            if run is not None:  # else: an attempt given up meanwhile
                task = asyncio.ensure_future(self._generate(w, run, msg))
                run.calls.add(task)
                task.add_done_callback(run.calls.discard)
        elif op in ("done", "failed"):
            run = w.runs.pop(ep, None)  # type: ignore[arg-type]
            if run is not None and not run.done.done():
                if op == "done":
                    run.done.set_result(("done", msg["result"]))
                else:
                    if msg.get("traceback"):
                        log.debug("prompt %d: %s\n%s", run.prompt_id, msg["error"], msg["traceback"])
                    run.done.set_result(("failed", msg["error"]))
            if w.retiring and not w.runs and not w.dead:
                self._stop_retired(w)
        elif op in ("beat", "ack"):
            pass  # their "ack" field is read for every message
        elif op == "cancelled":
            ack = w.acks.get(ep)  # type: ignore[arg-type]
            if ack is not None and not ack.done():
                ack.set_result(True)
        else:
            log.warning("environment worker %d sent an unknown message %r; ignored", w.pid, op)

    async def _generate(self, w: _Worker, run: _Run, msg: dict) -> None:
        """One engine call of an episode, through its TurnEngine; the answer goes back to the worker."""
        answer: dict[str, Any] = {"op": "out", "ep": run.ep, "call": msg["call"]}
        try:
            out = await run.engine.generate(msg["token_ids"], SimpleNamespace(**msg["sp"]), **msg.get("kw", {}))
        except asyncio.CancelledError:
            raise
        except EpisodeError as e:
            answer["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - the worker raises it in the executor; the episode fails on it
            answer["error"] = f"{type(e).__name__}: {e}"
            answer["engine"] = run.engine.engine_error is not None
        else:
            o = out.outputs[0]
            toks = list(o.token_ids)
            answer.update(
                token_ids=toks,
                logprobs=[float(d[t].logprob) for t, d in zip(toks, o.logprobs, strict=True)],
                text=o.text or "",
                finish_reason=run.engine.turns[-1].finish_reason if run.engine.turns else "stop",
                cached=int(getattr(out, "num_cached_tokens", 0) or 0),
            )
        if w.runs.get(run.ep) is run:
            run.last_sent = w.send(answer)

    # ------------------------------------------------------------------ deaths
    def _kill(self, w: _Worker, why: str, *, suspects: str) -> None:
        if w.kill_reason is None:
            w.kill_reason = (why, suspects)
        if w.proc.poll() is None:
            w.proc.kill()  # the reader sees EOF and settles its episodes (_died)

    async def _died(self, w: _Worker) -> None:
        w.dead = True
        self._workers.discard(w)
        for _ in range(50):  # its exit status, for the log (EOF comes first)
            if w.proc.poll() is not None:
                break
            await asyncio.sleep(0.02)
        if w.kill_reason is not None:
            why, mode = w.kill_reason
        else:
            why, mode = _exit_text(w.proc.poll()), "crash"
            self.counters["env_worker_crashes"] += 1
        if w.proc.poll() is None:
            w.proc.kill()
        self.counters["env_worker_deaths"] += 1
        self._last_death = why
        runs = list(w.runs.values())
        w.runs.clear()
        # In environment code when it died: not inside an engine call. A blocked loop stops every
        # episode of the worker at once; the worker handles its messages in order, so the one in
        # environment code the longest is the one whose step blocked it (the others' answers wait
        # behind it, undelivered).
        # Not a suspect either: one whose last message the worker never read (its code was idle).
        suspects = [] if mode == "gone" else [r for r in runs if not r.engine.in_engine and w.delivered(r)]
        if mode == "blocked" and suspects:
            suspects = [max(suspects, key=lambda r: r.engine.environment_time())]
        rerun, lost = [], []
        for r in runs:
            for t in r.calls:
                t.cancel()
            if (r in suspects and r.suspected) or r.reruns >= MAX_RERUNS:
                r.done.set_result(
                    ("lost", f"its environment worker {why} ({r.reruns + 1} workers died under this episode)")
                )
            elif r in suspects and len(suspects) == 1:
                r.done.set_result(("lost", f"its environment worker {why} while this episode's environment code ran"))
            else:
                r.done.set_result(("rerun", r in suspects))
                rerun.append(r.prompt_id)
                continue
            lost.append(r.prompt_id)
        self.counters["env_episodes_rerun"] += len(rerun)
        self.counters["env_episodes_lost"] += len(lost)
        log.warning(
            "environment worker %d %s; episodes re-run (prompt ids) %s, failed %s; starting a fresh worker",
            w.pid,
            why,
            rerun,
            lost,
        )
        self._replace()

    def _replace(self) -> None:
        """Starts workers until the pool holds ``size`` that are live or starting."""
        if self._closed:
            return
        while self.live() + self._starting < self.size:
            self._starting += 1
            self._keep(self._start_one())

    async def _start_one(self) -> None:
        try:
            while not self._closed:
                try:
                    w = await self._spawn()
                except ValueError as e:
                    self.counters["env_worker_start_failures"] += 1
                    self._start_failures_in_a_row += 1
                    self._last_death = f"could not start: {e}"
                    backoff = min(30.0, 2.0 ** min(self._start_failures_in_a_row, 5))
                    log.error("an environment worker could not start (%s); trying again in %.0f s", e, backoff)
                    await asyncio.sleep(backoff)
                    continue
                self._start_failures_in_a_row = 0
                self._workers.add(w)
                async with self._changed:
                    self._changed.notify_all()
                return
        finally:
            self._starting -= 1

    async def _monitor(self) -> None:
        """Resident memory of every worker, every ``poll_s``; one past the limit is killed."""
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.memory_mb:
                continue
            for w in list(self._workers):
                mb = rss_mb(w.pid)
                if mb is not None and mb > self.memory_mb and not w.dead and w.kill_reason is None:
                    self.counters["env_worker_over_memory"] += 1
                    self._kill(
                        w,
                        f"was killed: it used {mb:.0f} MiB, over --agent_env_worker_memory_mb {self.memory_mb:g}",
                        suspects="crash",
                    )


class PooledAgent:
    """The episode seam's source (``episodes.EpisodeSource``) for an agent file run in a pool of
    environment workers: ``--agent_env_workers`` > 0."""

    def __init__(self, pool: EnvPool, identity: str, *, episode_timeout_s: float = 0.0) -> None:
        self.pool, self.identity, self.episode_timeout_s = pool, identity, episode_timeout_s

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def metrics(self) -> dict[str, float]:
        # the share of the pool that takes episodes: the server's heartbeat scales its capacity by it
        return {**self.pool.metrics(), "env_capacity_share": self.pool.live_share()}

    async def run(
        self, prompt_text: str, label: str | None, sampling_params: Any, engine: TurnEngine, step_timeout_s: float
    ) -> Episode:
        return await self.pool.run_episode(
            engine,
            prompt_id=engine.prompt_id,
            prompt_text=prompt_text,
            label=label,
            sampling_params=sampling_params,
            step_timeout_s=step_timeout_s,
            episode_timeout_s=self.episode_timeout_s,
        )
