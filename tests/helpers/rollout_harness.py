"""Test/bench harness for rollout servers: real server subprocesses, a real controller side.

The controller is what the learner runs (``Endpoint`` + ``ServicePool`` + ``RolloutClient`` +
``WeightPublisher``); only the training loop is missing. Servers are
``python -m rollout_service`` subprocesses with their log in a file, so a failure shows the
server's own words. Every wait has a deadline and watches the children: a server that exits
while we wait raises with its log tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import protocol as P
from common.transport import Endpoint
from common.weights.publisher import WeightPublisher
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.weight_fleet import FleetWeights

REPO = Path(__file__).resolve().parents[2]
ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


class Server:
    def __init__(
        self, name: str, model_dir: str | Path, controller: str, log_dir: Path, *extra: str, env: dict | None = None
    ) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        args = [
            sys.executable,
            "-m",
            "rollout_service",
            "--model",
            str(model_dir),
            "--controller",
            controller,
            "--name",
            name,
            "--dtype",
            "float32",
            "--enforce_eager",
            "--max_model_len",
            "256",
            "--max_num_seqs",
            "8",
            "--heartbeat_s",
            "0.5",
            *extra,  # no --gpu_memory_utilization: the server's own default, as launchers start it
        ]
        self._log = open(self.log_path, "w")
        self.killed = False
        # Own process group: a kill takes vLLM's EngineCore and workers with it.
        self.proc = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # A None in ``env`` unsets that variable (e.g. VLLM_CPU_KVCACHE_SPACE: vLLM then checks the share).
            env={k: v for k, v in {**os.environ, **ENV, **(env or {})}.items() if v is not None},
            start_new_session=True,
        )

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None and not self.killed:
            raise RuntimeError(
                f"rollout server {self.name} exited with {self.proc.returncode}; "
                f"its log ({self.log_path}):\n{self.log_tail()}"
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.killed = True  # on purpose: check_alive no longer complains
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> None:
        """terminate -> wait with a deadline -> kill (the whole process group)."""
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Controller:
    """The learner's rank 0, minus training: endpoint, pool, client, publisher, the fleet's weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        peer_timeout_s: float = 30.0,
        weight_timeout_s: float = 60.0,
        bucket_bytes: int = 1 << 20,
        backend: str = "gloo",
        sync: str = "full",
    ) -> None:
        self.ep = Endpoint.bind("tcp://127.0.0.1:0")
        self.pool = ServicePool(self.ep, peer_timeout_s=peer_timeout_s)
        self.client = RolloutClient(self.ep, self.pool, call_timeout_s=weight_timeout_s)
        self.publisher = WeightPublisher(
            model,
            control=self.client,
            backend=backend,
            timeout_s=weight_timeout_s,
            bucket_bytes=bucket_bytes,
            sync=sync,
        )
        self.fleet = FleetWeights(self.pool, self.publisher)
        self.model = model
        self.servers: list[Server] = []
        self.results: dict[int, P.SampleBatch] = {}
        self.errors: list[P.Error] = []

    @property
    def address(self) -> str:
        return self.ep.address

    def start(self, name: str, log_dir: Path, *extra: str, env: dict | None = None) -> Server:
        s = Server(name, self.model.name_or_path, self.address, log_dir, *extra, env=env)
        self.servers.append(s)
        return s

    def check_servers(self, allow_dead: tuple[str, ...] = ()) -> None:
        for s in self.servers:
            if s.name not in allow_dead:
                s.check_alive()

    def pump(self, timeout: float = 0.1, allow_dead: tuple[str, ...] = ()) -> None:
        for _ident, msg in self.client.poll(timeout):
            if isinstance(msg, P.SampleBatch):
                for pid in set(msg.prompt_ids):
                    self.results[pid] = msg
            elif isinstance(msg, P.Error):
                self.errors.append(msg)
        self.check_servers(allow_dead)

    def wait_joined(self, names: list[str], timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        want = set(names)
        while not want <= set(self.client.servers(ready_only=True)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"servers {sorted(want - set(self.client.servers()))} did not join within {timeout:.0f} s"
                )
            self.pump(0.2)
            self.fleet.sync_joiners()

    def wait_results(self, prompt_ids, timeout: float = 120.0, allow_dead: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while not set(prompt_ids) <= set(self.results):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no samples for prompts {sorted(set(prompt_ids) - set(self.results))} within {timeout:.0f} s"
                )
            self.pump(0.1, allow_dead)

    def wait_until(self, cond, what: str, timeout: float = 60.0, allow_dead: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {timeout:.0f} s")
            self.pump(0.1, allow_dead)

    def close(self) -> None:
        for s in self.servers:  # all at once: each vLLM takes seconds to wind down
            s.kill(signal.SIGTERM)
        for s in self.servers:
            s.stop()
        self.publisher.close()
        self.ep.close(0)


def samples_of(batch: P.SampleBatch, prompt_id: int) -> list[dict]:
    """The samples of one prompt in a SampleBatch, as dicts."""
    toks, lps = batch.split_responses(), batch.split_logprobs() if batch.logprobs is not None else None
    out = []
    for i, pid in enumerate(batch.prompt_ids):
        if pid == prompt_id:
            out.append(
                {
                    "tokens": toks[i].tolist(),
                    "logprobs": lps[i].tolist() if lps is not None else None,
                    "finish": batch.finish_reasons[i],
                    "version": batch.policy_versions[i],
                    "index": batch.sample_indices[i],
                }
            )
    return sorted(out, key=lambda d: d["index"])


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation by full forward passes, and log p(token) of each generated token
    (log-softmax of the logits: what vLLM reports for greedy in processed mode)."""
    device = next(model.parameters()).device
    ids = list(prompt)
    toks, lps = [], []
    for _ in range(max_new):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()  # (V,)
        logp = torch.log_softmax(logits, -1)
        t = int(logits.argmax())
        toks.append(t)
        lps.append(float(logp[t]))
        ids.append(t)
        if t in stop:
            break
    return toks, lps


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[i] | prompt, response[:i]) under ``model``, one forward pass (the learner's view)."""
    ids = torch.tensor([list(prompt) + list(response)], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(ids).logits[0].float(), -1).cpu()  # (T, V)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)].tolist()


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """A new policy: every weight moved by a little noise (as an optimizer step would)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * p.std().clamp_min(1e-3))
