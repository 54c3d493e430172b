"""The sections every trainer shares, named as OpenRLHF 0.10 names them: ``ds`` (DeepSpeed and
the model's numerics), ``ds.lora``, and the optimizer fields (``adam``, ``muon``, the LR schedule,
clipping) that sit in ``actor``/``critic`` for ``train_ppo`` and at the top level for
``train_sft``, ``train_rm`` and ``train_dpo``, as in OpenRLHF.

What the sections mean for the engine is two functions: ``model_options`` (how a model is
loaded: ``learner.runtime.engine.load_causal_lm`` and its siblings) and ``engine_options`` (how
its DeepSpeed engine is built: ``learner.runtime.engine.make_engine``); what differs between
trainers (the LR schedule's default, the batch sizes, the number of optimizer steps) is passed
beside them. The older flat names (``--zero_stage``, ``--l2``, ``--adam_betas`` ...) are
declared where the sections are embedded, since one section serves several places.

Imports nothing heavy: the configs that use it answer ``--help`` at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.config import flag, section
from common.host_memory import host_malloc_flag
from learner.runtime.accumulation import coalesce_flag


@dataclass
class AdamSection:
    """AdamW (DeepSpeed's FusedAdam on GPUs, DeepSpeedCPUAdam with offload, torch's otherwise)."""

    lr: float = flag(1e-6, "learning rate")
    betas: list[float] = flag([0.9, 0.95], "Adam betas (two numbers)")
    eps: float = flag(1e-8, "Adam epsilon")
    weight_decay: float = flag(0.0, "weight decay (not applied to biases and norms)")

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"--adam.betas takes two numbers in [0, 1), got {self.betas}")
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(
                f"--adam.lr, --adam.eps and --adam.weight_decay must be >= 0 (eps > 0), got "
                f"{self.lr}, {self.eps}, {self.weight_decay}"
            )


# What DeepSpeed's Muon does whatever it is asked (its optimizer takes no such setting; OpenRLHF
# 0.10 warns the same).
_DS_MUON_FIXED = "DeepSpeed's Muon always runs 5 Newton-Schulz steps with Nesterov momentum (it takes no such setting)"


@dataclass
class MuonSection:
    """Muon's hyper-parameters (``--optim muon``: DeepSpeed's Muon on the 2-D hidden weights, the
    ``adam`` section's AdamW on the rest; ``learner.runtime.muon``)."""

    lr: float = flag(0.02, "LR of Muon's group (the 2-D hidden weights); --adam.lr is the other parameters'")
    momentum: float = flag(0.95, "Muon momentum")
    ns_steps: int = flag(5, "Newton-Schulz steps", inert=_DS_MUON_FIXED)
    nesterov: bool = flag(True, "Nesterov momentum", inert=_DS_MUON_FIXED)
    no_nesterov: bool = flag(False, "OpenRLHF's switch that turns --muon.nesterov off", inert=_DS_MUON_FIXED)


@dataclass
class OptimizerFields:
    """One trained model's optimizer: ``actor.*`` / ``critic.*`` in train_ppo, the top level in the
    supervised trainers (OpenRLHF 0.10's layout)."""

    optim: str = flag(
        "adam",
        "optimizer: adam (AdamW), or muon (DeepSpeed's Muon on the 2-D hidden weights, AdamW by the adam flags on "
        "embeddings, heads, norms and biases)",
        choices=("adam", "muon"),
    )
    adam: AdamSection = section(AdamSection, "AdamW (with --optim muon: the parameters Muon does not train)")
    muon: MuonSection = section(MuonSection, "Muon (--optim muon)")
    lr_scheduler: str = flag(
        "cosine_with_min_lr",
        "LR schedule after warm-up",
        choices=("cosine_with_min_lr", "linear", "constant_with_warmup", "constant"),
    )
    lr_warmup_ratio: float = flag(0.03, "fraction of optimizer steps of linear LR warm-up")
    min_lr_ratio: float = flag(0.1, "cosine_with_min_lr: the LR decays to this fraction of the peak")
    max_norm: float = flag(1.0, "gradient clipping norm (0: off)")

    def check_optimizer(self, where: str = "") -> None:
        if self.muon.lr < 0:
            raise ValueError(f"--{where}muon.lr must be >= 0, got {self.muon.lr}")
        if not 0 <= self.muon.momentum < 1:
            raise ValueError(f"--{where}muon.momentum must be in [0, 1), got {self.muon.momentum}")
        if not 0 <= self.lr_warmup_ratio <= 1:
            raise ValueError(f"--{where}lr_warmup_ratio must be in [0, 1], got {self.lr_warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--{where}min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_norm < 0:
            raise ValueError(f"--{where}max_norm must be >= 0 (0: no clipping), got {self.max_norm}")

    def unused_muon(self, given: Mapping[str, Any], where: str = "") -> list[str]:
        """A line for --muon.* flags given while this optimizer is AdamW (they would do nothing)."""
        names = sorted(p for p in given if p.startswith(f"{where}muon."))
        if not names or self.optim == "muon":
            return []
        return [f"--{', --'.join(names)}: no effect without --{where}optim muon (the optimizer is AdamW)"]

    def optimizer_options(self) -> dict[str, Any]:
        """Keyword arguments of ``learner.runtime.engine.make_engine`` this optimizer decides."""
        return {
            "learning_rate": self.adam.lr,
            "weight_decay": self.adam.weight_decay,
            "betas": tuple(self.adam.betas),
            "eps": self.adam.eps,
            "grad_clip": self.max_norm,
            "lr_scheduler": self.lr_scheduler,
            "lr_warmup_ratio": self.lr_warmup_ratio,
            "min_lr_ratio": self.min_lr_ratio,
            "optim": self.optim,
            "muon_lr": self.muon.lr,
            "muon_momentum": self.muon.momentum,
        }


# Where an optimizer section is embedded, its older flat names (OpenRLHF before 0.10 had one set
# of optimizer flags; in train_ppo they set the actor's and the critic's alike).
OPTIMIZER_FLAT = {
    "adam.betas": "adam_betas",
    "adam.weight_decay": "l2",
    "max_norm": "max_norm",
    "lr_warmup_ratio": "lr_warmup_ratio",
    "lr_scheduler": "lr_scheduler",
    "min_lr_ratio": "min_lr_ratio",
    "adam.eps": "adam_eps",
}


@dataclass
class LoraSection:
    """LoRA (learner.runtime.lora): only the adapters train, in every trainer."""

    rank: int = flag(0, "LoRA rank (0: train all weights); only the adapters train", flat="lora_rank")
    alpha: int = flag(16, "LoRA alpha: the adapter's output is scaled by alpha / rank", flat="lora_alpha")
    target_modules: list[str] = flag(
        ["all-linear"],
        "module names LoRA adapts (all-linear: every linear layer but the output head)",
        flat="target_modules",
    )
    dropout: float = flag(0.0, "dropout on the LoRA adapters' input", flat="lora_dropout")

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--ds.lora.rank (--lora_rank) must be >= 0 (0: off), got {self.rank}")
        if self.rank == 0:
            return
        if self.alpha <= 0:
            raise ValueError(f"--ds.lora.alpha (--lora_alpha) must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--ds.lora.dropout (--lora_dropout) must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(f"--ds.lora.target_modules names no module: {self.target_modules}")


@dataclass
class DSSection:
    """DeepSpeed and the model's numerics (OpenRLHF's ``ds.*``)."""

    zero_stage: int = flag(2, "DeepSpeed ZeRO stage 0-3", choices=(0, 1, 2, 3), flat="zero_stage")
    param_dtype: str = flag(
        "fp32",
        "training dtype: bf16 (fp32 master weights) or fp32 (rayless's default: bf16 is slow on most CPUs); "
        "fp16 is not supported (DeepSpeed refuses it on CPU)",
        choices=("bf16", "fp32", "fp16"),
        flat="bf16",
        flat_const="bf16",
    )
    adam_offload: bool = flag(
        False, "optimizer states in CPU memory, DeepSpeedCPUAdam (needs ZeRO >= 1)", flat="adam_offload"
    )
    attn_implementation: str = flag(
        "sdpa",
        "attention kernel: sdpa, eager, or flash_attention_2 (CUDA + flash_attn; SDPA with a notice otherwise)",
        flat="flash_attn",
        flat_const="flash_attention_2",
    )
    overlap_comm: bool = flag(
        False, "DeepSpeed overlap_comm: overlap gradient reduction with backward", flat="overlap_comm"
    )
    packing_samples: bool = flag(
        False,
        "pack each micro-batch's samples into one row (no padding; position ids restart per sample, attention "
        "stays within each sample)",
        flat="packing_samples",
    )
    logits_tile_tokens: int = flag(
        256,
        "token log-probs, entropy and the losses on them computed this many tokens at a time: the model's final "
        "hidden states go through the output head one tile of rows at a time, recomputed in backward, so at most one "
        "tile's (tokens x vocabulary) logits exist (common.tiled_logits; docs/long-context.md); 0: all of a "
        "micro-batch's logits at once",
        flat="logits_tile_tokens",
    )
    host_malloc: str = host_malloc_flag(group="", flat="host_malloc")
    coalesce_grad_reduction: str = coalesce_flag(group="", flat="coalesce_grad_reduction")
    value_head_prefix: str = flag(
        "score", "attribute name of a reward/critic model's value head", flat="value_head_prefix"
    )
    lora: LoraSection = section(LoraSection, "LoRA adapters")
    # Accepted so OpenRLHF 0.10 scripts run; what each would need is said at start-up when set.
    zpg: int = flag(1, "ZeRO++ partition size", inert="ZeRO++ hierarchical partitioning is not built in rayless")
    grad_accum_dtype: str = flag(
        "", "gradient accumulation dtype", inert="rayless accumulates in the training dtype (DeepSpeed's default)"
    )
    use_universal_ckpt: bool = flag(
        False,
        "DeepSpeed universal checkpoint",
        inert="rayless checkpoints reshard on load already (docs/checkpoints.md)",
    )
    # GPU-only (learner.runtime.gpu_features): on a host without CUDA each given is said once and does nothing.
    deepcompile: bool = flag(False, "GPU-only: DeepSpeed's DeepCompile on the trained engines", flat="deepcompile")
    use_liger_kernel: bool = flag(
        False, "GPU-only: Liger's Triton kernels (RMSNorm, RoPE, SwiGLU); needs the gpu extra", flat="use_liger_kernel"
    )
    load_in_4bit: bool = flag(
        False,
        "GPU-only: QLoRA, the frozen base model in 4-bit NF4 (bitsandbytes, the gpu extra); needs --ds.lora.rank",
        flat="load_in_4bit",
    )
    experts_implementation: str = flag("", "MoE expert kernel", inert="MoE kernels are not built in rayless")
    tensor_parallel_size: int = flag(
        1, "DeepSpeed AutoTP size", inert="training tensor parallelism is not built in rayless (ZeRO-3 shards instead)"
    )
    ring_attn_size: int = flag(
        1,
        "sequence parallelism: each sequence split across this many learner ranks (groups of consecutive ranks, data "
        "parallel across groups). The algorithm is Ulysses (DeepSpeed's UlyssesSPAttentionHF: an all-to-all over the "
        "attention heads, each rank 1/N of the columns elsewhere), not ring attention; N must divide the learner "
        "ranks and the model's attention and KV heads. train_ppo's policy and critic only (docs/long-context.md)",
        flat="ring_attn_size",
        aliases=("--ds.sequence_parallel_size", "--sequence_parallel_size"),
    )
    ring_attn_head_stride: int = flag(
        1, "ring attention head stride", inert="the sequence split is Ulysses (all-to-all over heads), not a ring"
    )

    def __post_init__(self) -> None:
        if self.logits_tile_tokens < 0:
            raise ValueError(f"--ds.logits_tile_tokens must be >= 0 (0: whole logits), got {self.logits_tile_tokens}")
        if self.param_dtype == "fp16":
            raise ValueError("--ds.param_dtype fp16 is not supported: bf16 (--bf16) or fp32")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
            raise ValueError(
                f"--ds.attn_implementation {self.attn_implementation}: one of sdpa, eager, flash_attention_2"
            )
        if self.ring_attn_size < 1:
            raise ValueError(
                f"--ds.ring_attn_size (--ds.sequence_parallel_size) must be >= 1, got {self.ring_attn_size}"
            )
        if self.load_in_4bit and self.lora.rank == 0:
            # A 4-bit weight has no gradient to train: QLoRA trains LoRA adapters on the frozen 4-bit base.
            raise ValueError(
                "--ds.load_in_4bit (--load_in_4bit) is QLoRA: the 4-bit base model stays frozen and LoRA adapters "
                "train on it; give --ds.lora.rank (--lora_rank) > 0"
            )

    @property
    def bf16(self) -> bool:
        return self.param_dtype == "bf16"

    @property
    def flash_attn(self) -> bool:
        return self.attn_implementation.startswith("flash_attention")


def model_options(ds: DSSection, gradient_checkpointing: bool) -> dict[str, Any]:
    """Keyword arguments of the model loaders (``learner.runtime.engine.load_causal_lm`` ...)."""
    return {
        "zero_stage": ds.zero_stage,
        "bf16": ds.bf16,
        "gradient_checkpointing": gradient_checkpointing,
        "flash_attn": ds.flash_attn,
        "use_liger_kernel": ds.use_liger_kernel,
        "load_in_4bit": ds.load_in_4bit,
    }


def engine_options(ds: DSSection, optim: OptimizerFields) -> dict[str, Any]:
    """Keyword arguments of ``learner.runtime.engine.make_engine`` these sections decide; the
    caller adds the batch sizes and the number of optimizer steps."""
    return {
        "zero_stage": ds.zero_stage,
        "bf16": ds.bf16,
        "adam_offload": ds.adam_offload,
        "overlap_comm": ds.overlap_comm,
        "deepcompile": ds.deepcompile,
        **optim.optimizer_options(),
    }
