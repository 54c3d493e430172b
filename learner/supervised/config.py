"""The config of ``learner.train_sft``, ``learner.train_rm`` and ``learner.train_dpo``: sections
named as OpenRLHF 0.10's ``openrlhf.cli.train_{sft,rm,dpo}`` name them.

Every flag answers to its dotted name (``--model.model_name_or_path``, ``--adam.lr``,
``--train.batch_size``) and to the flat name of the older releases and of rayless's first
trainers, declared next to it (``--pretrain``, ``--learning_rate``, ``--train_batch_size``);
both may be mixed in one command (``common.config``). As in OpenRLHF the optimizer fields sit at
the top level (``--adam.lr``, ``--lr_scheduler``, ``--max_norm``: ``OptimizerFields``), and the
``ds``, ``ckpt`` and ``logger`` sections are the ones ``learner.train_ppo`` has
(``learner.runtime``). Each trainer's module adds its own ``model`` and ``data`` fields and
changes defaults (``learner.train_sft.SFTConfig`` ...).

Flags OpenRLHF has that rayless cannot act on are accepted and marked ``inert``: setting one is
said once at start-up (``TrainerConfig.notices``). Checks inside a section live in its
``__post_init__``; rules across sections in the trainer's root config. No torch is imported
here, so ``--help`` answers at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from common.config import flag, section
from learner.runtime.checkpoint_config import CkptSection
from learner.runtime.flags import OPTIMIZER_FLAT, AdamSection, DSSection, OptimizerFields
from learner.runtime.tracking import LoggerSection

NOT_YET = "not built yet (issue 38)"

# The older flat names of the top-level ``adam`` section (``--adam_betas``, ``--l2``, ...: the ones
# train_ppo declares for both of its models) plus the supervised trainers' ``--learning_rate``.
ADAM_FLAT = {
    **{k.removeprefix("adam."): v for k, v in OPTIMIZER_FLAT.items() if k.startswith("adam.")},
    "lr": "learning_rate",
}


@dataclass
class ModelSection:
    """The trained model (OpenRLHF's ``model.*``); each trainer adds its loss's flags."""

    model_name_or_path: str = flag(
        "", "model to start from: local HF directory or hub name", required=True, flat="pretrain"
    )
    gradient_checkpointing_enable: bool = flag(
        False, "recompute activations in backward to save memory", flat="gradient_checkpointing"
    )
    gradient_checkpointing_reentrant: bool = flag(
        False, "reentrant checkpointing", inert="rayless uses non-reentrant checkpointing (torch's recommendation)"
    )
    aux_loss_coef: float = flag(0.0, "MoE balancing loss", inert="MoE balancing losses are not built in rayless")


@dataclass
class TrainSection:
    """The training loop: batch sizes, epochs, the seed."""

    batch_size: int = flag(128, "samples per optimizer step, over all ranks", flat="train_batch_size")
    micro_batch_size: int = flag(
        8,
        "samples per forward/backward pass per rank (gradient accumulation is derived and must divide)",
        flat="micro_train_batch_size",
    )
    max_epochs: int = flag(1, "passes over the training data", flat="max_epochs")
    seed: int = flag(42, "seed of data order and initialisation", flat="seed")
    full_determinism_enable: bool = flag(
        False,
        "reproducible training: torch runs deterministic kernels only (torch.use_deterministic_algorithms, cuDNN "
        "deterministic, cuBLAS workspace), as OpenRLHF's transformers.enable_full_determinism; slower on GPUs",
        flat="full_determinism",
    )

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError(
                f"--train.batch_size (--train_batch_size) and --train.micro_batch_size (--micro_train_batch_size) "
                f"must be >= 1, got {self.batch_size} and {self.micro_batch_size}"
            )
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"--train_batch_size {self.batch_size} must be a multiple of "
                f"--micro_train_batch_size {self.micro_batch_size}"
            )
        if self.max_epochs < 1:
            raise ValueError(f"--train.max_epochs (--max_epochs) must be >= 1, got {self.max_epochs}")


@dataclass
class DataSection:
    """The training data and how rows become tokens; each trainer adds its columns."""

    dataset: str = flag(
        "",
        "training data: json/jsonl/parquet file, saved dataset dir, folder, or hub name; comma-separated to mix",
        required=True,
        flat="dataset",
    )
    dataset_probs: str = flag(
        "", "comma-separated sampling probabilities for the --data.dataset sources", flat="dataset_probs"
    )
    dataset_split: str = flag(
        "train", "split of a saved/hub dataset to train on", flat="dataset_split", aliases=("--train_split",)
    )
    max_samples: int = flag(100_000_000, "use at most this many rows of each source", flat="max_samples")
    max_len: int = flag(2048, "max tokens per sequence (prompt + response); longer ones are truncated", flat="max_len")
    input_template: str = flag(
        "",
        "template with one {} for the prompt when not using the chat template, e.g. 'User: {}\\nAssistant: '",
        flat="input_template",
    )
    apply_chat_template: bool = flag(
        False, "render rows with the tokenizer's chat template", flat="apply_chat_template"
    )
    tokenizer_chat_template: str = flag(
        "", "override the tokenizer's chat template (a Jinja string)", flat="tokenizer_chat_template"
    )
    skip_bad_rows: bool = flag(
        False,
        "skip rows with a missing/empty key (counted) instead of failing with the file, row and key",
        flat="skip_bad_rows",
    )
    disable_fast_tokenizer: bool = flag(
        False,
        "slow tokenizer",
        inert="rayless needs the fast tokenizer: its character offsets find the response tokens",
    )
    dataloader_num_workers: int = flag(
        0, "dataloader workers", inert="rows are encoded once, in memory, before training: the loader reads no files"
    )

    def __post_init__(self) -> None:
        if self.input_template and "{}" not in self.input_template:
            raise ValueError(
                f"--data.input_template (--input_template) {self.input_template!r} has no {{}} for the input"
            )
        if self.max_len < 1:
            raise ValueError(f"--data.max_len (--max_len) must be >= 1, got {self.max_len}")
        if self.max_samples < 1:
            raise ValueError(f"--data.max_samples (--max_samples) must be >= 1, got {self.max_samples}")


@dataclass
class PairDataSection(DataSection):
    """Preference pairs (train_rm, train_dpo): a prompt and a chosen and a rejected response."""

    prompt_key: str = flag(
        "", "column with the prompt; empty: chosen/rejected hold whole texts or chats", flat="prompt_key"
    )
    chosen_key: str = flag("chosen", "column with the preferred response", flat="chosen_key")
    rejected_key: str = flag("rejected", "column with the dispreferred response", flat="rejected_key")

    def keys(self) -> list[str]:
        """The columns every row must have."""
        return ([self.prompt_key] if self.prompt_key else []) + [self.chosen_key, self.rejected_key]


@dataclass
class EvalSection:
    """Held-out evaluation (never trained on)."""

    dataset: str = flag("", "evaluation data (same forms as --data.dataset); none: no eval", flat="eval_dataset")
    split: str = flag("train", "split of --eval.dataset", flat="eval_split")
    steps: int = flag(-1, "evaluate every this many optimizer steps (-1: end of each epoch)", flat="eval_steps")
    at_start: bool = flag(
        False, "also evaluate before the first step (the untrained baseline; rayless's own)", flat="eval_at_start"
    )


@dataclass
class SupervisedCkptSection(CkptSection):
    """Checkpoints (counted in optimizer steps) and the final model."""

    disable_ds: bool = flag(
        False,
        "checkpoints without the DeepSpeed states",
        flat="disable_ds_ckpt",
        inert="the supervised trainers' checkpoints always hold the DeepSpeed states (a resume needs them)",
    )


@dataclass
class TrainerConfig(OptimizerFields):
    """What the three trainers share. Checks that cannot stop the run but concern the user
    (a flag that cannot act here) are kept in ``notices``, which the run logs once on rank 0
    (``learner.supervised.trainer.setup_run``): the flags parse before logging is set up."""

    adam: AdamSection = section(AdamSection, "AdamW", flat=ADAM_FLAT, defaults={"lr": 5e-6})
    model: ModelSection = section(ModelSection, "the trained model")
    train: TrainSection = section(TrainSection, "the training loop")
    data: DataSection = section(DataSection, "the training data")
    eval: EvalSection = section(EvalSection, "held-out evaluation")
    ds: DSSection = section(DSSection, "DeepSpeed and numerics")
    ckpt: SupervisedCkptSection = section(SupervisedCkptSection, "checkpoints and the final model")
    logger: LoggerSection = section(LoggerSection, "metrics: train_log.jsonl, TensorBoard, Weights & Biases")
    local_rank: int = flag(-1, "set by the deepspeed launcher", inert="the rank comes from the environment")
    use_ms: bool = flag(
        False, "ModelScope hub", inert="no hub is reached through ModelScope: pass local paths or HF names"
    )
    notices: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    # train_rm trains a value head (--ds.value_head_prefix names it); SFT and DPO have none.
    value_head: ClassVar[bool] = False
    # train_sft packs samples (--ds.packing_samples); the pair trainers pad.
    packing: ClassVar[bool] = False

    def given_notices(self, given: Mapping[str, Any]) -> list[str]:
        """Lines about flags given that these values leave without effect (common.config asks)."""
        return self.unused_muon(given)

    def __post_init__(self) -> None:
        self.check_optimizer()
        self.notices = []  # common.config puts the inert flags' lines first
        if self.ds.value_head_prefix != "score" and not self.value_head:
            self.notices.append(
                f"--ds.value_head_prefix {self.ds.value_head_prefix}: accepted, but it names a reward model's head "
                "and this trainer trains none"
            )
        if self.ds.ring_attn_size > 1:
            self.notices.append(
                f"--ds.ring_attn_size {self.ds.ring_attn_size}: accepted, but the supervised trainers do not split "
                "sequences yet (the policy in train_ppo does): every rank holds whole sequences"
            )
        if self.ds.packing_samples and not self.packing:
            # Padded rows give the same losses: packing would only save the padding's compute.
            self.notices.append(f"--ds.packing_samples: accepted, but packing pairs is {NOT_YET}: rows are padded")
