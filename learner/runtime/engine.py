"""The one DeepSpeed wrapper every trainer uses (SFT, RM, DPO, PPO): process group, model
loading, engines, HF saves and resumable checkpoints.

CPU and GPU run the same code: the device and the default backend come from DeepSpeed's
accelerator (``cuda`` + NCCL on GPUs, ``cpu`` + gloo here). A process started by
``torchrun``, the ``deepspeed`` launcher, ``srun`` (with the torchrun env) or plain
``python`` (a world of one) all work: ``init_distributed`` fills in what is missing.

Typical use::

    dist = init_distributed()
    model = load_causal_lm(path, zero_stage=3, bf16=True, gradient_checkpointing=True)
    engine = make_engine(model, zero_stage=3, bf16=True, train_batch_size=128,
                         micro_train_batch_size=4, learning_rate=5e-7, num_training_steps=n)
    loss = engine(**batch).loss; engine.backward(loss); engine.step()
    save_checkpoint(engine, ckpt_dir, tag=f"global_step{step}", client_state={"step": step})
    save_hf(engine, tokenizer, out_dir)

Differences from OpenRLHF's ``DeepspeedStrategy``: plain functions instead of a strategy
object; no fp16 (see ``learner.runtime.deepspeed_config``); the optimizer is torch AdamW (fused on
GPU) rather than FusedAdam unless ``adam_offload`` picks DeepSpeedCPUAdam, or with ``--optim muon``
DeepSpeed's MuonWithAuxAdam built here (``learner.runtime.muon``); ``offload`` of a
frozen model forces ZeRO-3 because DeepSpeed only offloads parameters under ZeRO-3.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeAlias

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from common.host_memory import keep_freed_memory
from common.net import bind_address, free_port, tcp_store_server
from learner.runtime import gpu_features, lora, muon
from learner.runtime.deepspeed_config import effective_zero_stage, frozen_ds_config, load_ds_config, train_ds_config

__all__ = [
    "DistInfo",
    "init_distributed",
    "set_host_malloc",
    "device",
    "is_rank0",
    "barrier",
    "load_pretrained",
    "load_causal_lm",
    "attn_implementation",
    "make_optimizer",
    "LR_SCHEDULERS",
    "make_lr_scheduler",
    "make_engine",
    "make_frozen_engine",
    "save_hf",
    "save_checkpoint",
    "load_checkpoint",
    "all_reduce_mean",
    "all_reduce_sum",
]

log = logging.getLogger("rayless.engine")
Number: TypeAlias = int | float | torch.Tensor


# --------------------------------------------------------------------------- process group


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


STALE_LOCK_S = 600.0  # an op build takes ~1 min; a lock this old belongs to a killed build


def clear_stale_op_locks(max_age_s: float = STALE_LOCK_S) -> list[str]:
    """Removes JIT-build locks left by a killed build, naming them.

    torch's extension builder waits forever on ``TORCH_EXTENSIONS_DIR/<op>/lock``; a build
    killed half-way (Ctrl-C, a test timeout) leaves it behind and every later DeepSpeed
    start hangs in ``FileBaton.wait`` with no message.
    """
    import time

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    removed = []
    for lock in root.glob("**/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                removed.append(str(lock))
                log.warning("removed a stale build lock %s (%.0f s old: a killed build left it)", lock, age)
        except OSError:
            pass
    return removed


def build_ops() -> None:
    """Builds the CPU ops DeepSpeed JIT-compiles on first use, once, at set-up: later runs
    (and parallel ranks) then load them instead of racing to build them. The shared-memory
    collective every run loads, and DeepSpeedCPUAdam (``--adam_offload``): ~80 s of both cores
    to build, which a fresh checkout's test suite otherwise paid inside its first offloading
    test, under the load of its neighbours, while the others that need it waited on its lock
    (one such run took 336 s in CI, 45 s with the op built)."""
    clear_stale_op_locks()
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder import CPUAdamBuilder

    build_shm_op()
    CPUAdamBuilder().load()


# Rank 0's rendezvous store (``_host_rendezvous_store``): it serves the process group for as
# long as the process lives, as the one torch.distributed would have made.
_rendezvous_store: Any = None


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Join (or, alone, form) the process group; idempotent. Returns rank, world, device.

    ``backend`` defaults to NCCL with CUDA, else gloo (DeepSpeed's CPU accelerator would
    pick oneCCL, which is rarely installed). Without launcher env vars this is a world of
    one on a free local port. Rank 0's rendezvous store listens on MASTER_ADDR only when
    that is an IP address (``_host_rendezvous_store``).
    """
    if not dist.is_initialized():
        clear_stale_op_locks()
        if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        _host_rendezvous_store(timeout_s)
        accel = get_accelerator()
        if backend is None:
            backend = "nccl" if accel.device_name() == "cuda" else "gloo"
        if accel.device_name() == "cuda":
            # Before the process group exists: NCCL binds each rank to its current device.
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        deepspeed.init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s), verbose=False
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device())


def _host_rendezvous_store(timeout_s: float) -> None:
    """On rank 0, unless a launcher's agent hosts it: the process group's TCPStore, made here
    listening on ``bind_address(MASTER_ADDR)`` (loopback for a one-host run). The one
    torch.distributed makes (``env://``) listens on every interface whatever MASTER_ADDR says,
    and answers any client. Rank 0 then joins it as a client, as every rank does when torchrun's
    agent hosts the store: that is what TORCHELASTIC_USE_AGENT_STORE tells ``env://``.

    Plain ``torchrun`` shares its agent's store (TORCHELASTIC_USE_AGENT_STORE=True already), and
    that one listens on every interface: launch.local passes torchrun options that leave the
    store to rank 0 (``launch.local._torchrun_loopback``; docs/security.md)."""
    global _rendezvous_store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or int(os.environ["RANK"]) != 0:
        return
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        _rendezvous_store = tcp_store_server(host, port, timeout_s=timeout_s)
    except (OSError, RuntimeError) as e:
        raise RuntimeError(
            f"rank 0 could not host the rendezvous store at MASTER_ADDR={host} MASTER_PORT={port}: {e}"
        ) from e
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    log.debug("rendezvous store on %s:%d", bind_address(host) or "*", port)


def set_host_malloc(mode: str) -> None:
    """``--host_malloc``: ``keep`` freed host memory in this process (``common.host_memory``),
    leave glibc's ``default``, or ``auto``: keep when this rank trains on CPU, where every
    micro-batch's activations and gradients live in host memory."""
    if mode not in ("auto", "keep", "default"):
        raise ValueError(f"--host_malloc: {mode!r} is not auto, keep or default")
    if mode == "keep" or (mode == "auto" and device().type == "cpu"):
        keep_freed_memory("learner")


def device() -> torch.device:
    """This rank's compute device: ``cuda:LOCAL_RANK`` on GPUs, ``cpu`` here."""
    accel = get_accelerator()
    if accel.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(accel.device_name(), int(os.environ.get("LOCAL_RANK", 0)))


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------- loading models


def attn_implementation(flash_attn: bool) -> str:
    """``flash_attention_2`` when asked for and usable (CUDA + the flash_attn package), else SDPA.

    SDPA also honours packed rows (position ids restarting at 0 with no attention mask):
    transformers builds a block-diagonal causal mask, so packing is the same code on CPU.
    """
    if not flash_attn:
        return "sdpa"
    if get_accelerator().device_name() == "cuda" and importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    if is_rank0():
        log.warning(
            "--flash_attn: flash_attention_2 needs CUDA and the flash_attn package; "
            "using SDPA attention instead (same results, packed rows included)"
        )
    return "sdpa"


def load_pretrained(
    path: str,
    *,
    auto_class: Any = None,
    zero_stage: int = 0,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
    flash_attn: bool = False,
    offload: bool = False,
    use_liger_kernel: bool = False,
    load_in_4bit: bool = False,
    **from_pretrained_kwargs: Any,
) -> torch.nn.Module:
    """``auto_class.from_pretrained(path)`` the way DeepSpeed needs it (default: causal LM).

    Under ZeRO-3 (or ``offload``) the model is built inside ``zero.Init`` through
    transformers' ``HfDeepSpeedConfig``, so no rank ever holds the whole model; the config
    object is kept on the model because transformers only holds it weakly. Weights load in
    bf16 with ``bf16`` (DeepSpeed keeps fp32 master copies in the optimizer), else fp32.
    With ``output_loading_info=True`` it returns ``(model, info)``, as transformers does.
    ``use_liger_kernel`` / ``load_in_4bit``: Liger's kernels, the QLoRA 4-bit base, on CUDA;
    elsewhere said once and not done (``learner.runtime.gpu_features``).
    """
    if auto_class is None:
        from transformers import AutoModelForCausalLM

        auto_class = AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = load_ds_config(zero_stage=zero_stage, bf16=bf16, offload=offload)
    hf_ds_config = HfDeepSpeedConfig(ds_config) if ds_config is not None else None
    gpu = gpu_features.gpu_plan(
        device(), use_liger_kernel=use_liger_kernel, load_in_4bit=load_in_4bit, bf16=bf16, zero_stage=zero_stage
    )
    if is_rank0():
        gpu_features.announce(gpu)
    kwargs = dict(dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation=attn_implementation(flash_attn))
    kwargs.update(gpu_features.from_pretrained_kwargs(gpu))
    kwargs.update(from_pretrained_kwargs)
    loaded = auto_class.from_pretrained(path, **kwargs)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
    if gpu.liger:
        gpu_features.apply_liger(model)
    model._rayless_hf_ds_config = hf_ds_config  # keep transformers' weak reference alive
    if gradient_checkpointing:
        # Non-reentrant: works with frozen inputs (LoRA, ref models) and ZeRO-3 hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # training never reuses a KV cache
    return (model, info) if info is not None else model


def load_causal_lm(path: str, **kwargs: Any) -> torch.nn.Module:
    """``load_pretrained`` with ``AutoModelForCausalLM`` (see there for the keywords)."""
    return load_pretrained(path, **kwargs)


# --------------------------------------------------------------------------- engines

_NO_DECAY = ("bias", "norm.weight", "layernorm.weight", "ln_f.weight")


def make_optimizer(
    model: torch.nn.Module,
    *,
    learning_rate: float,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    adam_offload: bool = False,
    eps: float = 1e-8,
    optim: str = "adam",
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; biases and norm weights get no weight decay.

    ``adam_offload`` uses DeepSpeedCPUAdam (the optimizer step runs on CPU next to the
    offloaded state; JIT-compiled on first use, cached in TORCH_EXTENSIONS_DIR).
    ``optim="muon"``: DeepSpeed's Muon on the 2-D hidden weights (``muon_lr``, ``muon_momentum``),
    this AdamW (``learning_rate`` ...) on the rest, in one optimizer (``learner.runtime.muon``).
    """
    # Fused: one pass over each parameter's state instead of a kernel per operation. On CPU
    # (torch >= 2.4) it is 4.8x faster than the default for-loop AdamW on SmolLM2's 135 M
    # parameters (0.11 s against 0.53 a step, 2 threads), same results to float rounding.
    fused = get_accelerator().device_name() in ("cuda", "cpu")
    if optim == "muon":
        return muon.make_muon_optimizer(
            model,
            muon_lr=muon_lr,
            momentum=muon_momentum,
            adam_lr=learning_rate,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            no_decay=_NO_DECAY,
            adam_offload=adam_offload,
            fused=fused,
        )
    if optim != "adam":
        raise ValueError(f"--optim {optim!r}: adam or muon")
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(_NO_DECAY) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=learning_rate, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused)


def _cosine_with_min_lr(warmup: int, total: int, min_lr_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _linear(warmup: int, total: int, min_lr_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1 - (1 - min_lr_ratio) * progress

    return factor


def _constant_with_warmup(warmup: int, total: int, min_lr_ratio: float) -> Callable[[int], float]:
    return lambda step: (step + 1) / warmup if step < warmup else 1.0


# name -> (warmup_steps, total_steps, min_lr_ratio) -> lr factor of optimizer step `step`
LR_SCHEDULERS: dict[str, Callable[[int, int, float], Callable[[int], float]]] = {
    "cosine_with_min_lr": _cosine_with_min_lr,  # OpenRLHF's default (min_lr = 0.1 * lr)
    "linear": _linear,
    "constant_with_warmup": _constant_with_warmup,
    "constant": _constant_with_warmup,  # the warm-up, if any, then constant: the same schedule
}


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    name: str = "cosine_with_min_lr",
    num_training_steps: int,
    warmup_ratio: float = 0.03,
    min_lr_ratio: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup (``ceil(warmup_ratio * num_training_steps)`` optimizer steps) then ``name``."""
    if name not in LR_SCHEDULERS:
        raise ValueError(f"unknown --lr_scheduler {name!r}; choose from {sorted(LR_SCHEDULERS)}")
    total = max(1, int(num_training_steps))
    warmup = max(1, math.ceil(warmup_ratio * total)) if warmup_ratio > 0 else 0
    factor = LR_SCHEDULERS[name](warmup, total, min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_engine(
    model: torch.nn.Module,
    *,
    zero_stage: int,
    bf16: bool,
    train_batch_size: int,
    micro_train_batch_size: int,
    learning_rate: float,
    num_training_steps: int,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    adam_offload: bool = False,
    grad_clip: float = 1.0,
    lr_scheduler: str = "cosine_with_min_lr",
    lr_warmup_ratio: float = 0.03,
    min_lr_ratio: float = 0.1,
    overlap_comm: bool = False,
    deepcompile: bool = False,
    optim: str = "adam",
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
    ds_extra: dict[str, Any] | None = None,
):
    """A trainable DeepSpeed engine around ``model`` (from ``load_pretrained``).

    ``train_batch_size`` is global (see ``learner.runtime.deepspeed_config``); gradient
    accumulation is derived and DeepSpeed's ``engine.step()`` only steps the optimizer and
    the LR schedule at accumulation boundaries, so call ``backward``/``step`` every
    micro-batch. ``num_training_steps`` counts optimizer steps (for the LR schedule).
    ``optim``/``muon_lr``/``muon_momentum``: ``make_optimizer``'s (Muon works at every ZeRO stage).
    ``deepcompile``: DeepSpeed's DeepCompile on CUDA, said once and not done elsewhere
    (``learner.runtime.gpu_features``).
    """
    gpu = gpu_features.gpu_plan(device(), deepcompile=deepcompile)
    if is_rank0():
        gpu_features.announce(gpu)
    world = dist.get_world_size() if dist.is_initialized() else 1
    stage = effective_zero_stage(zero_stage, world_size=world, bf16=bf16, adam_offload=adam_offload)
    if stage != zero_stage and is_rank0():
        log.info(
            "ZeRO-%d with one rank partitions nothing: running stage %d (same arithmetic, fewer copies)",
            zero_stage,
            stage,
        )
    config = train_ds_config(
        zero_stage=zero_stage,
        bf16=bf16,
        train_batch_size=train_batch_size,
        micro_train_batch_size=micro_train_batch_size,
        world_size=world,
        grad_clip=grad_clip,
        adam_offload=adam_offload,
        overlap_comm=overlap_comm,
        contiguous_gradients=get_accelerator().device_name() != "cpu",  # why: deepspeed_config._zero_section
        muon=optim == "muon",
        extra={**gpu.ds_config, **(ds_extra or {})},
    )
    optimizer = make_optimizer(
        model,
        learning_rate=learning_rate,
        betas=betas,
        weight_decay=weight_decay,
        adam_offload=adam_offload,
        eps=eps,
        optim=optim,
        muon_lr=muon_lr,
        muon_momentum=muon_momentum,
    )
    scheduler = make_lr_scheduler(
        optimizer,
        name=lr_scheduler,
        num_training_steps=num_training_steps,
        warmup_ratio=lr_warmup_ratio,
        min_lr_ratio=min_lr_ratio,
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False
    )
    skip_lone_allreduce(engine)
    if optim == "muon" and is_rank0():
        _announce_muon(model, engine, grad_clip)
    if gpu.compile:
        # As OpenRLHF: the config turns DeepCompile on, compile() builds it; until then DeepSpeed runs eagerly.
        engine.compile()
    return engine


def _announce_muon(model: torch.nn.Module, engine: Any, grad_clip: float) -> None:
    names, others = muon.muon_split(model)
    log.info("Muon trains %d weight matrices, AdamW the other %d trainable tensors", len(names), len(others))
    notice = muon.clip_notice(engine, grad_clip)
    if notice:
        log.warning(notice)


def skip_lone_allreduce(engine: Any) -> bool:
    """Turns off DeepSpeed's end-of-accumulation gradient all-reduce when it has no one to reduce
    with: one data-parallel rank and no ZeRO or bf16 optimizer (those reduce in their own hooks
    and need their epilogue). DeepSpeed runs it regardless of the group size: it flattens every
    gradient into 5e8-element buckets, all-reduces them with itself, divides by 1 and copies them
    back -- three passes over all gradients (7% of the learner's busy time in a SmolLM2 run on
    CPU, in ``_flatten_dense_tensors``) for the identity. Returns whether it did."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer  # BF16_Optimizer is one too

    if engine.dp_world_size != 1 or isinstance(engine.optimizer, ZeROOptimizer):
        return False
    engine.enable_backward_allreduce = False
    return True


def make_frozen_engine(model: torch.nn.Module, *, zero_stage: int, bf16: bool, offload: bool = False):
    """An inference-only engine (reference model, frozen reward model): no optimizer.

    Only ZeRO-3 shards a frozen model (other stages shard optimizer state it has not
    got), so it keeps stage 3 and maps 1/2 to 0; ``offload`` parks the parameters in CPU
    memory between forwards (and so forces stage 3). Gradients are off.
    """
    model.requires_grad_(False)
    model.eval()
    config = frozen_ds_config(zero_stage=zero_stage, bf16=bf16, offload=offload)
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    engine.eval()
    return engine


# --------------------------------------------------------------------------- saving


def _is_zero3(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def save_hf(
    model: Any, tokenizer: Any, path: str | os.PathLike, *, config_updates: Mapping[str, Any] | None = None
) -> None:
    """Write ``model`` (engine or module) in HF format to ``path``; call on ALL ranks.

    ZeRO-3 parameters are gathered one at a time on every rank (a collective) and copied to
    CPU on rank 0 only, so peak memory is one full parameter beyond the shards. Rank 0 then
    writes safetensors, the config (plus ``config_updates``, e.g. a reward model's
    ``mean``/``std``) and the tokenizer. Weights keep the training dtype.
    """
    from common.weights.source import unwrap

    module = unwrap(model)
    rank0 = is_rank0()
    if lora.is_lora(module):  # merged + adapter; under ZeRO-3 every rank takes part in the gathers
        lora.save_lora_hf(module, tokenizer, path, dict(config_updates or {}), rank0=rank0)
        barrier()
        return
    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}  # tied parameters are one tensor, saved once
    for name, t in module.state_dict(keep_vars=True).items():
        key = id(t)
        if key not in copies:
            with deepspeed.zero.GatheredParameters([t], enabled=_is_zero3(t)):
                copies[key] = t.detach().to("cpu", copy=True) if rank0 else torch.empty(0)
        if rank0:
            state[name] = copies[key]
    if rank0:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for attr, value in (config_updates or {}).items():
            setattr(module.config, attr, value)
        module.save_pretrained(path, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    barrier()


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike,
    *,
    tag: str,
    client_state: dict[str, Any] | None = None,
) -> None:
    """DeepSpeed checkpoint (model, optimizer, LR schedule, ``client_state``) as ``save_dir/tag``.

    Call on all ranks. ``save_dir/latest`` names the newest tag, so ``load_checkpoint``
    resumes from it. The trainers' checkpoints (atomic, verified, pruned, with the run's state)
    are ``learner.runtime.checkpoint``'s, which calls the engine's own save per part.
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=dict(client_state or {}))
    barrier()


def load_checkpoint(
    engine: Any, load_dir: str | os.PathLike, *, tag: str | None = None, load_optimizer_states: bool = True
) -> dict[str, Any] | None:
    """Resume ``engine`` from ``load_dir`` (newest tag unless ``tag``); returns the client state.

    Returns None when ``load_dir`` holds no checkpoint (a fresh run), so trainers can pass
    ``--load_checkpoint`` unconditionally. A checkpoint that exists but fails to load raises.
    """
    load_dir = Path(load_dir)
    if tag is None and not (load_dir / "latest").is_file():
        return None
    path, client_state = engine.load_checkpoint(
        str(load_dir),
        tag=tag,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_optimizer_states,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load a checkpoint from {load_dir} (tag {tag})")
    return dict(client_state or {})


# --------------------------------------------------------------------------- reductions


def _reduce(value: Number | Mapping[str, Number], op: str) -> Any:
    if isinstance(value, Mapping):
        keys = list(value)
        reduced = (
            _reduce(torch.stack([torch.as_tensor(value[k], dtype=torch.float64).reshape(()) for k in keys]), op)
            if keys
            else []
        )
        return {k: float(v) for k, v in zip(keys, reduced, strict=True)}
    t = (
        value.detach().to(device(), dtype=torch.float64, copy=True)
        if isinstance(value, torch.Tensor)
        else torch.tensor(float(value), dtype=torch.float64, device=device())
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if op == "mean":
            t /= dist.get_world_size()
    if isinstance(value, torch.Tensor):
        return t.to(value.device, value.dtype)
    return t.item()


def all_reduce_mean(value: Number | Mapping[str, Number]) -> Any:
    """Mean over ranks of a number, a tensor (same shape back) or a dict of numbers (floats back)."""
    return _reduce(value, "mean")


def all_reduce_sum(value: Number | Mapping[str, Number]) -> Any:
    """Sum over ranks; same forms as ``all_reduce_mean``."""
    return _reduce(value, "sum")


if __name__ == "__main__":  # `python -m learner.runtime.engine --build-ops` (make setup)
    import sys

    if sys.argv[1:] != ["--build-ops"]:
        raise SystemExit("usage: python -m learner.runtime.engine --build-ops")
    logging.basicConfig(level=logging.INFO)
    build_ops()
