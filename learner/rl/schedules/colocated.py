"""Colocated (hybrid, ``--colocate_all_models``): lockstep with learner and engines on the same GPUs.

OpenRLHF's hybrid engine without Ray: the learner ranks and the rollout servers are started on
the same devices (``launch.local`` and ``launch/grpo_colocated.slurm`` place them) and take
turns. The schedule is lockstep's; ``ColocatedTurns`` are the turns it runs with (every
schedule runs with a ``Turns``, a no-op by default: ``base.py``). One step, in this order:

    wake the engines (weights and KV cache)          rank 0 -> servers: WakeUp
    generate and score the step's prompts            as lockstep
    the engines sleep                                rank 0 -> servers: Sleep(level 2)
    DeepSpeed reloads its states                     every rank: reload_states
    train                                            as lockstep
    DeepSpeed offloads optimizer states and grads    every rank: offload_states
    wake the engines' weights                        rank 0 -> servers: WakeUp(["weights"])
    push the weights                                 as lockstep; the KV cache wakes next step

``--vllm_enable_sleep`` drives the engine half, ``--deepspeed_enable_sleep`` the learner half
(``learner.rl.schedules.turns``); without them the order is lockstep's and both halves keep
their memory (the shares must then fit side by side: ``--vllm_gpu_memory_utilization``).
A step that trains nothing (too few samples) leaves the engines awake and the states parked.

Differences from OpenRLHF: one engine per server process, reached over the wire, instead of
Ray actors; where a half cannot act (CPU: vLLM has no sleep mode, DeepSpeed's states already
live in host memory) it says so once and the schedule runs as lockstep, which is how CI runs
it end to end. The weights still cross over the run's weight-sync backend (gloo on CPU); the
CUDA IPC hand-over between two processes of one GPU is the next step (docs/colocated.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from learner.rl.config import PPOConfig
from learner.rl.schedules.base import Turns
from learner.rl.schedules.turns import CannotAct, EngineMemory, LearnerStates

log = logging.getLogger("learner")


class ColocatedTurns(Turns):
    """The two halves the colocated schedule hands the GPU between."""

    name = "colocated"

    def __init__(self, learner: LearnerStates, engines: EngineMemory | None) -> None:
        self.learner = learner  # every rank
        self.engines = engines  # rank 0 only

    def start(self) -> None:
        # The engines are up and awake (they just loaded a model); the learner's states leave
        # before the first generation needs the memory.
        self.learner.offload()

    def started(self) -> None:
        if self.engines is not None:  # ready once the first push synced them
            self.engines.check_servers()

    def finish(self) -> None:
        if self.engines is not None:  # the engines end the run awake, as they started it
            self.engines.wake()

    @contextlib.contextmanager
    def states_resident(self) -> Iterator[None]:
        parked = self.learner.offloaded
        self.learner.reload()
        try:
            yield
        finally:
            if parked:
                self.learner.offload()

    def before_generate(self) -> None:
        assert self.engines is not None, "rank 0 only: it alone has the engines"
        self.engines.check_servers()  # joiners since the last step
        self.engines.wake()

    def after_generate(self) -> None:
        if self.engines is not None:
            self.engines.sleep()

    def before_train(self) -> None:
        self.learner.reload()

    def after_train(self) -> None:
        self.learner.offload()

    def before_push(self) -> None:
        if self.engines is not None:
            self.engines.wake_weights()


def make_turns(
    cfg: PPOConfig, engines: list[Any], device: torch.device, rollout: Any | None, notes: CannotAct | None = None
) -> ColocatedTurns:
    """``engines``: the trained DeepSpeed engines (policy, critic); ``rollout``: rank 0's
    RolloutClient (None on the other ranks). Raises ValueError for a combination that cannot
    work (ZeRO-3 offload without FusedAdam)."""
    notes = notes or CannotAct()
    learner = LearnerStates(engines, device, enabled=cfg.ds.enable_sleep, adam_offload=cfg.ds.adam_offload, notes=notes)
    memory = None
    if rollout is not None:
        memory = EngineMemory(
            rollout,
            sleep=cfg.vllm.enable_sleep,
            gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
            notes=notes,
            timeout_s=cfg.services.weight_sync_timeout_s,
        )
    return ColocatedTurns(learner, memory)


def check_colocated_push(cfg: PPOConfig) -> None:
    """Raises ValueError when --colocate_all_models would push weights over NCCL: a learner rank
    and an engine worker on one GPU cannot both join an NCCL group (NCCL refuses two ranks on one
    device). OpenRLHF hands them over by CUDA IPC there, which rayless does not have yet."""
    if not cfg.train.colocate_all:
        return
    from common.weights import resolve_backend

    if resolve_backend(cfg.vllm.sync_backend) == "nccl":
        raise ValueError(
            "--colocate_all_models: the learner and its engines share GPUs, and NCCL refuses two ranks on one "
            "GPU, so the weight push cannot use --vllm_sync_backend/--weight_sync_backend nccl (auto picks it on "
            "GPUs); the CUDA IPC hand-over meant for this is not built yet (docs/colocated.md). Pass "
            "--vllm_sync_backend gloo: weights then cross through host memory"
        )
