"""Flags shared by ``learner.train_sft``, ``learner.train_rm`` and ``learner.train_dpo``.

Names and meanings follow OpenRLHF's ``openrlhf.cli.train_*`` so scripts port by swapping
the module. Nothing imported here loads torch, so ``--help`` is instant. Each trainer subclasses
``TrainerConfig``, adds its own flags and overrides defaults. The Weights & Biases flags are the
section every trainer shares with ``train_ppo`` (``learner.runtime.tracking.WandbFlags``).

Flags accepted for compatibility with an explanation rather than an effect: ``--local_rank``
(the ``deepspeed`` launcher passes it; the rank is read from the environment).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import flag
from common.host_memory import host_malloc_flag
from learner.runtime.accumulation import coalesce_flag
from learner.runtime.tracking import WandbFlags


@dataclass
class TrainerConfig(WandbFlags):
    # ---- model and output
    pretrain: str = flag("", "model to start from: local HF directory or hub name", required=True, group="model")
    save_path: str = flag("./ckpt", "where the final HF-format model (and train_log.jsonl) are written", group="model")
    tokenizer_chat_template: str = flag("", "override the tokenizer's chat template (a Jinja string)", group="model")

    # ---- data
    dataset: str = flag(
        "",
        "training data: json/jsonl/parquet file, saved dataset dir, folder, or hub name; comma-separated to mix",
        required=True,
        group="data",
    )
    dataset_probs: str = flag("", "comma-separated sampling probabilities for the --dataset sources", group="data")
    dataset_split: str = flag(
        "train", "split of a saved/hub dataset to train on", aliases=("--train_split",), group="data"
    )
    eval_dataset: str = flag("", "evaluation data (same forms as --dataset); none: no eval", group="data")
    eval_split: str = flag("train", "split of --eval_dataset", group="data")
    max_samples: int = flag(100_000_000, "use at most this many rows of each source", group="data")
    max_len: int = flag(2048, "max tokens per sequence (prompt + response); longer ones are truncated", group="data")
    input_template: str = flag(
        "",
        "template with one {} for the prompt when not using the chat template, e.g. 'User: {}\\nAssistant: '",
        group="data",
    )
    apply_chat_template: bool = flag(False, "render rows with the tokenizer's chat template", group="data")
    skip_bad_rows: bool = flag(
        False,
        "skip rows with a missing/empty key (counted) instead of failing with the file, row and key",
        group="data",
    )

    # ---- optimisation
    max_epochs: int = flag(1, "passes over the training data", group="optim")
    train_batch_size: int = flag(128, "samples per optimizer step, over all ranks", group="optim")
    micro_train_batch_size: int = flag(8, "samples per forward/backward pass per rank", group="optim")
    learning_rate: float = flag(5e-6, "peak learning rate", group="optim")
    lr_scheduler: str = flag(
        "cosine_with_min_lr",
        "LR schedule after warmup",
        choices=("cosine_with_min_lr", "linear", "constant_with_warmup"),
        group="optim",
    )
    lr_warmup_ratio: float = flag(0.03, "fraction of optimizer steps of linear warmup", group="optim")
    l2: float = flag(0.0, "weight decay (not applied to biases and norms)", group="optim")
    adam_betas: list[float] = flag([0.9, 0.95], "Adam betas", group="optim")
    max_norm: float = flag(1.0, "gradient clipping norm (0: off)", group="optim")
    seed: int = flag(42, "seed of data order and initialisation", group="optim")

    # ---- DeepSpeed
    zero_stage: int = flag(2, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3), group="deepspeed")
    bf16: bool = flag(False, "train in bf16 (fp32 master weights); fp16 is not offered", group="deepspeed")
    adam_offload: bool = flag(
        False, "optimizer state in CPU memory, DeepSpeedCPUAdam (needs ZeRO >= 1)", group="deepspeed"
    )
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory", group="deepspeed")
    host_malloc: str = host_malloc_flag(group="deepspeed")
    coalesce_grad_reduction: str = coalesce_flag(group="deepspeed")
    flash_attn: bool = flag(
        False, "flash_attention_2 where available (CUDA + flash_attn); SDPA with a notice otherwise", group="deepspeed"
    )
    local_rank: int = flag(
        -1, "set by the deepspeed launcher; ignored (the rank comes from the env)", group="deepspeed"
    )

    # ---- checkpoints and logging
    save_steps: int = flag(-1, "DeepSpeed checkpoint every this many optimizer steps (-1: never)", group="ckpt")
    ckpt_path: str = flag("", "DeepSpeed checkpoint directory (default: SAVE_PATH/checkpoints)", group="ckpt")
    max_ckpt_num: int = flag(3, "keep at most this many DeepSpeed checkpoints", group="ckpt")
    load_checkpoint: bool = flag(
        False, "resume from the newest checkpoint in --ckpt_path if there is one", group="ckpt"
    )
    logging_steps: int = flag(1, "log train metrics every this many optimizer steps", group="ckpt")
    eval_steps: int = flag(-1, "evaluate every this many optimizer steps (-1: end of each epoch)", group="ckpt")
    eval_at_start: bool = flag(False, "also evaluate before the first step (the untrained baseline)", group="ckpt")
    use_tensorboard: str = flag("", "TensorBoard log directory (empty: off)", group="ckpt")

    def __post_init__(self) -> None:
        self.check_wandb()
        if self.input_template and "{}" not in self.input_template:
            raise ValueError(f"--input_template {self.input_template!r} has no {{}} for the input")
        if self.logging_steps < 1:
            raise ValueError("--logging_steps must be >= 1")
