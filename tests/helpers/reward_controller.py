"""A fake controller for reward-service tests: binds a ROUTER, starts ``python -m
reward_service`` against it, answers its Hello, and kills it in ``stop()`` (tests call it in
teardown). Every wait has a deadline; a service that dies while starting fails the test
with its log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from common import protocol as P
from common.transport import Endpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class ServiceDied(AssertionError):
    pass


class FakeController:
    def __init__(self, log_dir: Path) -> None:
        self.ep = Endpoint.bind("tcp://127.0.0.1:0")
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "reward_service", "--controller", self.ep.address, "--name", name, *args],
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ENV},
            )
        self.procs.append(proc)
        return proc, log

    def start(self, name: str, *args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, P.Hello]:
        """Starts a service and completes its handshake."""
        proc, log = self.spawn(name, *args)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.ep.recv(timeout=0.5)
            if got is None:
                if proc.poll() is not None:
                    raise ServiceDied(f"{name} exited with {proc.returncode} while starting:\n{log.read_text()}")
                continue
            ident, msg = got
            if isinstance(msg, P.Hello) and msg.name == name:
                self.ep.set_peer_name(ident, name)
                self.ep.reply(msg, P.Welcome(peer_id=name), to=ident)
                return proc, msg
        raise ServiceDied(f"{name} sent no Hello within {timeout} s:\n{log.read_text()}")

    def recv_until(self, pred, timeout: float = 30.0):
        """Next message for which ``pred(msg)`` holds; others (heartbeats...) are skipped."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.ep.recv(timeout=left)
            if got is not None and pred(got[1]):
                return got[1]
        raise TimeoutError(f"no matching message within {timeout} s")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        self.ep.close(0)
