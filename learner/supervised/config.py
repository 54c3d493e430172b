"""Flags shared by ``learner.train_sft``, ``learner.train_rm`` and ``learner.train_dpo``.

Names and meanings follow OpenRLHF's ``openrlhf.cli.train_*`` so scripts port by swapping
the module; the checkpoint flags (``--save_steps``, ``--ckpt_path``, ``--max_ckpt_num``,
``--load_checkpoint``, ``--save_hf_ckpt``) come from
``learner.runtime.checkpoint_config.CheckpointFlags`` and the optimizer/DeepSpeed flags (ZeRO
stage, bf16, offload, checkpointing, weight decay, betas, clipping, warm-up, seed) from
``learner.runtime.flags.OptimizerFlags``, and the Weights & Biases flags from
``learner.runtime.tracking.WandbFlags``, all shared with ``learner.train_ppo``. No torch is imported here, so
``--help`` is instant. Each trainer subclasses ``TrainerConfig``, adds its own flags and overrides defaults.

Flags accepted for compatibility with an explanation rather than an effect: ``--local_rank``
(the ``deepspeed`` launcher passes it; the rank is read from the environment).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import flag
from learner.runtime.checkpoint_config import CheckpointFlags
from learner.runtime.flags import OptimizerFlags
from learner.runtime.tracking import WandbFlags


@dataclass
class TrainerConfig(CheckpointFlags, OptimizerFlags, WandbFlags):
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
    # The rest of the optimizer and DeepSpeed flags: OptimizerFlags (shared with train_ppo);
    # the supervised trainers warm the LR up by default, as OpenRLHF's do.
    lr_warmup_ratio: float = flag(0.03, "fraction of optimizer steps of linear LR warm-up", group="optim")
    local_rank: int = flag(
        -1, "set by the deepspeed launcher; ignored (the rank comes from the env)", group="deepspeed"
    )

    # ---- logging (the checkpoint flags: CheckpointFlags)
    logging_steps: int = flag(1, "log train metrics every this many optimizer steps", group="logging")
    eval_steps: int = flag(-1, "evaluate every this many optimizer steps (-1: end of each epoch)", group="logging")
    eval_at_start: bool = flag(False, "also evaluate before the first step (the untrained baseline)", group="logging")
    use_tensorboard: str = flag("", "TensorBoard log directory (empty: off)", group="logging")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_optimizer()
        self.check_lora()
        self.check_wandb()
        if self.input_template and "{}" not in self.input_template:
            raise ValueError(f"--input_template {self.input_template!r} has no {{}} for the input")
        if self.logging_steps < 1:
            raise ValueError("--logging_steps must be >= 1")
