"""Fake rollout and reward services for the async data path's tests: threads speaking the real
protocol over real sockets, with generation time, held prompts and Abort under the test's control."""

from __future__ import annotations

import threading
import time

import torch

from common import protocol as P
from common.transport import Endpoint, handshake


class FakeRollout(threading.Thread):
    """Answers each prompt ``delay`` seconds after it arrives, stamped with the PromptBatch's
    policy version (what a real server's first token would carry); prompts for which
    ``hold(pid)`` is true are kept until aborted. Records what it saw and what was aborted."""

    def __init__(self, address: str, name: str = "r0", capacity: int = 64, delay: float = 0.0, hold=None) -> None:
        super().__init__(daemon=True)
        self.ep = Endpoint.connect(address, name=name)
        self.name, self.capacity, self.delay = name, capacity, delay
        self.hold = hold or (lambda pid: False)
        self.stop = threading.Event()
        self.seen: list[int] = []
        self.aborted: list[int] = []
        self.pending: dict[int, tuple[float, int, int]] = {}  # pid -> (due, n, version)

    def run(self) -> None:
        handshake(self.ep, "rollout", P.RolloutCapabilities(capacity=self.capacity), timeout=5)
        last_hb = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last_hb > 0.2:
                self.ep.send(P.Heartbeat(name=self.name))
                last_hb = now
            for pid, (due, n, version) in list(self.pending.items()):
                if due <= now and not self.hold(pid):
                    del self.pending[pid]
                    self._answer(pid, n, version)
            got = self.ep.recv(timeout=0.005)
            if got is None:
                continue
            msg = got[1]
            if isinstance(msg, P.PromptBatch):
                self.seen += msg.prompt_ids
                for pid in msg.prompt_ids:
                    self.pending[pid] = (time.monotonic() + self.delay, msg.sampling.n, msg.policy_version)
            elif isinstance(msg, P.Abort):
                self.aborted += msg.prompt_ids
                for pid in msg.prompt_ids:
                    self.pending.pop(pid, None)
            elif isinstance(msg, P.Shutdown):
                self.ep.reply(msg, P.Ack())
                break
        self.ep.close(0)

    def answer_now(self, pid: int, version: int, n: int = 2) -> None:
        """Sends ``pid``'s samples on the next turn, aborted or not: a SampleBatch that crossed
        an Abort on the wire."""
        self.pending[pid] = (0.0, n, version)

    def _answer(self, pid: int, n: int, version: int) -> None:
        ids = torch.tensor([[pid, i] for i in range(n)]).reshape(-1)
        self.ep.send(
            P.SampleBatch(
                prompt_ids=[pid] * n,
                sample_indices=list(range(n)),
                response_lengths=[2] * n,
                response_ids=ids,
                logprobs=torch.full((ids.numel(),), -0.5),
                finish_reasons=["stop"] * n,
                policy_versions=[version] * n,
                server=self.name,
            )
        )


class FakeReward(threading.Thread):
    """Reward = sample index (groups differ), except label "flat" (all 1.0: dynamic filtering
    drops it) and "poison" (scoring fails for the sample)."""

    def __init__(self, address: str, name: str = "w0") -> None:
        super().__init__(daemon=True)
        self.ep = Endpoint.connect(address, name=name)
        self.name = name
        self.stop = threading.Event()

    def run(self) -> None:
        handshake(self.ep, "reward", P.RewardCapabilities(capacity=8), timeout=5)
        last_hb = 0.0
        while not self.stop.is_set():
            if time.monotonic() - last_hb > 0.2:
                self.ep.send(P.Heartbeat(name=self.name))
                last_hb = time.monotonic()
            got = self.ep.recv(timeout=0.01)
            if got is None:
                continue
            msg = got[1]
            if isinstance(msg, P.ScoreRequest):
                s = msg.samples
                rewards = [
                    1.0 if lab == "flat" else float(i) for i, lab in zip(s.sample_indices, msg.labels, strict=True)
                ]
                self.ep.reply(
                    msg,
                    P.ScoredBatch(
                        prompt_ids=s.prompt_ids,
                        sample_indices=s.sample_indices,
                        rewards=torch.tensor(rewards),
                        failed=[("bad label" if lab == "poison" else None) for lab in msg.labels],
                        server=self.name,
                    ),
                )
            elif isinstance(msg, P.Shutdown):
                self.ep.reply(msg, P.Ack())
                break
        self.ep.close(0)
