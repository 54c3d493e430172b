"""Stand-in rollout servers and reward services for fleet-scale runs of the real controller.

Used by ``bench/fleet.py`` (hundreds of stand-ins in a few processes) and
``tests/unit/controller/test_fleet_faults.py`` (dozens in threads). One ``StandInHost`` owns
many services on one thread, each with its own DEALER socket (``common.transport.Endpoint``)
to the controller, polled together; a heap of timers says when an answer or a heartbeat is due.

Faithful where the controller can tell the difference:

- the handshake: Hello with the capabilities a real server announces (``ServiceShell.say_hello``),
  Welcome; Hello again when the controller answers ``unknown_peer`` (it declared us dead);
- heartbeats at the real cadence (``ServiceShell.heartbeat``, every ``heartbeat_s``) carrying the
  stats keys of ``RolloutCore.metrics`` / ``Scorer.stats``;
- one SampleBatch per finished prompt, as ``rollout_service/server.py`` sends without
  ``--coalesce_ms``: ``n`` samples of ``tokens`` token ids (int32) and log-probs (float32), stamped
  with the PromptBatch's policy version; Abort drops prompts not yet answered;
- one ScoredBatch per ScoreRequest, as the reward service's ``Scorer``: rewards, scores, ``failed``
  and, with ``ref_logprobs``, one float32 reference log-prob per response token.
- Shutdown is acknowledged; a killed host closes its sockets without last words (SIGKILL).

Modelled: a prompt is answered ``gen_s`` (spread by ``gen_jitter``, fixed by its id:
``modelled_gen_s``) after it arrives whatever else is in flight (an engine running at the
capacity it announced: ``capacity x n / gen_s`` samples/s); a request is scored
``score_s`` after it arrives. The answers' tensors are built once and reused (zero-copy sends),
so a stand-in costs little more than its socket; with ``stamp`` each sample's first token is its
prompt id (a copy per answer) so that a test can check every sample reached its own prompt.

``raw=True`` is the baseline the bench compares with: the same message sizes through bare
DEALER sockets, frames encoded once, no protocol (``bench/fleet_relay.py`` drives them).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from common import protocol as P
from common.service import ServiceShell
from common.transport import Endpoint, PeerUnavailable, TransportError

log = logging.getLogger(__name__)

VOCAB = 32_000
RAW_HELLO = b"hello"  # a raw stand-in's first message: its identity is then known to the relay


@dataclass
class Shape:
    """What every stand-in of a host announces and answers with."""

    tokens: int = 1024  # T: response length of every sample
    gen_s: float = 0.0  # mean seconds from a prompt's arrival to its SampleBatch
    gen_jitter: float = 0.0  # a prompt's time is gen_s x (1 +- gen_jitter), fixed by its id
    score_s: float = 0.0  # seconds from a ScoreRequest's arrival to its ScoredBatch
    capacity: int = 64  # announced in Hello: prompts the controller may keep in flight here
    ref_logprobs: bool = True  # reward services return reference log-probs (a KL term)
    heartbeat_s: float = 2.0  # the services' default --heartbeat_s
    stamp: bool = False  # first token of each sample = its prompt id (for tests)
    group: int = 8  # n, for the raw stand-ins' answers, encoded once (the others read the PromptBatch's)


def modelled_gen_s(prompt_id: int, shape: Shape) -> float:
    """How long a stand-in takes to generate ``prompt_id``: ``gen_s`` spread over
    ``[1 - gen_jitter, 1 + gen_jitter]`` by a hash of the id (the same on both sides of the
    socket, so the controller's side can subtract it from the latency it measures)."""
    u = ((prompt_id * 2654435761) % 2**32) / 2**32  # Knuth's multiplicative hash, in [0, 1)
    return shape.gen_s * (1.0 + shape.gen_jitter * (2.0 * u - 1.0))


def rollout_capabilities(shape: Shape) -> P.RolloutCapabilities:
    """What ``RolloutCore.capabilities`` announces, for a CPU engine of the tiny model."""
    return P.RolloutCapabilities(
        capacity=shape.capacity,
        model="stand-in",
        tp=1,
        workers=1,
        dtype="bfloat16",
        weight_transfer_backend="gloo",
        idle_spin_s=0.0,
        sleep=False,
        gpu_memory_utilization=0.9,
        policy_version=0,
        platform="cpu",
    )


def reward_capabilities(shape: Shape) -> P.RewardCapabilities:
    sources = ["ref", "func"] if shape.ref_logprobs else ["func"]
    return P.RewardCapabilities(capacity=shape.capacity, sources=sources, ref_logprobs=shape.ref_logprobs, rewards=True)


def sample_arrays(n: int, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples of ``tokens`` token ids (int32) and log-probs (float32), flat: (n x T,)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, n * tokens, dtype=np.int32)
    lps = -rng.random(n * tokens, dtype=np.float32)
    return ids, lps


def sample_batch(pids: list[int], n: int, tokens: int, ids, lps, version: int, server: str) -> P.SampleBatch:
    """One SampleBatch: ``n`` samples of each prompt in ``pids``, as the rollout server builds it."""
    return P.SampleBatch(
        prompt_ids=[p for p in pids for _ in range(n)],
        sample_indices=[i for _ in pids for i in range(n)],
        response_lengths=[tokens] * (n * len(pids)),
        response_ids=ids,
        logprobs=lps,
        finish_reasons=["length"] * (n * len(pids)),
        policy_versions=[version] * (n * len(pids)),
        server=server,
    )


def scored_batch(samples: P.SampleBatch, ref: np.ndarray | None, server: str) -> P.ScoredBatch:
    """The ScoredBatch a Scorer returns for ``samples``: reward = sample index (groups differ)."""
    n = len(samples)
    rewards = np.asarray(samples.sample_indices, dtype=np.float32)
    total = sum(samples.response_lengths)
    return P.ScoredBatch(
        prompt_ids=list(samples.prompt_ids),
        sample_indices=list(samples.sample_indices),
        rewards=rewards,
        ref_logprobs=ref[:total] if ref is not None else None,  # a view: sent without a copy
        failed=[None] * n,
        scores=rewards,
        server=server,
    )


class _Service:
    """One stand-in: its endpoint, its shell (handshake, heartbeat cadence), its work."""

    def __init__(self, host: StandInHost, role: str, name: str) -> None:
        self.host, self.role, self.name = host, role, name
        self.ep = Endpoint.connect(host.address, name=name, context=host.ctx)
        self.shell = ServiceShell(
            role,
            name,
            host.address,
            heartbeat_s=host.shape.heartbeat_s,
            connect_timeout_s=host.connect_timeout_s,
        )
        self.caps = rollout_capabilities(host.shape) if role == "rollout" else reward_capabilities(host.shape)
        self.pending: dict[int, tuple[int, int]] = {}  # rollout: prompt id -> (n, version), until answered
        self.version = 0
        self.session = 0  # bumped by a Welcome after Hello again: older work is dropped
        self.closed = False
        self.stats = {"prompts": 0, "samples": 0, "aborted_by_controller": 0, "requests": 0}

    def heartbeat_stats(self) -> dict[str, float]:
        s = self.stats
        if self.role == "rollout":
            return {
                "in_flight": float(len(self.pending)),
                "waiting": 0.0,
                "tokens_per_s": 0.0,
                "generated_tokens": float(s["samples"] * self.host.shape.tokens),
                "policy_version": float(self.version),
                "prompts": float(s["prompts"]),
                "samples": float(s["samples"]),
                "aborted": 0.0,
                "updates": 0.0,
                "failed_updates": 0.0,
                "samples_across_updates": 0.0,
                "aborted_by_controller": float(s["aborted_by_controller"]),
            }
        return {"requests": float(s["requests"]), "samples": float(s["samples"]), "samples_failed": 0.0}

    def send(self, msg: P.Message) -> None:
        try:
            self.ep.send(msg)
        except PeerUnavailable as e:  # the controller is gone (end of a run): stop quietly
            log.debug("%s: %s", self.name, e)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.ep.close(0)

    # ------------------------------------------------------------------ messages
    def on_message(self, msg: P.Message) -> None:
        h = self.host
        if isinstance(msg, P.PromptBatch):
            now = time.monotonic()
            for pid in msg.prompt_ids:
                self.pending[pid] = (msg.sampling.n, msg.policy_version)
                h.at(now + modelled_gen_s(pid, h.shape), self._answer_prompt, pid, self.session)
            self.version = max(self.version, msg.policy_version)
        elif isinstance(msg, P.ScoreRequest):
            h.at(time.monotonic() + h.shape.score_s, self._answer_score, msg, self.session)
        elif isinstance(msg, P.Abort):
            for pid in msg.prompt_ids:
                if self.pending.pop(pid, None) is not None:
                    self.stats["aborted_by_controller"] += 1
        elif isinstance(msg, P.Shutdown):
            self.ep.reply(msg, P.Ack())
            self.close()
        elif isinstance(msg, P.Error) and msg.code == "unknown_peer":
            hello = self.shell.hello_again(self.caps, self.ep.core.new_call_id())
            if hello is not None:
                self.send(hello)
        elif isinstance(msg, P.Welcome):
            if self.shell.welcomed_again(msg):
                self.session += 1
                self.pending.clear()
        else:
            log.warning("%s: ignoring %s", self.name, type(msg).__name__)

    def _answer_prompt(self, pid: int, session: int) -> None:
        got = self.pending.pop(pid, None)
        if got is None or session != self.session or self.closed:
            return  # aborted, or taken in a session the controller forgot
        n, version = got
        ids, lps = self.host.arrays(n)
        if self.host.shape.stamp:
            ids = ids.copy()
            ids[:: self.host.shape.tokens] = pid % VOCAB
        self.send(sample_batch([pid], n, self.host.shape.tokens, ids, lps, version, self.name))
        self.stats["prompts"] += 1
        self.stats["samples"] += n

    def _answer_score(self, req: P.ScoreRequest, session: int) -> None:
        if session != self.session or self.closed:
            return
        samples = req.samples
        ref = self.host.ref(sum(samples.response_lengths)) if self.host.shape.ref_logprobs else None
        scored = scored_batch(samples, ref, self.name)
        scored.call_id = req.call_id
        self.send(scored)
        self.stats["requests"] += 1
        self.stats["samples"] += len(req.samples)

    def beat(self) -> None:
        if self.closed:
            return
        if not self.shell.lost:
            self.send(self.shell.heartbeat(self.heartbeat_stats(), self.version))
        self.host.at(time.monotonic() + self.shell.heartbeat_s, self.beat)


class _RawService:
    """A bare DEALER: answers every message with frames encoded once (the raw baseline)."""

    def __init__(self, host: StandInHost, role: str, name: str) -> None:
        self.host, self.role, self.name = host, role, name
        self.sock = host.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(host.address)
        self.sock.send(RAW_HELLO)
        self.closed = False
        self.stats = {"prompts": 0, "samples": 0, "requests": 0}
        self.answer = host.raw_answer(role)

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            delay = self.host.shape.gen_s if self.role == "rollout" else self.host.shape.score_s
            self.host.at(time.monotonic() + delay, self._reply)

    def _reply(self) -> None:
        if self.closed:
            return
        self.sock.send_multipart(self.answer, copy=False)
        self.stats["prompts" if self.role == "rollout" else "requests"] += 1
        self.stats["samples"] += self.host.shape.group

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(0)


class StandInHost:
    """Many stand-ins of one role on the calling thread: ``run(stop)`` serves until ``stop()``.

    Build and run it on the same thread (its sockets belong to it). ``kill()`` (from any thread)
    makes the loop close every socket at once, without last words: a node lost."""

    def __init__(
        self,
        address: str,
        role: str,
        names: list[str],
        shape: Shape,
        *,
        raw: bool = False,
        connect_timeout_s: float = 60.0,
    ) -> None:
        if role not in ("rollout", "reward"):
            raise ValueError(f"role must be rollout or reward, got {role!r}")
        self.address, self.role, self.names, self.shape, self.raw = address, role, names, shape, raw
        self.connect_timeout_s = connect_timeout_s
        self.ctx = zmq.Context()  # one per host: its own IO thread, as a separate server would have
        self._timers: list = []
        self._seq = itertools.count()
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ref = np.zeros(0, dtype=np.float32)
        self._killed = threading.Event()
        self.services: list = []
        self.ready = threading.Event()  # every stand-in was welcomed (raw: connected)
        self.cpu_s = 0.0  # this thread's CPU time while serving
        self.process_cpu_s = 0.0

    # ------------------------------------------------------------------ helpers for the services
    def at(self, due: float, fn: Callable, *args) -> None:
        heapq.heappush(self._timers, (due, next(self._seq), fn, args))

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._arrays.get(n)
        if got is None:
            got = self._arrays[n] = sample_arrays(n, self.shape.tokens)
        return got

    def ref(self, total: int) -> np.ndarray:
        """At least ``total`` reference log-probs (float32), built once and grown when asked for more."""
        if self._ref.size < total:
            self._ref = sample_arrays(1, max(total, 2 * self._ref.size), seed=1)[1]
        return self._ref

    def raw_answer(self, role: str) -> list[bytes]:
        """Frames of the answer a protocol stand-in would send for one prompt (or request)."""
        codec = P.Codec()
        ids, lps = self.arrays(self.shape.group)
        samples = sample_batch([0], self.shape.group, self.shape.tokens, ids, lps, 0, "raw")
        ref = self.ref(len(ids)) if self.shape.ref_logprobs else None
        msg = samples if role == "rollout" else scored_batch(samples, ref, "raw")
        return [bytes(memoryview(f)) for f in codec.encode(msg)]

    def kill(self) -> None:
        self._killed.set()

    # ------------------------------------------------------------------ the loop
    def run(self, stop: Callable[[], bool]) -> dict[str, float]:
        """Connects and welcomes every stand-in, then serves until ``stop()`` or ``kill()``;
        returns totals (prompts, samples, requests, cpu_s)."""
        import torch  # noqa: F401 - the codec imports it at the first tensor: not on the clock

        make = _RawService if self.raw else _Service
        self.services = [make(self, self.role, name) for name in self.names]
        if not self.raw:
            for s in self.services:  # sockets connect in the background meanwhile
                welcome = s.shell.say_hello(s.ep, s.caps)
                s.version = welcome.policy_version
                s.beat()
        self.ready.set()
        poller = zmq.Poller()
        by_sock = {}
        for s in self.services:
            sock = s.sock if self.raw else s.ep.sock
            poller.register(sock, zmq.POLLIN)
            by_sock[sock] = s
        t0, p0 = time.thread_time(), time.process_time()
        try:
            while not stop() and not self._killed.is_set():
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    _, _, fn, args = heapq.heappop(self._timers)
                    fn(*args)
                wait = 0.05 if not self._timers else min(0.05, max(0.0, self._timers[0][0] - time.monotonic()))
                for sock, _ in poller.poll(wait * 1000):
                    s = by_sock[sock]
                    if s.closed:
                        poller.unregister(sock)
                        continue
                    if self.raw:
                        s.drain()
                        continue
                    while not s.closed and (got := s.ep.recv(timeout=0)) is not None:
                        s.on_message(got[1])
        except TransportError as e:
            log.warning("stand-in host %s stopped: %s", self.names[0] if self.names else "?", e)
        finally:
            self.cpu_s = time.thread_time() - t0
            self.process_cpu_s = time.process_time() - p0  # with its ZMQ IO thread (alone in a process)
            for s in self.services:
                s.close()
            self.ctx.term()
        return self.totals()

    def totals(self) -> dict[str, float]:
        out = {"prompts": 0.0, "samples": 0.0, "requests": 0.0}
        for s in self.services:
            for k in out:
                out[k] += s.stats.get(k, 0)
        out["cpu_s"] = self.cpu_s
        out["process_cpu_s"] = self.process_cpu_s
        return out


class StandInThread(threading.Thread):
    """A ``StandInHost`` on its own thread, for in-process tests: ``stop()`` ends it cleanly,
    ``kill()`` drops every socket at once (no last words)."""

    def __init__(self, address: str, role: str, names: list[str], shape: Shape) -> None:
        super().__init__(daemon=True, name=f"stand-ins-{names[0] if names else role}")
        self.args = (address, role, names, shape)
        self._stop_evt = threading.Event()
        self.host: StandInHost | None = None
        self.totals: dict[str, float] = {}
        self.error: BaseException | None = None
        self._built = threading.Event()

    def run(self) -> None:
        try:
            self.host = StandInHost(*self.args)
            self._built.set()
            self.totals = self.host.run(self._stop_evt.is_set)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self._built.set()

    def wait_ready(self, timeout: float) -> None:
        self._built.wait(timeout)
        if self.host is None or not self.host.ready.wait(timeout):
            raise TimeoutError(f"{self.name}: stand-ins not welcomed within {timeout} s ({self.error!r})")

    def kill(self) -> None:
        self._built.wait(10)
        if self.host is not None:
            self.host.kill()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop_evt.set()
        self.join(timeout)


def serve_host(
    address: str, role: str, names: list[str], shape: Shape, raw: bool, stop, out, profile: str = ""
) -> None:
    """A process's body (``multiprocessing`` target): one ``StandInHost`` on its main thread
    until ``stop`` (an Event) is set; then its totals go to ``out`` as ``(role, totals)``.
    ``profile``: write a cProfile of the host there."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host = StandInHost(address, role, names, shape, raw=raw)
    if not profile:
        out.put((role, host.run(stop.is_set)))
        return
    import cProfile

    prof = cProfile.Profile(time.thread_time)
    totals = prof.runcall(host.run, stop.is_set)
    prof.dump_stats(profile)
    out.put((role, totals))
