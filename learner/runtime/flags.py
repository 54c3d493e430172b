"""The optimizer and DeepSpeed flags every trainer shares: ``train_ppo``, ``train_sft``, ``train_rm``, ``train_dpo``.

One section, one mapping: ``OptimizerFlags.model_options()`` is how the flags load a model
(``learner.runtime.engine.load_causal_lm`` and its siblings) and ``engine_options()`` how they
build a DeepSpeed engine (``learner.runtime.engine.make_engine``); what differs between trainers
(the learning rate's flag, the LR schedule, the number of optimizer steps, the batch sizes) is
passed beside them. A trainer's config inherits this section and may override a default (the
supervised trainers warm the LR up by default, RL does not, as in OpenRLHF).

Imports nothing heavy: the configs that use it answer ``--help`` at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import flag
from common.host_memory import host_malloc_flag
from learner.runtime.accumulation import coalesce_flag


@dataclass
class OptimizerFlags:
    lr_warmup_ratio: float = flag(0.0, "fraction of optimizer steps of linear LR warm-up", group="optim")
    l2: float = flag(0.0, "weight decay (not applied to biases and norms)", group="optim")
    adam_betas: list[float] = flag([0.9, 0.95], "Adam betas", group="optim")
    max_norm: float = flag(1.0, "gradient clipping norm (0: off)", group="optim")
    seed: int = flag(42, "seed of data order and initialisation", group="optim")
    zero_stage: int = flag(2, "DeepSpeed ZeRO stage 0-3", choices=(0, 1, 2, 3), group="deepspeed")
    bf16: bool = flag(
        False, "train in bf16 (fp32 master weights); fp16 is refused by DeepSpeed on CPU", group="deepspeed"
    )
    adam_offload: bool = flag(
        False, "optimizer states in CPU memory, DeepSpeedCPUAdam (needs ZeRO >= 1)", group="deepspeed"
    )
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory", group="deepspeed")
    host_malloc: str = host_malloc_flag(group="deepspeed")
    coalesce_grad_reduction: str = coalesce_flag(group="deepspeed")
    flash_attn: bool = flag(
        False, "flash_attention_2 where available (CUDA + flash_attn); SDPA with a notice otherwise", group="deepspeed"
    )
    # LoRA (learner.runtime.lora): every trainer; train_ppo pushes the merged weights (--lora_sync).
    lora_rank: int = flag(0, "LoRA rank (0: train all weights); only the adapters train", group="lora")
    lora_alpha: int = flag(16, "LoRA alpha: the adapter's output is scaled by alpha / rank", group="lora")
    target_modules: list[str] = flag(
        ["all-linear"], "module names LoRA adapts (all-linear: every linear layer but the output head)", group="lora"
    )
    lora_dropout: float = flag(0.0, "dropout on the LoRA adapters' input", group="lora")

    def check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"--lora_rank must be >= 0 (0: off), got {self.lora_rank}")
        if self.lora_rank == 0:
            return
        if self.lora_alpha <= 0:
            raise ValueError(f"--lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(f"--target_modules names no module: {self.target_modules}")

    def check_optimizer(self) -> None:
        if not 0 <= self.lr_warmup_ratio <= 1:
            raise ValueError(f"--lr_warmup_ratio must be in [0, 1], got {self.lr_warmup_ratio}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"--adam_betas takes two numbers in [0, 1), got {self.adam_betas}")
        if self.max_norm < 0:
            raise ValueError(f"--max_norm must be >= 0 (0: no clipping), got {self.max_norm}")

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments of the model loaders (``learner.runtime.engine.load_causal_lm`` ...)."""
        return {
            "zero_stage": self.zero_stage,
            "bf16": self.bf16,
            "gradient_checkpointing": self.gradient_checkpointing,
            "flash_attn": self.flash_attn,
        }

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of ``learner.runtime.engine.make_engine`` these flags decide; the
        caller adds the learning rate, its schedule, the optimizer steps and the batch sizes."""
        return {
            "zero_stage": self.zero_stage,
            "bf16": self.bf16,
            "weight_decay": self.l2,
            "betas": tuple(self.adam_betas),
            "adam_offload": self.adam_offload,
            "grad_clip": self.max_norm,
            "lr_warmup_ratio": self.lr_warmup_ratio,
        }
