"""The two halves that take turns on a colocated GPU: the learner's DeepSpeed states and the
rollout engines' memory. Used by ``learner.rl.schedules.colocated``.

- ``LearnerStates`` (every rank): ``--deepspeed_enable_sleep`` parks the optimizer states, fp32
  master weights and gradients of the trained engines (policy, critic) in pinned host memory
  (DeepSpeed ``offload_states``) while the engines generate, and brings them back
  (``reload_states``) to train. The bf16 weights stay: the weight push reads them.
- ``EngineMemory`` (rank 0): ``--vllm_enable_sleep`` sends every ready rollout server ``Sleep``
  after its samples are in and ``WakeUp`` before it must generate or take weights; it checks
  once that each server's memory share is the ``--vllm_gpu_memory_utilization`` the learner
  expects.

Where a flag cannot act (a CPU host: vLLM has no sleep mode there and DeepSpeed's states already
live in host memory; a one-rank fp32 learner running ZeRO as stage 0 has no ZeRO optimizer to
offload), ``CannotAct`` says so once per flag, ``--FLAG cannot act here: WHY``, and the run goes
on in lockstep. Measured figures and the reasons: docs/colocated.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from common import protocol as P

log = logging.getLogger("learner")

# vLLM sleep level of the colocated schedule. Level 1 copies the weights to host memory and
# back at every turn; level 2 drops them (vLLM keeps only its small buffers). Level 2 is right
# here because after every training phase the learner pushes EVERY parameter of the policy
# (the full HF state dict, tied aliases included) into the woken weights before any prompt is
# admitted, so nothing the engine dropped is ever read.
SLEEP_LEVEL = 2


class CannotAct:
    """``--FLAG cannot act here: WHY``, logged once per flag (the first reason wins)."""

    def __init__(self) -> None:
        self.said: dict[str, str] = {}

    def __call__(self, flag: str, why: str) -> None:
        if flag not in self.said:
            self.said[flag] = why
            log.warning("--%s cannot act here: %s", flag, why)


# --------------------------------------------------------------------------- the learner's half


def offload_unavailable(engine: Any, device: torch.device, *, adam_offload: bool) -> str | None:
    """Why ``engine``'s states cannot be offloaded on ``device`` (None: they can). Raises
    ValueError for a combination that would fail at the first offload (ZeRO-3 without FusedAdam)."""
    if device.type != "cuda":
        return (
            "the learner trains on CPU: its optimizer states already live in host memory, so offload_states "
            "would move them where they are and free nothing for the engines"
        )
    if adam_offload:
        return "--adam_offload already keeps the optimizer states in host memory"
    opt = getattr(engine, "optimizer", None)
    if not hasattr(opt, "offload_states"):
        return (
            "the learner runs without a ZeRO optimizer (ZeRO stage 0; one fp32 rank runs ZeRO-1/2 as stage 0, "
            "docs/performance.md), and DeepSpeed's offload_states needs one"
        )
    if engine.zero_optimization_stage() == 3:
        from deepspeed.ops.adam import FusedAdam

        if not isinstance(getattr(opt, "optimizer", None), FusedAdam):
            # DeepSpeed 0.19.8 asserts this at the first offload (measured: docs/colocated.md).
            raise ValueError(
                "--deepspeed_enable_sleep with --zero_stage 3: DeepSpeed offloads ZeRO-3 states only under its "
                "FusedAdam, and this learner builds torch AdamW; use --zero_stage 2 (offload works there)"
            )
    return None


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class LearnerStates:
    """Offload / reload of the trained engines' states, on every rank; a no-op when disabled or
    when it cannot act (said once through ``notes``)."""

    def __init__(
        self, engines: Sequence[Any], device: torch.device, *, enabled: bool, adam_offload: bool, notes: CannotAct
    ) -> None:
        self.engines: list[Any] = []
        self.offloaded = False
        if not enabled:
            return
        for e in engines:
            why = offload_unavailable(e, device, adam_offload=adam_offload)
            if why:
                notes("deepspeed_enable_sleep", why)
                return
        self.engines = list(engines)

    @property
    def active(self) -> bool:
        return bool(self.engines)

    def offload(self) -> None:
        if not self.engines or self.offloaded:
            return
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        # Everything but the bf16 weights (the push reads them): what docs/colocated.md measured.
        include = [
            OffloadStateTypeEnum.optim_states,
            OffloadStateTypeEnum.hp_params,
            OffloadStateTypeEnum.lp_grads,
            OffloadStateTypeEnum.contiguous_grad_buffer,
        ]
        for e in self.engines:
            e.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
        _synchronize()  # the engines may take the memory once this returns
        self.offloaded = True

    def reload(self) -> None:
        if not self.engines or not self.offloaded:
            return
        for e in self.engines:
            e.reload_states(non_blocking=True)
        _synchronize()
        self.offloaded = False


# --------------------------------------------------------------------------- the engines' half


class EngineMemory:
    """Rank 0's sleep / wake calls to the ready rollout servers (through the rollout client).

    ``rollout`` needs ``servers()``, ``peer(name)`` (with ``capabilities``) and ``request(name,
    msg)`` returning a pending call with ``result(timeout)``: ``RolloutClient``'s interface."""

    def __init__(
        self,
        rollout: Any,
        *,
        sleep: bool,
        gpu_memory_utilization: float | None,
        notes: CannotAct,
        timeout_s: float = 120.0,
        level: int = SLEEP_LEVEL,
    ) -> None:
        self.rollout = rollout
        self.enabled = sleep
        self.share = gpu_memory_utilization
        self.notes = notes
        self.timeout_s = timeout_s
        self.level = level
        self.cannot: set[str] = set()  # servers that answered not_supported: never asked again
        self.asleep: dict[str, str] = {}  # server -> "all" | "kv_cache" (what is still asleep)
        self._checked: set[str] = set()

    def check_servers(self) -> None:
        """Once per server: the memory share it announced against --vllm_gpu_memory_utilization,
        and whether it can sleep at all (its Hello says)."""
        for name in self.rollout.servers():
            if name in self._checked:
                continue
            self._checked.add(name)
            peer = self.rollout.peer(name)
            caps = peer.capabilities if peer is not None else None
            if not isinstance(caps, P.RolloutCapabilities):
                continue  # gone, or announced nothing: nothing to check
            if self.share is not None:
                if caps.platform == "cpu":
                    self.notes(
                        "vllm_gpu_memory_utilization",
                        f"{name} runs vLLM on CPU: no device memory is shared with the learner there (vLLM "
                        "reads the share as one of host memory, checked at engine start, and sizes its KV "
                        "cache from VLLM_CPU_KVCACHE_SPACE)",
                    )
                elif caps.gpu_memory_utilization is not None and abs(caps.gpu_memory_utilization - self.share) > 1e-6:
                    # vLLM sizes its memory once, at engine start: the learner cannot change it.
                    log.warning(
                        "%s was started with --gpu_memory_utilization %s, the learner expects "
                        "--vllm_gpu_memory_utilization %s: restart it with %s (launch.local passes it on)",
                        name,
                        caps.gpu_memory_utilization,
                        self.share,
                        self.share,
                    )

    def _call_all(self, make: Any, what: str, servers: list[str]) -> dict[str, BaseException]:
        """Sends ``make()`` to every server in ``servers`` at once, then collects the replies.
        Returns the failures other than not_supported (noted once and remembered) and a server
        found gone (the pool reaps it; its prompts are re-issued)."""
        from common.transport import PeerUnavailable, RemoteError, TransportError

        pending: list[tuple[str, Any]] = []
        failed: dict[str, BaseException] = {}
        for name in servers:
            try:
                pending.append((name, self.rollout.request(name, make())))
            except PeerUnavailable as e:  # gone: the pool reaps it and its prompts are re-issued
                log.info("%s not sent to %s: %s", what, name, e)
        for name, call in pending:
            try:
                call.result(self.timeout_s)
            except PeerUnavailable as e:
                log.info("%s: %s", what, e)
            except RemoteError as e:
                if e.error.code == "not_supported":
                    self.cannot.add(name)
                    self.notes("vllm_enable_sleep", f"{name}: {e.error.message}")
                else:
                    failed[name] = e
            except TransportError as e:
                failed[name] = e
        for name, err in failed.items():
            log.warning("%s to %s failed: %s", what, name, err)
        return failed

    def _targets(self) -> list[str]:
        return [s for s in self.rollout.servers() if s not in self.cannot] if self.enabled else []

    def sleep(self) -> None:
        """After the step's samples are in: every engine frees its weights and KV cache. Never
        raises (a server that did not sleep only keeps its memory; the log names it)."""
        targets = [s for s in self._targets() if s not in self.asleep]
        if not targets:
            return
        failed = self._call_all(lambda: P.Sleep(level=self.level), f"Sleep(level={self.level})", targets)
        for s in targets:
            if s not in failed and s not in self.cannot:
                self.asleep[s] = "all"

    def wake_weights(self) -> None:
        """Before a push: the engines' weights come back (level 2: allocated, to be filled by the
        push); their KV cache stays asleep while the learner may still hold memory."""
        targets = [s for s in self.rollout.servers() if self.asleep.get(s) == "all"]
        if not targets:
            return
        failed = self._call_all(lambda: P.WakeUp(tags=["weights"]), "WakeUp(weights)", targets)
        for s in targets:
            if s not in failed:
                self.asleep[s] = "kv_cache"

    def wake(self) -> None:
        """Before generating: everything still asleep wakes. Raises when a server cannot wake
        (it would hold its prompts until they time out)."""
        self.asleep = {s: v for s, v in self.asleep.items() if s in set(self.rollout.servers(ready_only=False))}
        targets = [s for s in self.rollout.servers() if s in self.asleep]
        if not targets:
            return
        failed = self._call_all(lambda: P.WakeUp(tags=None), "WakeUp", targets)
        for s in targets:
            if s not in failed:
                self.asleep.pop(s, None)
        if failed:
            raise RuntimeError(f"rollout server(s) could not wake up to generate: {sorted(failed)}")
