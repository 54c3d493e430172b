"""Supervised fine-tuning: next-token loss on response tokens only.

Run::

    torchrun --nproc_per_node N -m learner.train_sft --model.model_name_or_path MODEL \
        --data.dataset data.jsonl --data.input_key question --data.output_key answer \
        --data.apply_chat_template --ckpt.output_dir out/sft
    torchrun ... -m learner.train_sft --pretrain MODEL --dataset data.jsonl ... --save_path out/sft
    deepspeed --module learner.train_sft ...        # same flags
    python -m learner.train_sft ...                 # a world of one

Flags are OpenRLHF 0.10's dotted names or the older flat ones (second line), mixed freely
(``learner.supervised.config``). Rows are prompt/response pairs
(``--data.input_key``/``--data.output_key``) or, without ``--data.output_key``, whole chats (a
list of messages in ``--data.input_key``: every assistant turn is learned, OpenRLHF's
``--data.multiturn``). ``--ds.packing_samples`` packs each micro-batch into one row with
attention kept within each sample (position-id restarts; see ``learner.supervised.sft_data``).
The final model is saved in HF format to ``--ckpt.output_dir`` (``--save_path``).

Differences from OpenRLHF's ``train_sft``: the loss is normalised by the optimizer step's
global response-token count (OpenRLHF: per micro-batch); packing also works on CPU (SDPA
block-diagonal mask) without flash-attn; LoRA (``--ds.lora.rank``) saves a merged model plus
``OUTPUT_DIR/adapter`` (docs/trainers.md); no ring attention, MoE aux loss or Muon yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config import flag, parse, section
from learner.supervised.config import DataSection, ModelSection, SupervisedCkptSection, TrainerConfig, TrainSection


@dataclass
class SFTModelSection(ModelSection):
    """The trained causal LM."""

    pretrain_mode_enable: bool = flag(
        False, "loss on every token (continued pre-training), not just responses", flat="pretrain_mode"
    )


@dataclass
class SFTDataSection(DataSection):
    """Prompt/response rows, or whole chats."""

    input_key: str = flag(
        "input", "column with the prompt (or the whole chat without --data.output_key)", flat="input_key"
    )
    output_key: str = flag(
        "", "column with the response; empty: --data.input_key holds chat messages", flat="output_key"
    )
    multiturn: bool = flag(
        False,
        "rows are whole chats in --data.input_key, every assistant turn learned (what rayless does with any chat "
        "row when --data.output_key is empty); needs --data.apply_chat_template",
        flat="multiturn",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.multiturn and (self.output_key or not self.apply_chat_template):
            raise ValueError(
                "--data.multiturn (--multiturn) learns whole chats: put each in --data.input_key, give no "
                "--data.output_key, and add --data.apply_chat_template"
            )


@dataclass
class SFTConfig(TrainerConfig):
    """Every flag of ``learner.train_sft``, by section."""

    packing: ClassVar[bool] = True
    model: SFTModelSection = section(SFTModelSection, "the trained model")
    train: TrainSection = section(TrainSection, "the training loop", defaults={"max_epochs": 2})
    data: SFTDataSection = section(
        SFTDataSection, "the training data", defaults={"input_template": "User: {}\nAssistant: "}
    )
    ckpt: SupervisedCkptSection = section(
        SupervisedCkptSection, "checkpoints and the final model", defaults={"output_dir": "./ckpt/sft"}
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse(SFTConfig, argv, description=__doc__.split("\n")[0], prog="learner.train_sft")
    from learner.runtime.checkpoint import CheckpointError  # torch and DeepSpeed only after the flags parse
    from learner.supervised.sft_trainer import run

    try:
        run(cfg)
    except CheckpointError as e:  # damaged, or made with other settings: one line naming it
        raise SystemExit(f"learner.train_sft: {e}") from None


if __name__ == "__main__":
    main()
