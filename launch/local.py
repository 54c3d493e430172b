"""Every role of a run on this machine, supervised: ``python -m launch.local --config RUN.yaml``.

Starts ``rollout_servers`` rollout services, ``reward_services`` reward services and the learner
(``torchrun`` when ``learner_nproc > 1``), each writing its own log under ``RUN_DIR/logs/``.
Everything listens on 127.0.0.1 only: the controller, torch.distributed's rendezvous store and
the weight-transfer stores, gloo's connections (docs/security.md). Shows one progress line
(step, reward, tokens/s, time left) read from the learner's ``metrics.jsonl``. Stops
everything on Ctrl-C, when the learner finishes or dies, or when the last process of a service
kind dies — naming it and pointing at its log.
A rollout or reward process that dies while others of its kind run is reported and the run
goes on: the controller re-issues what it held. With ``--external_services`` only the learner
is started: it joins services that run already and leaves them running for the next one.

There is no magic here: the same run by hand is one command per role in its own terminal
(README, "The same run, by hand").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.agent_file import agent_argument
from common.config import ConfigError, flag, given, parse
from common.service import describe_exit
from common.transport import free_port
from common.vllm_spin import IDLE_SPIN_ENV
from learner.runtime.tracking import redact_argv

if TYPE_CHECKING:
    from learner.rl.config import PPOConfig
    from rollout_service.config import RolloutConfig

PHASES_IDLE_SPIN_S = 0.05  # the rollout workers' idle spin under --cpu_cores phases (docs/performance.md)


@dataclass
class LocalConfig:
    run_dir: str = flag("runs/local", "output folder: logs/, the learner's save_path and metrics")
    pretrain: str = flag("", "policy model path (passed to every role unless their args say otherwise)", required=True)
    rollout_servers: int = flag(1, "how many rollout_service processes")
    rollout_args: str = flag("", "extra flags for each rollout_service")
    reward_services: int = flag(1, "how many reward_service processes")
    reward_args: str = flag("", "extra flags for each reward_service (e.g. --reward_func FILE)")
    learner_nproc: int = flag(1, "learner ranks (torchrun --nproc_per_node when > 1)")
    learner_args: str = flag(
        "",
        "flags for learner.train_ppo (--prompt_data etc.); its --reward_pretrain, "
        "--ref_pretrain and --normalize_reward also configure the reward services",
    )
    port: int = flag(0, "controller port on 127.0.0.1 (0: pick a free one)")
    threads_per_process: int = flag(1, "OMP_NUM_THREADS of each process (CPU runs: cores / processes)")
    learner_threads: int = flag(
        0,
        "OMP_NUM_THREADS of each learner rank (0: --threads_per_process). In the "
        "lockstep schedule the learner trains while the services wait, so on a "
        "CPU host it may use the cores they idle on (--cpu_cores phases)",
    )
    cpu_cores: str = flag(
        "split",
        "CPU hosts: how the roles share the cores. 'phases': each phase of a step gets every core -- "
        "a lone rollout server's vLLM OpenMP threads bound to all of them, the learner's "
        "OMP_NUM_THREADS = cores / ranks (unless --learner_threads says otherwise), the vLLM worker's 1 s idle "
        "spin cut to 0.05 s (rollout_service --idle_spin_s); right for "
        "lockstep, where the roles take turns. 'split': the "
        "thread counts as given and vLLM's own binding (one core). auto: phases for lockstep on a CPU "
        "build of vLLM, split otherwise (async overlaps the roles; GPUs have their own devices). "
        "Variables already in the environment win. Default split: phases made SmolLM2's lockstep step "
        "faster (18.9 s against 22.5, generation 2.9 against 5.1), a tiny model's sub-second steps "
        "~5%% slower (docs/performance.md)",
        choices=("auto", "phases", "split"),
    )
    stop_timeout_s: float = flag(20.0, "how long roles get to exit after the run before they are killed")
    connect_timeout_s: float = flag(
        900.0, "how long services wait for the learner's controller to answer (it loads its model and DeepSpeed first)"
    )
    quiet: bool = flag(False, "no progress line (logs only)")
    auth: bool = flag(
        False,
        "ZeroMQ CURVE between the roles: keys made once in RUN_DIR/auth (python -m common.auth) and passed to "
        "every role as --auth_dir; peers without them are refused",
    )
    external_services: bool = flag(
        False,
        "the rollout and reward services run already (started by hand, by an earlier launch.local or by Slurm) "
        "and connect to --port: start only the learner, which waits for --rollout_servers and --reward_services "
        "of them and leaves them running when it finishes (learner --keep_services). Their flags are their own: "
        "--rollout_args, --reward_args and the learner's engine and reward flags do not reach them",
    )
    restart_learner: int = flag(
        0,
        "restart a learner that fails up to N times, from its newest checkpoint (--load_checkpoint; give the "
        "learner --save_steps), while the services stay up and rejoin it",
    )

    def __post_init__(self) -> None:
        if self.threads_per_process < 1:
            raise ValueError(f"--threads_per_process must be >= 1, got {self.threads_per_process}")
        if self.restart_learner < 0:
            raise ValueError(f"--restart_learner must be >= 0, got {self.restart_learner}")
        if self.external_services and not self.port:
            raise ValueError("--external_services needs --port: the port the running services connect to")
        if self.learner_threads < 0:
            raise ValueError(
                f"--learner_threads must be >= 1 (or 0: --threads_per_process), got {self.learner_threads}"
            )


@dataclass
class Role:
    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    kind: str = ""  # "rollout" | "reward" | "learner"
    finished: bool = False  # exited: 0 (the controller shut it down) is not a death, any other code is
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # on top of its kind's environment

    @property
    def process(self) -> subprocess.Popen:
        """``proc``, for a role already started (the launcher watches and stops only those)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self.proc


def learner_config(cfg: LocalConfig) -> PPOConfig:
    """The learner's flags (``--learner_args``, after the launcher's ``--pretrain``) parsed as
    ``learner.train_ppo`` will parse them: the services' flags are derived from it, so a
    ``--flag=value``, a ``--no-flag``, a ``--config`` file or a default reads as the learner reads
    it. Raises ConfigError naming a flag the learner would refuse, before anything starts."""
    from learner.rl.config import PPOConfig

    return parse(PPOConfig, ["--pretrain", cfg.pretrain, *shlex.split(cfg.learner_args)], raise_errors=True)


def build_roles(cfg: LocalConfig) -> list[Role]:
    run = Path(cfg.run_dir)
    logs = run / "logs"
    port = cfg.port or free_port()
    controller = f"tcp://127.0.0.1:{port}"
    py = sys.executable
    auth = ["--auth_dir", str(run / "auth")] if cfg.auth else []  # before the user's args: theirs win
    learner = learner_config(cfg)
    engine_extra = _rollout_flags_from_learner(learner)
    devices = _colocated_devices(cfg, learner)
    roles: list[Role] = []
    for i in range(0 if cfg.external_services else cfg.rollout_servers):
        roles.append(
            Role(
                f"rollout-{i}",
                [
                    py,
                    "-m",
                    "rollout_service",
                    "--model",
                    cfg.pretrain,
                    "--controller",
                    controller,
                    "--name",
                    f"rollout-{i}",
                    "--connect_timeout_s",
                    str(cfg.connect_timeout_s),
                    *engine_extra,
                    *auth,
                    *shlex.split(cfg.rollout_args),
                ],
                logs / f"rollout-{i}.log",
                kind="rollout",
                env=devices["rollout"][i] if devices else {},
            )
        )
    reward_extra = _reward_flags_from_learner(learner)
    if cfg.external_services and (engine_extra or reward_extra or cfg.rollout_args or cfg.reward_args):
        print(
            "note: --external_services: the running services keep their own flags; these do not reach them: "
            + shlex.join([*engine_extra, *reward_extra, *shlex.split(cfg.rollout_args), *shlex.split(cfg.reward_args)]),
            file=sys.stderr,
        )
    n_reward = cfg.reward_services
    if learner.train.agent_func_path and not learner.algo.kl.needed and not reward_extra and not cfg.reward_args:
        # The agent's rewards are the reward and no reference model is needed: a reward service
        # would have nothing to do (docs/agents.md).
        if n_reward and not cfg.external_services:
            print("note: --agent_func_path without KL: the agent scores its episodes, no reward service started")
        n_reward = 0 if not cfg.external_services else n_reward
    for i in range(0 if cfg.external_services else n_reward):
        roles.append(
            Role(
                f"reward-{i}",
                [
                    py,
                    "-m",
                    "reward_service",
                    "--controller",
                    controller,
                    "--name",
                    f"reward-{i}",
                    "--connect_timeout_s",
                    str(cfg.connect_timeout_s),
                    *reward_extra,
                    *auth,
                    *shlex.split(cfg.reward_args),
                ],
                logs / f"reward-{i}.log",
                kind="reward",
            )
        )
    # Where the run's files go, unless the learner's args say otherwise (in either spelling: the
    # learner refuses one flag given twice with two values, and OpenRLHF's scripts carry their own).
    theirs = given(type(learner), shlex.split(cfg.learner_args))
    outputs = {
        "ckpt.output_dir": ["--save_path", str(run / "model")],
        "logger.metrics_file": ["--metrics_file", str(run / "metrics.jsonl")],
        "logger.tensorboard_dir": ["--use_tensorboard", str(run / "tensorboard")],
    }
    learner_flags = [
        "--pretrain",
        cfg.pretrain,
        *[arg for path, flag in outputs.items() if path not in theirs for arg in flag],
        "--controller_bind",
        controller,
        "--min_rollout_servers",
        str(cfg.rollout_servers),
        "--min_reward_services",
        str(n_reward),
        *auth,
        *(["--keep_services"] if cfg.external_services else []),
        *shlex.split(cfg.learner_args),
    ]
    learner_env = dict(devices["learner"]) if devices else {}
    if cfg.learner_nproc > 1:
        cmd = [py, "-m", "torch.distributed.run", *_torchrun_loopback(cfg.learner_nproc), "-m", "learner.train_ppo"]
        cmd += learner_flags
        learner_env.update(TORCHRUN_LOOPBACK_ENV)
    else:
        cmd = [py, "-m", "learner.train_ppo", *learner_flags]
    roles.append(Role("learner", cmd, logs / "learner.log", kind="learner", env=learner_env))
    return roles


# torchrun's own stores (its rendezvous, and the one its agent shares with the ranks) listen on
# every interface, and it has no option to bind one (torch 2.13). One host needs neither: the
# rendezvous goes through a file (a FileStore in a fresh temporary file: no socket), the ranks
# are told MASTER_ADDR=127.0.0.1, and rank 0 hosts their store there itself
# (learner.runtime.engine._host_rendezvous_store) instead of sharing the agent's.
TORCHRUN_LOOPBACK_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun_loopback(nproc: int) -> list[str]:
    """torchrun's flags for ``nproc`` ranks on this host with nothing listening beyond loopback
    (with TORCHRUN_LOOPBACK_ENV): what ``--standalone`` does, less its TCP rendezvous store."""
    return [
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_conf=store_type=file",
        "--rdzv_id=launch-local",
        "--local_addr=127.0.0.1",
    ]


def loopback_env() -> dict[str, str]:
    """Every role's gloo connections (the learner ranks', vLLM's, the weight transfer's) on the
    loopback interface: gloo listens on the address its host name resolves to, which on most
    hosts is not loopback. What the user's environment sets wins."""
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def _rollout_flags_from_learner(learner: PPOConfig) -> list[str]:
    """OpenRLHF's trainer configures the vLLM engines it creates; here each rollout_service is
    started with its engine flags, so the learner's are passed on (the user's --rollout_args,
    after them, win). The sleep mode only with --colocate_all_models, as OpenRLHF."""
    out = []
    if learner.vllm.gpu_memory_utilization is not None:
        out += ["--gpu_memory_utilization", str(learner.vllm.gpu_memory_utilization)]
    if learner.vllm.tensor_parallel_size:
        out += ["--tensor_parallel_size", str(learner.vllm.tensor_parallel_size)]
    if learner.vllm.enforce_eager:
        out.append("--enforce_eager")
    if learner.train.colocate_all and learner.vllm.enable_sleep:
        out.append("--enable_sleep")
    if learner.train.agent_func_path:  # the episodes run in the rollout servers (docs/agents.md)
        out += ["--agent_func_path", agent_argument(learner.train.agent_func_path)]  # a file's abspath; gem:ID as is
        a = learner.agent
        if a.env_workers:  # the environments in worker processes beside each server (rollout_service/env_pool.py)
            out += ["--agent_env_workers", str(a.env_workers), "--agent_episode_timeout_s", str(a.episode_timeout_s)]
            out += ["--agent_env_worker_memory_mb", str(a.env_worker_memory_mb)]
        if learner.agent.tool_call_parser:  # an agent_func file's tool calls (rollout_service/openai_api.py)
            out += ["--tool_call_parser", learner.agent.tool_call_parser]
    if learner.ds.lora.rank and learner.services.lora_sync == "adapter":  # vLLM serves the learner's adapter
        out += ["--enable_lora", "--max_lora_rank", str(learner.ds.lora.rank)]
        if learner.train.async_enable:  # requests of every version within the bound run side by side
            out += ["--max_loras", str(learner.train.max_staleness + 1)]
    return out


def visible_gpus() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES entries: the variable's own list when it is set,
    else nvidia-smi's indices; empty on a host without GPUs. (No torch import: --help is fast.)"""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import shutil

    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _rollout_config(cfg: LocalConfig, learner: PPOConfig) -> RolloutConfig:
    """A rollout server's flags as it will parse them: the launcher's, the learner's engine
    flags, then the user's --rollout_args (which win)."""
    from rollout_service.config import RolloutConfig

    argv = ["--model", cfg.pretrain, "--controller", "tcp://127.0.0.1:0", *_rollout_flags_from_learner(learner)]
    return parse(RolloutConfig, [*argv, *shlex.split(cfg.rollout_args)], raise_errors=True)


def _colocated_devices(cfg: LocalConfig, learner: PPOConfig) -> dict | None:
    """--colocate_all_models on a GPU host: the learner ranks and the rollout servers on the same
    GPUs. The learner sees them all (rank r takes GPU r); rollout server i takes the next
    --tensor_parallel_size of them, so its engine shares those GPUs with the learner ranks
    there. None without colocation or GPUs (CPU: nothing to place)."""
    if not learner.train.colocate_all:
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    tp = _rollout_config(cfg, learner).tensor_parallel_size
    need = max(cfg.learner_nproc, cfg.rollout_servers * tp)
    if need > len(gpus):
        raise ValueError(
            f"--colocate_all_models: {cfg.learner_nproc} learner rank(s) and {cfg.rollout_servers} rollout server(s) "
            f"x TP {tp} need {need} GPUs, {len(gpus)} visible ({','.join(gpus)})"
        )
    if cfg.learner_nproc != cfg.rollout_servers * tp:
        print(
            f"note: --colocate_all_models with {cfg.learner_nproc} learner rank(s) on {cfg.rollout_servers} x {tp} "
            "engine GPUs: some GPUs hold only one of them",
            file=sys.stderr,
        )
    every = ",".join(gpus[:need])
    return {
        "learner": {"CUDA_VISIBLE_DEVICES": every},
        "rollout": [
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(cfg.rollout_servers)
        ],
    }


def _reward_flags_from_learner(learner: PPOConfig) -> list[str]:
    """OpenRLHF puts reward/reference model flags on the trainer; here a reward service serves
    them, so the learner's flags are passed on to it (one place to say it, as users expect)."""
    out = []
    if learner.reward.model_name_or_path:
        out += ["--reward_pretrain", learner.reward.model_name_or_path]
    if learner.reward.remote_url:
        out += ["--remote_rm_url", learner.reward.remote_url]
    if learner.ref.model_name_or_path or learner.algo.kl.needed:
        # reference log-probs at the sampling temperature
        out += [
            "--ref_pretrain",
            learner.ref.model_name_or_path or learner.actor.model_name_or_path,
            "--temperature",
            str(learner.rollout.temperature),
        ]
    if learner.teacher.model_name_or_path:
        # on-policy distillation: the teacher's log-probs at the sampling temperature, its
        # tokenizer checked against the policy's at the service's start-up too
        out += ["--teacher_pretrain", learner.teacher.model_name_or_path]
        out += ["--tokenizer", learner.actor.model_name_or_path]
        if learner.algo.distill.topk:  # top-k distillation: the teacher's top-K per position too
            out += ["--teacher_topk", str(learner.algo.distill.topk)]
        if "--temperature" not in out:
            out += ["--temperature", str(learner.rollout.temperature)]
    if learner.reward.model_name_or_path:  # a reward model's flags
        if learner.reward.normalize_enable:
            out.append("--normalize_reward")
        if learner.ds.value_head_prefix != "score":
            # Only a name the user gave: the service's own default (auto: the RM config's name,
            # then score, then value_head) finds what the learner's default would, and more.
            out += ["--value_head_prefix", learner.ds.value_head_prefix]
    if out and learner.train.dynamic_batch_enable:
        # the reference, teacher and reward-model forwards by the learner's no-grad token budget, as OpenRLHF's
        out += ["--max_tokens_per_gpu", str(learner.rollout.max_tokens_per_gpu)]
    return out


def phase_env(cfg: LocalConfig) -> dict[str, dict[str, str]]:
    """Environment for --cpu_cores phases, by role kind ("learner", "service"); empty for split.

    In lockstep the services wait while the learner trains and the learner waits while they
    generate, so each phase may use every core. vLLM's CPU worker binds its OpenMP threads to the
    cores VLLM_CPU_OMP_THREADS_BIND names (default: one core, the other reserved for its
    scheduler). Idle OpenMP threads need no help: libgomp's default spins briefly at a barrier
    and then sleeps. OMP_WAIT_POLICY=PASSIVE (sleep at once) made SmolLM2's training step 1.4x
    slower here (docs/performance.md), so it is left to the user's environment."""
    mode = cfg.cpu_cores
    if mode == "auto":
        mode = "phases" if _cpu_vllm() and not learner_config(cfg).train.async_enable else "split"
    if mode != "phases":
        return {}
    n = len(os.sched_getaffinity(0))
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    # vLLM's worker spins 1 s on a core after each generation, in the learner's phase: cut short
    # (rollout_service --idle_spin_s; tiny model's step 1.40 -> 0.42 s). Not for async: a worker
    # that sleeps between its steps more often sometimes misses a wake-up and waits 5 s.
    service = {IDLE_SPIN_ENV: os.environ.get(IDLE_SPIN_ENV, str(PHASES_IDLE_SPIN_S))}
    if cfg.rollout_servers == 1:  # several servers generate at once: vLLM's own binding then
        # What the user's environment sets wins (launch.local sets OMP_NUM_THREADS itself).
        service["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus)
    # learner ranks train at once: the cores are shared among them
    return {
        "learner": {"OMP_NUM_THREADS": str(cfg.learner_threads or max(1, n // cfg.learner_nproc))},
        "service": service,
    }


def _cpu_vllm() -> bool:
    """The installed vLLM is the CPU build (the rollout servers compute on this host's cores)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class Supervisor:
    def __init__(self, roles: list[Role], cfg: LocalConfig, metrics: Path | None = None) -> None:
        self.roles = roles
        self.cfg = cfg
        # the learner's metrics file (progress lines): the run folder's unless its args name another
        self.metrics = metrics or Path(cfg.run_dir) / "metrics.jsonl"
        self._metrics_pos = 0
        self._shown = -1
        self.last: dict = {}
        self._eval: tuple[int, float] | None = None  # (step, eval/accuracy) of the latest evaluation
        self.restarts = 0
        self._env: dict[str, dict[str, str]] = {}

    def start(self) -> None:
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(self.cfg.threads_per_process),
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            **loopback_env(),
        )
        learner_env = dict(env, OMP_NUM_THREADS=str(self.cfg.learner_threads or self.cfg.threads_per_process))
        self._env = {"learner": learner_env, "service": env}
        for kind, extra in phase_env(self.cfg).items():
            self._env[kind].update(extra)
        for r in self.roles:
            self._start(r, mode="w")

    def _start(self, r: Role, mode: str) -> None:
        r.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(r.log, mode)
        fh.write("$ " + shlex.join(redact_argv(r.cmd)) + "\n")  # a --use_wandb key stays out of the log
        fh.flush()
        # Own process group: Ctrl-C goes to us, and we stop each role (and its children,
        # e.g. vLLM's engine core) as a whole.
        r.proc = subprocess.Popen(
            r.cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**self._env["learner" if r.kind == "learner" else "service"], **r.env},
            start_new_session=True,
        )
        print(f"started {r.name} (pid {r.proc.pid}), log: {r.log}", flush=True)

    def restart_learner(self, learner: Role, code: int) -> None:
        """The learner failed: start it again from its newest checkpoint. The services outlive
        it (they reconnect for --reconnect_timeout_s) and the new learner pushes them the
        resumed weights before any prompt. Its log is appended to."""
        self.restarts += 1
        _signal_group(learner.process, signal.SIGKILL)  # torchrun's ranks, if any are left
        print(
            f"\nthe learner exited with code {code}; restarting it from its newest checkpoint "
            f"(restart {self.restarts} of {self.cfg.restart_learner}); log: {learner.log}",
            file=sys.stderr,
            flush=True,
        )
        if "--load_checkpoint" not in learner.cmd:
            learner.cmd = [*learner.cmd, "--load_checkpoint"]
        self._start(learner, mode="a")

    def watch(self) -> int:
        """Returns the run's exit code: the learner's, or 1 if every process of a service kind died."""
        learner = next(r for r in self.roles if r.name == "learner")
        while True:
            self._progress()
            for r in self.roles:
                code = r.process.poll()
                if code is None:
                    continue
                if r is learner:
                    if code != 0 and self.restarts < self.cfg.restart_learner:
                        self.restart_learner(learner, code)
                        continue
                    self._progress(final=True)
                    if code != 0:
                        print(f"\nthe learner exited with code {code}\n{_what_it_said(r.log)}", file=sys.stderr)
                    return code
                if code == 0:
                    if not r.finished:
                        print(f"\n{r.name} exited (code 0); log: {r.log}", flush=True)
                        r.finished = True
                    continue
                if r.finished:
                    continue
                r.finished = True
                # A service's death is survivable while others of its kind serve: the
                # controller re-issues what it held. The last one of a kind ends the run.
                # Any code but 0 is a death, a signal from outside the run included (the
                # services' exit codes: common/service.py).
                left = [o for o in self.roles if o.kind == r.kind and o.process.poll() is None]
                print(
                    f"\n{r.name} died (exit code {code}): {describe_exit(code)}\n{_what_it_said(r.log)}",
                    file=sys.stderr,
                )
                if not left:
                    print(f"no {r.kind} process is left: stopping the run", file=sys.stderr)
                    return 1
                print(f"{len(left)} other {r.kind} process(es) carry on; its work is re-issued", file=sys.stderr)
            time.sleep(1.0)

    def stop(self) -> None:
        """terminate -> wait with a deadline -> kill, every role's whole process group."""
        alive = [r for r in self.roles if r.proc is not None and r.proc.poll() is None]
        for r in alive:
            _signal_group(r.process, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for r in alive:
            try:
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{r.name} did not exit within {self.cfg.stop_timeout_s:.0f} s; killing it", file=sys.stderr)
                _signal_group(r.process, signal.SIGKILL)
                r.process.wait(timeout=10)
        for r in self.roles:  # stragglers of finished roles (engine cores, workers)
            if r.proc is not None:
                _signal_group(r.proc, signal.SIGKILL)

    def _progress(self, final: bool = False) -> None:
        if not self.metrics.exists():
            return
        if self.metrics.stat().st_size < self._metrics_pos:  # a resumed learner dropped what it redoes
            self._metrics_pos = 0
        with open(self.metrics) as fh:
            fh.seek(self._metrics_pos)
            for line in fh:
                if line.endswith("\n"):
                    self._metrics_pos += len(line.encode())
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    self.last.update(rec)
                    if "eval/accuracy" in rec:  # the latest evaluation, and the step it measured
                        self._eval = (rec["step"], rec["eval/accuracy"])
        if self.cfg.quiet or "step" not in self.last or (self.last["step"] == self._shown and not final):
            return
        self._shown = self.last["step"]
        m = self.last
        total = int(m.get("time/total_steps", 0)) or "?"
        line = (
            f"step {m['step']}/{total}  reward {m.get('rollout/reward', float('nan')):.3f}  "
            f"tokens/s {m.get('perf/rollout_tokens_per_s', 0):.0f}  "
            f"left {_fmt_s(m.get('time/eta_s', 0))}  re-issued {int(m.get('ledger/reissued', 0))}"
        )
        if self._eval is not None:
            line += f"  eval acc {self._eval[1]:.2f} (step {self._eval[0]})"
        print("\r" + line.ljust(100), end="\n" if final else "", flush=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s"


# Lines a process prints on its way out that say nothing about why it ended: nanobind (the
# binding library of triton and of parts of vLLM) lists the objects still alive when the
# interpreter exits, which after an error are the ones its traceback held, a page of them;
# multiprocessing's resource tracker counts what a killed child left behind. They come after
# the error and pushed it out of the tail a failed run shows.
EXIT_NOISE = re.compile(
    r"nanobind: leaked \d+ "
    r"| - leaked (instance|type|function|keep_alive) "
    r"|nanobind: this is likely caused by a reference counting issue"
    r"|See https://nanobind\.readthedocs\.io/.*refleaks"
    r"|resource_tracker: There appear to be \d+ leaked"
    r"|warnings\.warn\('resource_tracker: "
)
# torchrun's prefix on each line of a rank's output (the rank's own lines read the same without it)
RANK_PREFIX = re.compile(r"^\[(?:default|rank)?(\d+)\]:\s?")
# The line a traceback ends with: the exception's (dotted) type and its message, if any; e.g.
# ``learner.controller.ledger.LedgerError: prompt 3 ...``. Read only after a "Traceback" line,
# where it is the first line not indented (the frames are).
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?:: (.*))?$")
# Exceptions that only follow another's: torchrun's summary of a failed rank, and a rank that
# stopped because rank 0 (the controller) failed. The error to show is the one they follow.
SECONDARY_ERRORS = ("ChildFailedError", "StoppedByRank0")
ERROR_LINE_MAX = 600  # characters: one line, not a page (the log has it whole)


def _log_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def error_line(lines: list[str]) -> str | None:
    """The one line that says why a process failed, from its log: the last exception a
    traceback ended with (``Type: message``, the type without its module), or the learner's
    own one-line error (``learner: ...``, a RunError); rank 0's before another rank's, and an
    error that only follows another (``SECONDARY_ERRORS``) only when there is no other. None
    when the log has neither."""
    found: list[tuple[bool, str]] = []  # (from rank 0 or an unprefixed line, the line)
    in_traceback: set[str] = set()  # the ranks ("" unprefixed) whose traceback is being printed
    for raw in lines:
        prefix = RANK_PREFIX.match(raw)
        line = raw[prefix.end() :] if prefix else raw
        rank = prefix.group(1) if prefix else ""
        rank0 = rank in ("", "0")
        if EXIT_NOISE.search(line) or not line.strip():
            continue
        if line.startswith("Traceback (most recent call last):"):
            in_traceback.add(rank)
            continue
        if line.startswith("learner: "):  # learner.train_ppo.main's line for a RunError
            found.append((rank0, line))
            continue
        if rank in in_traceback and not line[0].isspace():
            m = EXCEPTION_LINE.match(line)
            if m:
                found.append((rank0, m.group(1) if m.group(2) is None else f"{m.group(1)}: {m.group(2)}"))
            in_traceback.discard(rank)
    if not found:
        return None
    primary = [f for f in found if not f[1].startswith(SECONDARY_ERRORS)] or found
    best = [f for f in primary if f[0]] or primary
    line = best[-1][1]
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 3] + "..."


def _tail(lines: list[str], n: int = 15) -> str:
    """The last ``n`` lines of a log without its exit noise (``EXIT_NOISE``), indented."""
    kept = [ln for ln in lines if not EXIT_NOISE.search(ln)]
    return "\n".join("    " + ln for ln in kept[-n:])


def _what_it_said(path: Path) -> str:
    """A failed process's error line first, then where its log is and the log's last lines."""
    lines = _log_lines(path)
    err = error_line(lines)
    head = f"error: {err}\n" if err else ""
    return f"{head}see its log: {path}; its last lines (exit noise left out):\n{_tail(lines)}"


def run(cfg: LocalConfig) -> int:
    try:
        roles = build_roles(cfg)
    except ConfigError as e:  # a flag the learner or a rollout server would refuse: said before anything starts
        raise SystemExit(f"launch.local: --learner_args / --rollout_args: {e}") from None
    except ValueError as e:
        raise SystemExit(f"launch.local: {e}") from None
    keys = Path(cfg.run_dir) / "auth"
    if cfg.auth and not (keys / "controller.key_secret").exists():
        from common.auth import keygen

        keygen(keys)
    metrics = learner_config(cfg).logger.metrics_file
    sup = Supervisor(roles, cfg, Path(metrics) if metrics else None)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "local_config.json").write_text(json.dumps(public_config(cfg), indent=1))
    sup.start()
    try:
        return sup.watch()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every role", file=sys.stderr)
        return 130
    finally:
        sup.stop()


def public_config(cfg: LocalConfig) -> dict:
    """The config as it may be written down: a wandb key in --learner_args is redacted."""
    out = dataclasses.asdict(cfg)
    out["learner_args"] = shlex.join(redact_argv(shlex.split(cfg.learner_args)))
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = parse(LocalConfig, argv, description=__doc__.split("\n\n")[0], prog="launch.local")
    logging.getLogger("launch").info("config LocalConfig %s", json.dumps(public_config(cfg), sort_keys=True))
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
