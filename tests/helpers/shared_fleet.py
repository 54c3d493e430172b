"""Two rollout servers and one reward service for the whole test session, that e2e runs join.

Starting vLLM is most of an e2e run's cost on 2 CPU cores (~35 s of a ~60-90 s run), and most
runs need nothing of a fleet but that it serves: they differ in the learner's flags. So those
runs share one fleet, the way a user shares one between successive learners: the services are
started once, with a long ``--reconnect_timeout_s``, outside any run; each run is
``launch.local --external_services`` (only the learner starts; it binds the fleet's port,
pushes its own weights to the servers before any prompt, and at the end leaves them running:
``--keep_services``). Between runs the services wait for the next learner, as they wait for a
restarted one.

A test may kill one of the fleet's rollout servers (``kill``: the fault tests, marked
``breaks_fleet`` so that they run after every other user of the fleet); the next test that
asks for the fleet finds it dead and starts it again. What a fleet of its own is still for: a
test that checks every process of a run (listening sockets, CURVE keys, the Shutdown at the
end), counts joiners, or needs other service flags. docs/testing.md has the list. (Other reward
flags alone need no fleet: ``use_reward`` swaps the reward service, a few seconds, no engine.)

The fleet's services run the tests' defaults: ``TINY_ROLLOUT_ARGS`` with the e2e agent file
(``AGENT_EXAMPLE``) and LoRA serving (``--enable_lora``), and the first-char-parity reward function, on the session's tiny model. A service found dead when a run asks for the
fleet (a previous run broke it) is started again, and the run is told, so one failure does not
fail every later test.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.net import free_port
from helpers.e2e_launch import AGENT_EXAMPLE, PARITY_REWARD, TINY_ROLLOUT_ARGS, cpu_env
from launch.local import loopback_env

WAIT_S = 3600.0  # how long the services wait for the next learner (the whole session)
ROLLOUTS = ("rollout-0", "rollout-1")
SERVICES = (*ROLLOUTS, "reward-0")


class SharedFleet:
    def __init__(self, model: Path, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.port = free_port()
        self.controller = f"tcp://127.0.0.1:{self.port}"
        # With an agent file: a learner that asks for agent episodes (--agent_func_path, the same
        # file) gets them; the others send plain prompts, served as always. With LoRA serving: a
        # learner pushing its adapter (--lora_sync adapter, rank <= 8) has it served; the others
        # push whole weights and are served without one.
        # Idle spin 0.05 s, as launch.local's lockstep runs on a CPU host have it (--cpu_cores
        # phases): vLLM's own, 1 s of sched_yield on a core after every generation, would run
        # through each lockstep run's training phase, taken from its learner and the other worker's test.
        self.rollout_args = (
            f"{TINY_ROLLOUT_ARGS} --agent_func_path {AGENT_EXAMPLE} --enable_lora --max_lora_rank 8 --idle_spin_s 0.05"
        )
        self.reward_args = PARITY_REWARD
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts = 0  # service processes started: 3 for a session in which nothing was killed

    def _cmd(self, name: str) -> list[str]:
        common = ["--controller", self.controller, "--name", name]
        common += ["--connect_timeout_s", str(WAIT_S), "--reconnect_timeout_s", str(WAIT_S)]
        if name.startswith("rollout"):
            model = ["--model", str(self.model)]
            return [sys.executable, "-m", "rollout_service", *model, *common, *shlex.split(self.rollout_args)]
        return [sys.executable, "-m", "reward_service", *common, *shlex.split(self.reward_args)]

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def _start(self, name: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "a") as f:
            f.write("$ " + shlex.join(self._cmd(name)) + "\n")
            f.flush()
            self.procs[name] = subprocess.Popen(
                self._cmd(name),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=dict(cpu_env(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"), **loopback_env()),
                start_new_session=True,
            )
        self.starts += 1

    def ensure(self) -> list[str]:
        """Starts what is not running (all of it, the first time); returns the names of services
        that had died since the last call (empty when the fleet was intact)."""
        died = []
        for name in SERVICES:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                continue
            if proc is not None:
                died.append(f"{name} (exit code {proc.returncode}; log {self.log(name)})")
            self._start(name)
        return died

    def launcher_flags(self) -> list[str]:
        """``launch.local`` flags of a run that joins this fleet."""
        n = str(len(ROLLOUTS))
        return ["--external_services", "--port", str(self.port), "--rollout_servers", n, "--reward_services", "1"]

    def kill(self, name: str) -> None:
        """SIGKILLs a service's whole process group (vLLM's engine core too), as a crash would."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)

    def log_mark(self, name: str = "rollout-0") -> int:
        """Where a service's log ends now: what a run wrote is what follows (``log_since``)."""
        return self.log(name).stat().st_size if self.log(name).exists() else 0

    def log_since(self, mark: int, name: str = "rollout-0") -> str:
        with open(self.log(name), "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def use_reward(self, args: str) -> None:
        """Runs the reward service with ``args`` from now on (restarted if it runs other flags):
        for runs whose reward sources are not the fleet's (a reference model for KL, a reward
        model), which keep the rollout servers and swap only this cheap process
        (tests/e2e/test_openrlhf_examples.py). They put ``PARITY_REWARD`` back when done;
        ``local_cmd`` refuses a run that expects flags other than those it runs."""
        proc = self.procs.get("reward-0")
        if args == self.reward_args and proc is not None and proc.poll() is None:
            return
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        self.reward_args = args
        self._start("reward-0")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: vLLM's engine core, stragglers
            except ProcessLookupError:
                pass
