"""The memory share a vLLM engine is started with (``gpu_memory_utilization``), and vLLM-CPU's
start-up check of it, mirrored so that a refusal is one line naming the flag.

Both services that run vLLM use it: the rollout server (``--gpu_memory_utilization``) and the
reward service's reference engine (``--ref_backend vllm``, ``--ref_gpu_memory_utilization``).
A share given on the command line is used as given. Without one:

- on a GPU the share is of the device's memory and sizes the KV cache: each service keeps its
  own default (rollout 0.85, reference 0.9);
- on CPU the share is of a NUMA node's memory, and vLLM 0.32's ``CPUWorker``
  (``vllm/v1/worker/cpu_worker.py``) reads it in one of two ways:
  - ``VLLM_CPU_KVCACHE_SPACE`` set (whole GiB; the Makefile, the tests and the benches set 1): the
    KV cache is that size, the share is not used, and nothing is checked at start-up beyond
    the KV cache fitting the node's free memory once the weights are loaded;
  - unset: the worker refuses to start unless ``ceil(share * node total)`` bytes of the node
    are free, and once the model is loaded gives the KV cache ``share * total - its RSS``.
  The node is that of the worker's first allowed core (which it inherits from this process),
  its memory what ``vllm.utils.cpu_resource_utils.get_memory_node_info`` reads: ``MemFree +
  Active(file) + Inactive(file) + SReclaimable`` of ``/sys/devices/system/node/nodeN/meminfo``,
  both numbers clamped by a cgroup memory limit. A GPU-style 0.85 asks for 10.8 of a 12.7 GiB
  node to be free at once -- untrue as soon as a second server, the learner or the page cache
  of earlier runs holds some -- and would hand nearly all of it to a KV cache a small model
  cannot fill. So the CPU default is what the engine needs, as a share of the node, rounded
  up to the hundredth: the weights (the checkpoint's files) + the KV cache
  (``VLLM_CPU_KVCACHE_SPACE``, else ``DEFAULT_CPU_KV_BYTES``) + ``RUNTIME_BYTES`` for the
  worker's own memory (torch, vLLM, activations).

``check_start`` runs vLLM's start-up check before the engine is started, with vLLM's own
reading of the node, and raises ``EngineStartRefused`` with the numbers, the flag, and a share
that would start (or why none would). A service logs that line and exits ``NO_START``: the
same start would fail the same way, so it is not retried. ``start_refusal`` is the same check
after a failed start: memory that changed between the two readings is caught there.

Imports nothing heavy at module level; vLLM is imported when a node is read.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_CPU_KV_BYTES",
    "GIB",
    "KV_SPACE_ENV",
    "RUNTIME_BYTES",
    "EngineNeed",
    "EngineStartRefused",
    "NodeMemory",
    "check_start",
    "choose_share",
    "engine_need",
    "kv_space_bytes",
    "node_memory",
    "refusal",
    "share_of",
    "start_refusal",
    "weights_bytes",
]

log = logging.getLogger(__name__)

GIB = 1 << 30
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The KV cache asked for when VLLM_CPU_KVCACHE_SPACE is unset: what the Makefile, the tests and
# the benches run with, which serves the tiny model and SmolLM2 at their default batch sizes.
DEFAULT_CPU_KV_BYTES = 1 * GIB
# A CPU worker's own memory besides weights and KV cache: vLLM reported 0.61 GiB (eager) and
# 0.68 GiB (torch.compile) "consumed by non-kv usages" for the tiny model
# (docs/real-stack-notes.md); rounded up: what is left over goes to the KV cache.
RUNTIME_BYTES = 1 * GIB
# Files vLLM loads weights from; safetensors first, as vLLM does when a folder holds both.
_WEIGHT_SUFFIXES = ((".safetensors",), (".bin", ".pt", ".pth"))


class EngineStartRefused(RuntimeError):
    """vLLM cannot start with these settings on this host, and trying again will not change
    that. The message is one line naming the flag; a service logs it and exits NO_START."""


@dataclass(frozen=True)
class NodeMemory:
    """A NUMA node's memory as vLLM's CPU worker reads it (bytes)."""

    node: int
    total: int
    available: int


@dataclass(frozen=True)
class EngineNeed:
    """What a CPU engine holds (bytes): its weights, its KV cache, its own runtime."""

    weights: int
    kv: int
    kv_from: str  # where the KV size comes from, for the log line
    runtime: int = RUNTIME_BYTES
    weights_known: bool = True  # False: no local files to measure, counted as 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.runtime

    def __str__(self) -> str:
        return (
            f"weights {_gib(self.weights)} + KV cache {_gib(self.kv)} ({self.kv_from}) + "
            f"runtime {_gib(self.runtime)} = {_gib(self.total)} GiB"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def kv_space_bytes(env: Mapping[str, str] | None = None) -> int | None:
    """``VLLM_CPU_KVCACHE_SPACE`` in bytes, read as vLLM reads it (whole GiB); None when it is
    unset and vLLM sizes the KV cache from the share. A value ``int()`` refuses, the empty
    string included, is EngineStartRefused: vLLM's platform code would skip an empty one, but
    every worker reads it again through ``vllm.envs`` and dies of the ValueError (seen)."""
    env = os.environ if env is None else env
    value = env.get(KV_SPACE_ENV)
    if value is None:
        return None
    try:
        return int(value) * GIB
    except ValueError:
        raise EngineStartRefused(
            f"{KV_SPACE_ENV}={value!r} is not a whole number of GiB, which vLLM's workers need: "
            "unset it, or give the KV cache's size (e.g. 1)"
        ) from None


def weights_bytes(model: str) -> int | None:
    """Bytes of the weight files of ``model`` (a folder, or a hub name already in the local
    cache); None when there is nothing local to measure. The checkpoint's dtype, not the
    engine's: a float32 checkpoint served in bfloat16 is counted twice over, the safe side."""
    folder = Path(model)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached (or not a hub name): vLLM will say so itself
            return None
    for suffixes in _WEIGHT_SUFFIXES:
        files = [p for p in folder.iterdir() if p.is_file() and p.name.endswith(suffixes)]
        if files:
            return sum(p.stat().st_size for p in files)
    return None


def engine_need(model: str, env: Mapping[str, str] | None = None) -> EngineNeed:
    """What a CPU engine serving ``model`` holds, from its files and the environment."""
    kv = kv_space_bytes(env)
    weights = weights_bytes(model)
    return EngineNeed(
        weights=weights or 0,
        kv=DEFAULT_CPU_KV_BYTES if kv is None else kv,
        kv_from=KV_SPACE_ENV if kv is not None else f"default; {KV_SPACE_ENV} sets it",
        weights_known=weights is not None,
    )


def share_of(need: int, total: int) -> float:
    """``need`` as a share of ``total``, rounded up to the hundredth, at most 1 (vLLM's bound)."""
    return min(1.0, math.ceil(100 * need / total) / 100)


def node_memory() -> NodeMemory:
    """The node vLLM's CPU worker will check and its memory now, read with vLLM's own
    functions: the node of the first core this process may run on (the worker inherits the
    affinity), else the first node whose memory it may use, as ``CPUWorker.__init__``."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info, get_visible_memory_node

    nodes = get_visible_memory_node()
    node = get_allowed_cpu_list()[0].numa_node
    if node not in nodes and nodes:
        node = nodes[0]
    info = get_memory_node_info(node)
    return NodeMemory(node=node, total=info.total_memory, available=info.available_memory)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def choose_share(given: float | None, gpu_default: float, *, model: str, flag: str, who: str) -> float:
    """The share to start the engine with: ``given`` if the user gave one; on a GPU
    ``gpu_default``; on CPU what the engine needs of its node (see the module doc). Logged."""
    if given is not None:
        return given
    if not _on_cpu():
        return gpu_default
    need, node = engine_need(model), node_memory()
    if not need.weights_known:
        log.warning("%s: no local weight files of %s to measure: counted as 0 GiB in %s", who, model, flag)
    share = share_of(need.total, node.total)
    log.info(
        "%s: %s %.2f of NUMA node %d's %s GiB, what the engine needs: %s%s",
        who,
        flag,
        share,
        node.node,
        _gib(node.total),
        need,
        f" (with {KV_SPACE_ENV} set vLLM sizes the KV cache from it and checks no share)"
        if kv_space_bytes() is not None
        else "",
    )
    return share


def refusal(share: float, mem: NodeMemory, *, flag: str, who: str, need: int | None = None) -> str | None:
    """vLLM-CPU's start-up check (``CPUWorker.__init__``) on the numbers ``mem``: None when it
    passes, else the one line to say: what was asked and what is free, and a share that would
    start (at least ``need`` bytes' worth, when known), or why there is none.
    For a KV cache set by VLLM_CPU_KVCACHE_SPACE vLLM checks nothing here: callers skip it."""
    asked = math.ceil(mem.total * share)
    if asked <= mem.available:
        return None
    # The largest share s in hundredths with ceil(total * s) <= available.
    fits = math.floor(100 * mem.available / mem.total) / 100
    least = share_of(need, mem.total) if need is not None else 0.01
    head = (
        f"{who}: vLLM-CPU will not start: {flag} {share:g} asks for {_gib(asked)} GiB of NUMA node "
        f"{mem.node} ({_gib(mem.total)} GiB) to be free and {_gib(mem.available)} GiB is"
    )
    if fits >= least:
        what = f"this engine needs about {least:.2f}" if need is not None else "or less"
        return f"{head}: pass {flag} {fits:.2f} ({what}), or free memory on node {mem.node}"
    short = f", less than this engine needs ({_gib(need)} GiB)" if need is not None else ""
    return (
        f"{head}{short}: free memory on node {mem.node}, or set {KV_SPACE_ENV} "
        "(GiB of KV cache; vLLM then checks only that it fits once the weights are loaded)"
    )


def start_refusal(share: float, *, model: str, flag: str, who: str) -> str | None:
    """``refusal`` with the node as it is now (None on a GPU, or when VLLM_CPU_KVCACHE_SPACE
    sets the KV cache: vLLM checks no share then)."""
    if not _on_cpu() or kv_space_bytes() is not None:
        return None
    return refusal(share, node_memory(), flag=flag, who=who, need=engine_need(model).total)


def check_start(share: float, *, model: str, flag: str, who: str) -> None:
    """Raises EngineStartRefused, before any vLLM process is started, where vLLM's CPU worker
    would refuse ``share`` on this host now."""
    line = start_refusal(share, model=model, flag=flag, who=who)
    if line is not None:
        raise EngineStartRefused(line)
