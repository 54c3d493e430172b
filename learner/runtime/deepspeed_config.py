"""DeepSpeed config dicts for training and frozen (inference-only) engines.

Pure functions, no torch import: the trainers' ``--help`` stays fast and tests can check
the arithmetic directly. ``learner.runtime.engine`` is the only caller that hands these to
DeepSpeed.

Batch sizes follow OpenRLHF's meaning: ``train_batch_size`` is the GLOBAL number of samples
per optimizer step (all data-parallel ranks, all accumulation micro-steps);
``micro_train_batch_size`` is what one rank runs in one forward/backward. The gradient
accumulation steps are derived: ``train_batch_size / (micro_train_batch_size * world_size)``,
and a batch size that does not divide is an error rather than a silently different batch.

Differences from OpenRLHF's ``get_train_ds_config``: fp16 is not offered (bf16 or fp32;
DeepSpeed refuses fp16 on CPU and bf16 is what every current GPU trains in), and the
optimizer is not in the config: ``learner.runtime.engine`` builds it (torch AdamW, DeepSpeedCPUAdam
or DeepSpeed's MuonWithAuxAdam) with weight-decay parameter groups and passes it to
``deepspeed.initialize``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["grad_accum_steps", "effective_zero_stage", "train_ds_config", "frozen_ds_config", "load_ds_config"]

# DeepSpeed prints a throughput line every `steps_per_print` steps; we log our own metrics.
_QUIET = {"steps_per_print": 1_000_000_000, "wall_clock_breakdown": False}


def grad_accum_steps(train_batch_size: int, micro_train_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step; raises ValueError unless the batch divides exactly."""
    per_step = micro_train_batch_size * world_size
    if micro_train_batch_size < 1 or train_batch_size < 1:
        raise ValueError(
            f"batch sizes must be positive (train_batch_size={train_batch_size}, "
            f"micro_train_batch_size={micro_train_batch_size})"
        )
    if train_batch_size % per_step:
        raise ValueError(
            f"--train_batch_size {train_batch_size} is not a multiple of "
            f"--micro_train_batch_size {micro_train_batch_size} x world size {world_size} "
            f"= {per_step}; pick a train_batch_size such as {max(per_step, train_batch_size // per_step * per_step)}"
        )
    return train_batch_size // per_step


def effective_zero_stage(zero_stage: int, *, world_size: int, bf16: bool, adam_offload: bool) -> int:
    """The stage a trained engine runs: ZeRO-1/2 on ONE rank in fp32 become stage 0.

    ZeRO-1/2 partition optimizer state and gradients across data-parallel ranks; one rank has
    nothing to partition, yet the machinery still runs. Stage 2's gradient hooks copy every
    micro-batch's gradients into a reduce bucket, then copy or add them into the fp32
    partition; stage 1 flattens and re-casts them at each optimizer step. Measured with
    ``bench/learner.py`` (docs/performance.md): stage 2's backward was 1.2-1.46x plain
    torch's, stage 0's 1.05x. Stage 0 keeps torch's in-place ``.grad`` accumulation and its
    optimizer over the parameters themselves, with identical arithmetic (fp32, same clipping).
    On one GPU the same holds, and it also spares the 5e8-element reduce bucket (2 GB fp32).
    Kept as asked under bf16 (DeepSpeed has no stage-0 path with fp32 gradient accumulation)
    and with ``--adam_offload`` (offload needs ZeRO). A checkpoint saved by a one-rank run is a
    stage-0 checkpoint; DeepSpeed's ZeRO-1/2 checkpoints are tied to the data-parallel size
    anyway.
    """
    if world_size == 1 and zero_stage in (1, 2) and not bf16 and not adam_offload:
        return 0
    return zero_stage


def _zero_section(
    stage: int, *, offload_optimizer: bool, offload_params: bool, overlap_comm: bool, contiguous_gradients: bool = True
) -> dict[str, Any]:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {stage}")
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        if stage == 0:
            raise ValueError(
                "--adam_offload needs --zero_stage 1, 2 or 3 (DeepSpeed offloads optimizer state only under ZeRO)"
            )
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        if stage != 3:
            raise ValueError("parameter offload needs ZeRO stage 3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # Gather the full 16-bit weights for save_16bit_model; our save_hf gathers per
        # parameter instead, but users' DeepSpeed tooling expects the flag on.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if stage >= 1:
        zero["overlap_comm"] = overlap_comm
        zero["reduce_bucket_size"] = "auto" if stage == 3 else 5e8
        # True (DeepSpeed's default) copies each gradient into a contiguous bucket as backward
        # produces it, which keeps the CUDA caching allocator from fragmenting on big models;
        # CPU memory has no such allocator, and the copies and the partition-wise reduces that
        # follow made ZeRO-1/2 backward 1.3-1.6x plain torch's on 2 gloo ranks (False: 1.0-1.2x,
        # docs/performance.md). The same gradients either way.
        zero["contiguous_gradients"] = contiguous_gradients
    return zero


def train_ds_config(
    *,
    zero_stage: int,
    bf16: bool,
    train_batch_size: int,
    micro_train_batch_size: int,
    world_size: int,
    grad_clip: float = 1.0,
    adam_offload: bool = False,
    overlap_comm: bool = False,
    contiguous_gradients: bool = True,
    muon: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a trained engine (policy, critic, SFT/RM/DPO model).

    ``grad_clip`` <= 0 turns clipping off. ``contiguous_gradients``: True on GPUs, False on
    CPUs (``learner.runtime.engine.make_engine`` decides; see ``_zero_section``). ``muon``: the
    optimizer is Muon (``learner.runtime.muon``). ``extra`` is merged last (shallow, per top-level
    key) for settings this function does not model.
    """
    accum = grad_accum_steps(train_batch_size, micro_train_batch_size, world_size)
    zero_stage = effective_zero_stage(zero_stage, world_size=world_size, bf16=bf16, adam_offload=adam_offload)
    zero = _zero_section(
        zero_stage,
        offload_optimizer=adam_offload,
        offload_params=False,
        overlap_comm=overlap_comm,
        contiguous_gradients=contiguous_gradients,
    )
    if muon and zero_stage == 3:
        # DeepSpeed's ZeRO-3 refuses Muon beside reduce-scatter ("Muon and reduce scatter cannot be
        # used together"); the gradients are all-reduced instead, the same sums.
        zero["reduce_scatter"] = False
    if zero.get("reduce_bucket_size") == "auto":
        zero.pop("reduce_bucket_size")  # "auto" needs an HF model config; DeepSpeed's default is fine
    config: dict[str, Any] = {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_train_batch_size,
        "gradient_accumulation_steps": accum,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        "gradient_clipping": float(grad_clip) if grad_clip and grad_clip > 0 else 0.0,
        # With offload the optimizer is DeepSpeedCPUAdam (built in learner.runtime.engine); without,
        # torch AdamW, which DeepSpeed would otherwise refuse next to ZeRO-offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **_QUIET,
    }
    if bf16:
        # Accumulate and all-reduce gradients in fp32 under bf16: bf16 sums of many
        # micro-batches lose the low bits that small learning rates live on.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    for key, value in (extra or {}).items():
        config[key] = value
    return config


def frozen_ds_config(
    *, zero_stage: int, bf16: bool, offload: bool = False, micro_batch_size: int = 1
) -> dict[str, Any]:
    """Config of an inference-only engine (reference model, frozen reward model).

    A frozen model has no gradients or optimizer state to shard, so only ZeRO-3 (sharded
    parameters) means anything; every other stage becomes 0. ``offload`` keeps the
    parameters in CPU memory between uses, which DeepSpeed only does under ZeRO-3, so it
    forces stage 3 (``learner.runtime.engine.make_frozen_engine`` partitions the model at init).
    """
    stage = 3 if (zero_stage == 3 or offload) else 0
    zero = _zero_section(stage, offload_optimizer=False, offload_params=offload, overlap_comm=False)
    zero.pop("reduce_bucket_size", None)
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        **_QUIET,
    }


def load_ds_config(*, zero_stage: int, bf16: bool, offload: bool = False) -> dict[str, Any] | None:
    """The config ``HfDeepSpeedConfig`` needs before ``from_pretrained`` (ZeRO-3 only, else None).

    Under ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init`` so each rank
    only ever holds its shard; the config only has to carry the stage, dtype and offload.
    """
    if zero_stage != 3 and not offload:
        return None
    return frozen_ds_config(zero_stage=3, bf16=bf16, offload=offload)
